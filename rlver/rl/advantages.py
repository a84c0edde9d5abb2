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
