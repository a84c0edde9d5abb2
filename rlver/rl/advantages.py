"""Advantage estimation over per-dialogue timelines of policy tokens.

A dialogue's timeline is the sequence of its policy-sampled tokens in order,
across all its turns (user tokens are not actions and are left out). Tensors are
(batch, time), right-padded; `mask` is 1 on real timeline positions. The
dialogue reward sits on the last real position (see `terminal_rewards`).
"""

from __future__ import annotations

import torch


def terminal_rewards(dialogue_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) token rewards: each dialogue's reward on its last real position, 0 elsewhere."""
    if dialogue_rewards.shape != mask.shape[:1]:
        raise ValueError(
            f"dialogue_rewards {tuple(dialogue_rewards.shape)} does not match mask {tuple(mask.shape)}"
        )
    lengths = mask.long().sum(dim=1)
    if (lengths == 0).any():
        raise ValueError("every dialogue needs at least one policy token")
    rewards = torch.zeros(mask.shape, dtype=dialogue_rewards.dtype, device=mask.device)
    rewards[torch.arange(mask.shape[0], device=mask.device), lengths - 1] = dialogue_rewards
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation. Returns (advantages, returns), both (B, T).

    delta_t = r_t + gamma * V_{t+1} - V_t, with V after the last real position = 0;
    A_t = delta_t + gamma * lam * A_{t+1}; returns = A + V. Padded positions are 0.
    """
    if not rewards.shape == values.shape == mask.shape:
        raise ValueError(f"shapes differ: rewards {rewards.shape}, values {values.shape}, mask {mask.shape}")
    mask = mask.to(values.dtype)
    values = values * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        # Padding sits after the real positions: zero the carry there so it never leaks in.
        running = running * mask[:, t]
        next_value = values[:, t] * mask[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask


def group_normalized(
    scores: torch.Tensor, group_ids: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (r - group mean) / (group std + eps), or without the std when switched off.

    Returns (advantages (B,), degenerate (B,) bool) where degenerate marks members
    of groups whose scores are all equal (their advantage is exactly 0).
    std is the unbiased sample std, as in the reference; a group of one is degenerate.
    """
    if scores.shape != group_ids.shape or scores.dim() != 1:
        raise ValueError(
            f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D shapes"
        )
    advantages = torch.zeros_like(scores)
    degenerate = torch.zeros_like(scores, dtype=torch.bool)
    for group in torch.unique(group_ids):
        members = group_ids == group
        group_scores = scores[members]
        if group_scores.numel() < 2 or bool((group_scores == group_scores[0]).all()):
            degenerate[members] = True
            continue
        centred = group_scores - group_scores.mean()
        advantages[members] = centred / (group_scores.std() + eps) if scale_by_std else centred
    return advantages, degenerate


# --------------------------------------------------------------------------- turn-level credit
def turn_end_rewards(turn_rewards: torch.Tensor, turn_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) token rewards: turn k's reward (turn_rewards[:, k]) on the last position of turn k.

    A turn without positions (none in practice: every reply has a token) hands its reward to
    the last position of an earlier turn, or the first position; nothing is lost.
    """
    if turn_rewards.dim() != 2 or turn_rewards.shape[0] != mask.shape[0] or turn_ids.shape != mask.shape:
        raise ValueError(
            f"turn_rewards {tuple(turn_rewards.shape)}, turn_ids {tuple(turn_ids.shape)} and mask "
            f"{tuple(mask.shape)} do not describe the same dialogues"
        )
    real = mask.bool()
    if not real.any(dim=1).all():
        raise ValueError("every dialogue needs at least one policy token")
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(turn_ids)
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards = torch.zeros(mask.shape, dtype=turn_rewards.dtype, device=mask.device)
    for turn in range(turn_rewards.shape[1]):
        last = torch.where(real & (turn_ids <= turn), positions, -1).max(dim=1).values.clamp(min=0)
        rewards.index_put_((rows, last), turn_rewards[:, turn].to(rewards.dtype), accumulate=True)
    return rewards


def turn_table(per_token: torch.Tensor, turn_ids: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """(B, K) per-turn view of a (B, T) tensor: its `sum` over each turn's positions, or its
    value at each turn's `first` position; 0 where a dialogue has no such turn."""
    real = mask.bool()
    turns = int(turn_ids[real].max().item()) + 1 if real.any() else 1
    table = torch.zeros((mask.shape[0], turns), dtype=per_token.dtype, device=per_token.device)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(turn_ids)
    rows = torch.arange(mask.shape[0], device=mask.device)
    for turn in range(turns):
        in_turn = real & (turn_ids == turn)
        if how == "sum":
            table[:, turn] = (per_token * in_turn).sum(dim=1)
        else:  # first
            first = torch.where(in_turn, positions, mask.shape[1]).min(dim=1).values
            present = first < mask.shape[1]
            table[:, turn] = torch.where(present, per_token[rows, first.clamp(max=mask.shape[1] - 1)], 0)
    return table


def turn_presence(turn_ids: torch.Tensor, mask: torch.Tensor, turns: int) -> torch.Tensor:
    """(B, K) bool: the dialogue has positions in turn k."""
    real = mask.bool()
    return torch.stack([(real & (turn_ids == turn)).any(dim=1) for turn in range(turns)], dim=1)


def broadcast_turns(per_turn: torch.Tensor, turn_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T): each position gets its turn's value from the (B, K) table; 0 on padding."""
    index = turn_ids.clamp(max=per_turn.shape[1] - 1)
    return per_turn.gather(1, index) * mask.to(per_turn.dtype)


def turn_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, turn_ids: torch.Tensor,
    gamma: float = 1.0, lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """GAE with the turn as the time step. Returns (advantages, returns), both (B, T).

    Turn k's reward is the sum of its positions' rewards, its value the critic's at its first
    position; delta_k = r_k + gamma * V_{k+1} - V_k (V after the last turn = 0), A_k = delta_k +
    gamma * lam * A_{k+1}. Every position of turn k gets A_k, and A_k + V_k as its value target.
    """
    if not rewards.shape == values.shape == mask.shape == turn_ids.shape:
        raise ValueError(f"shapes differ: rewards {rewards.shape}, values {values.shape}, mask {mask.shape}")
    per_turn_rewards = turn_table(rewards, turn_ids, mask, "sum")
    per_turn_values = turn_table(values, turn_ids, mask, "first")
    present = turn_presence(turn_ids, mask, per_turn_rewards.shape[1]).to(values.dtype)
    advantages = torch.zeros_like(per_turn_values)
    running = torch.zeros_like(per_turn_values[:, 0])
    next_value = torch.zeros_like(per_turn_values[:, 0])
    for turn in reversed(range(per_turn_values.shape[1])):
        delta = per_turn_rewards[:, turn] + gamma * next_value - per_turn_values[:, turn]
        # A turn a dialogue does not have passes the carry and next value through untouched.
        running = torch.where(present[:, turn] > 0, delta + gamma * lam * running, running)
        next_value = torch.where(present[:, turn] > 0, per_turn_values[:, turn], next_value)
        advantages[:, turn] = running * present[:, turn]
    returns = (advantages + per_turn_values) * present
    return broadcast_turns(advantages, turn_ids, mask), broadcast_turns(returns, turn_ids, mask)


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, turn_ids: torch.Tensor) -> torch.Tensor:
    """(B, K) G_{i,k}: dialogue i's rewards from turn k on (gamma = 1); 0 on turns it lacks."""
    per_turn = turn_table(rewards, turn_ids, mask, "sum")
    present = turn_presence(turn_ids, mask, per_turn.shape[1])
    return per_turn.flip(1).cumsum(1).flip(1) * present


def leave_one_out_std(values: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """(B,) the sample std of a population without each of its members: `totals` is (count, sum,
    sum of squares) of the whole population (e.g. every rank's dialogues), `values` (B,) the
    members to leave out one at a time; 0 where fewer than two would remain."""
    count = totals[0] - 1
    total = totals[1] - values
    squares = totals[2] - values.square()
    variance = (squares - total.square() / count.clamp(min=1)) / (count - 1).clamp(min=1)
    return torch.where(count >= 2, variance.clamp(min=0).sqrt(), torch.zeros_like(values))


def leave_one_out_turn_credit(
    rewards: torch.Tensor, mask: torch.Tensor, turn_ids: torch.Tensor, group_ids: torch.Tensor,
    valid: torch.Tensor | None = None, *, scale_by_std: bool = True, std_floor: float = 0.01,
    scale_floors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Critic-free turn credit: (B, K) per-turn advantages, and (B, K) bool marking the turns
    that had no baseline (no other member of the group reached them).

    G_{i,k} is dialogue i's return from turn k on (gamma = 1: the sum of its turn rewards from
    k). Its baseline is the mean of G_{j,k} over the other valid members j of its group that
    reached turn k (0 when none did), and the advantage (G_{i,k} - baseline) / s_i, s_i the
    std of the other members' whole returns G_{j,0}, at least `std_floor` and at least
    `scale_floors[i]` (1 with fewer than two others, or without `scale_by_std`): floors, because
    others that all scored alike would otherwise blow up the one that did not. A floor that
    depends on dialogue i's own return would bias the gradient: `scale_floors` must be computed
    without it (TurnCreditEstimator uses the step's std without dialogue i). See
    rlver_plugins.advantages.TurnCreditEstimator for why this baseline is unbiased where
    per-turn-index normalisation is not.
    """
    present = turn_presence(turn_ids, mask, turn_table(rewards, turn_ids, mask, "sum").shape[1])
    valid = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device) if valid is None else valid.bool()
    to_go = returns_to_go(rewards, mask, turn_ids)
    advantages = torch.zeros_like(to_go)
    unmatched = torch.zeros_like(present)
    for group in torch.unique(group_ids[valid]):
        members = torch.nonzero((group_ids == group) & valid).flatten()
        for i in members.tolist():
            others = members[members != i]
            scale = 1.0
            if scale_by_std and others.numel() >= 2:
                floor = std_floor if scale_floors is None else max(std_floor, float(scale_floors[i]))
                scale = max(float(to_go[others, 0].std()), floor)
            reached = present[others]  # (n-1, K)
            count = reached.sum(dim=0)
            baseline = (to_go[others] * reached).sum(dim=0) / count.clamp(min=1)
            advantages[i] = (to_go[i] - baseline) * present[i] / scale
            unmatched[i] = present[i] & (count == 0)
    return advantages, unmatched
