"""Built-in advantage estimators: `gae` (PPO with a critic), `grpo` (group baseline), and the
turn-level ones: `turn_gae` (the turn as GAE's time step) and `turn_credit` (critic-free)."""

from __future__ import annotations

import math

import torch

from rlver import hookimpl
from rlver.core.interfaces import AdvantageBatch, AdvantageEstimator, AdvantageResult
from rlver.rl.advantages import (
    broadcast_turns,
    gae,
    group_normalized,
    leave_one_out_std,
    leave_one_out_turn_credit,
    returns_to_go,
    turn_gae,
)


class GAEEstimator(AdvantageEstimator):
    """Generalised advantage estimation with a learned critic (PPO).

    Each turn's reward sits on that turn's last token (a dialogue-level reward, such as the
    paper's final emotion, on the last turn's): with gamma = lambda = 1 (the paper's setting)
    a token's advantage is the reward still to come, R_{>=t}, less V(s_t).

    Args:
        gamma: Discount per policy token.
        lam: GAE lambda.
        whiten: Normalise advantages to zero mean, unit variance over the tokens of the whole
            step: every rank's valid dialogues (failed ones are left out). With one dialogue per
            rank (the paper's PPO recipes) a per-rank statistic would cancel the reward.
    """

    requires_critic = True
    name = "gae"

    def __init__(self, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True) -> None:
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma ({gamma}) must be within [0, 1]")
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam ({lam}) must be within [0, 1]")
        self.gamma, self.lam, self.whiten = gamma, lam, whiten

    def _advantages(self, batch: AdvantageBatch):
        return gae(batch.token_rewards, batch.values, batch.mask, self.gamma, self.lam)

    def __call__(self, batch: AdvantageBatch) -> AdvantageResult:
        if batch.values is None:
            raise ValueError(f"the {self.name} estimator needs critic values")
        advantages, returns = self._advantages(batch)
        counted = batch.valid_mask().to(advantages.dtype)
        if self.whiten:
            # One all-reduce of (count, sum, sum of squares): the step's mean and variance.
            totals = batch.global_sum(
                torch.stack(
                    [counted.sum(), (advantages * counted).sum(), (advantages.square() * counted).sum()]
                )
            )
            count = totals[0].clamp(min=1)
            mean = totals[1] / count
            variance = (totals[2] / count - mean.square()).clamp(min=0)
            advantages = (advantages - mean) * torch.rsqrt(variance + 1e-8)
        return AdvantageResult(advantages=advantages * counted, returns=returns)


def _turn_ids(batch: AdvantageBatch):
    return batch.turn_ids if batch.turn_ids is not None else torch.zeros_like(batch.mask, dtype=torch.long)


class TurnGAEEstimator(GAEEstimator):
    """GAE with the turn as the time step (a learned critic, as `gae`).

    A turn's reward is what its tokens carry (its per-turn reward, a dialogue reward on the
    last turn, any in-reward KL); its value the critic's at the turn's first token, where the
    user's message has just been read. Every token of a turn gets the turn's advantage, so one
    reply is credited as one action, and the critic learns one value per turn: gamma and lam
    discount per turn, not per token (a 300-token reply is one step, not 300).

    Args:
        gamma: Discount per turn.
        lam: GAE lambda per turn.
        whiten: As `gae`: over the tokens of the whole step, failed dialogues left out.
    """

    name = "turn_gae"

    def _advantages(self, batch: AdvantageBatch):
        return turn_gae(batch.token_rewards, batch.values, batch.mask, _turn_ids(batch), self.gamma, self.lam)


class GRPOEstimator(AdvantageEstimator):
    """Group-relative advantages: (r - group mean) / (group std + eps), one value per dialogue.

    A dialogue's score is the sum of its token rewards (its reward, less any
    in-reward KL). Groups whose scores are all equal get zero advantage and are
    counted in `advantage/degenerate_group_fraction`.

    Args:
        scale_by_std: Divide by the group's std (False: only subtract the mean).
        eps: Added to the std.
    """

    requires_critic = False
    requires_groups = True

    def __init__(self, scale_by_std: bool = True, eps: float = 1e-6) -> None:
        if eps < 0:
            raise ValueError(f"eps ({eps}) must be >= 0")
        self.scale_by_std, self.eps = scale_by_std, eps

    def __call__(self, batch: AdvantageBatch) -> AdvantageResult:
        scores = (batch.token_rewards * batch.mask).sum(dim=1)
        valid = batch.valid if batch.valid is not None else torch.ones_like(scores, dtype=torch.bool)
        # Groups are whole on one rank, so the baseline needs no other rank; an invalid
        # dialogue (failed simulator) is neither scored nor part of its group's baseline.
        group_ids = batch.group_ids[valid]
        per_dialogue = torch.zeros_like(scores)
        per_dialogue[valid], degenerate = group_normalized(
            scores[valid], group_ids, scale_by_std=self.scale_by_std, eps=self.eps
        )
        groups = torch.unique(group_ids)
        degenerate_groups = torch.unique(group_ids[degenerate]).numel()
        return AdvantageResult(
            advantages=per_dialogue[:, None] * batch.valid_mask().to(per_dialogue.dtype),
            metrics={
                "advantage/degenerate_groups": float(degenerate_groups),
                "advantage/degenerate_group_fraction": degenerate_groups / max(groups.numel(), 1),
            },
        )


class TurnCreditEstimator(AdvantageEstimator):
    """Critic-free turn credit for GRPO-style training: each turn's return-to-go against the rest
    of its group.

    Turn k of dialogue i gets G_{i,k} (the rewards of turns k, k+1, ...: with per-turn emotion
    changes, what this reply and the later ones moved) less b_{i,k}, the mean of G_{j,k} over
    the *other* members j of the group that reached turn k, divided by the std of the other
    members' whole returns (`scale_by_std`). At turn 1, where the members share the opening,
    this is GRPO with a leave-one-out baseline.

    Why the baseline is unbiased, also when dialogues end at different turns: the members are
    sampled independently from the shared opening, so b_{i,k} and the scale are functions of
    the other members' dialogues only, independent of dialogue i; E[grad log pi(a_{i,k}) b_{i,k}]
    = E[b_{i,k}] E[grad log pi(a_{i,k})] = 0. Which others reached turn k depends on their own
    dialogues, never on i's, so conditioning on it is harmless. What is biased: normalising by
    turn index with the dialogue itself inside the statistics (its own reward moves its
    baseline), and crediting a turn with its own reward alone, ranked against the dialogues
    still talking at that index: a reply that ends the dialogue early with a small gain then
    outranks one that sets up a larger gain later, since the later gain is only ever compared
    with other survivors (tests/unit/test_turn_credit.py builds that case). The scale is positive
    and independent of i too: it weights a group's gradient, it does not turn it.

    The divisor's floor is relative to the reward's scale: `relative_std_floor` times the larger
    of two spreads, neither of which holds dialogue i's own return (so the floor stays independent
    of i): the std of the whole returns of every other valid dialogue of the step (every rank's),
    and the same std of the steps before (a running mean, `scale_memory`). Without a floor, a
    group whose other members scored alike divides by `std_floor` alone: with rewards in [0, 1] and
    a floor of 0.01, one dialogue 0.5 apart gets an advantage of 50. The step's own spread alone
    vanishes in the case the floor is for: when every other dialogue of the step scored alike (all
    failed but one, the saturated case of emotion rewards), which earlier steps' spread covers. At
    the first step, with no earlier spread, the step's std with dialogue i in it stands in (a bias
    of that one step, where the floor binds).

    Args:
        scale_by_std: Divide by the std of the other members' returns (at least the floors).
        std_floor: The smallest divisor, in reward units.
        relative_std_floor: The smallest divisor as a fraction of the spread of whole returns
            (0: `std_floor` alone, as before this option).
        scale_memory: Weight of the earlier steps in the running spread (per step: new = memory x
            old + (1 - memory) x this step's std).
    """

    requires_critic = False
    requires_groups = True

    def __init__(
        self,
        scale_by_std: bool = True,
        std_floor: float = 0.01,
        relative_std_floor: float = 0.5,
        scale_memory: float = 0.9,
    ) -> None:
        if std_floor <= 0:
            raise ValueError(f"std_floor ({std_floor}) must be > 0")
        if relative_std_floor < 0:
            raise ValueError(f"relative_std_floor ({relative_std_floor}) must be >= 0")
        if not 0 <= scale_memory < 1:
            raise ValueError(f"scale_memory ({scale_memory}) must be within [0, 1)")
        self.scale_by_std, self.std_floor = scale_by_std, std_floor
        self.relative_std_floor, self.scale_memory = relative_std_floor, scale_memory
        self.earlier_spread: float | None = None  # the running std of whole returns, earlier steps

    def _scale_floors(self, batch: AdvantageBatch, turn_ids: torch.Tensor) -> torch.Tensor | None:
        """(B,) relative_std_floor x the step's std of whole returns without each dialogue."""
        if not self.scale_by_std or self.relative_std_floor == 0:
            return None
        whole = returns_to_go(batch.token_rewards, batch.mask, turn_ids)[:, 0]
        valid = batch.valid_mask().any(dim=1).to(whole.dtype)
        # One all-reduce of (count, sum, sum of squares): every rank's dialogues.
        totals = batch.global_sum(
            torch.stack([valid.sum(), (whole * valid).sum(), (whole.square() * valid).sum()])
        )
        others = leave_one_out_std(whole, totals)
        count, total, squares = (float(value) for value in totals)
        spread = math.sqrt(max(squares - total * total / count, 0.0) / (count - 1)) if count >= 2 else 0.0
        earlier = spread if self.earlier_spread is None else self.earlier_spread
        memory = self.scale_memory if self.earlier_spread is not None else 0.0
        self.earlier_spread = memory * earlier + (1 - memory) * spread  # for the next step
        return self.relative_std_floor * torch.clamp(others, min=earlier)

    def __call__(self, batch: AdvantageBatch) -> AdvantageResult:
        turn_ids = _turn_ids(batch)
        per_turn, unmatched = leave_one_out_turn_credit(
            batch.token_rewards, batch.mask, turn_ids, batch.group_ids, batch.valid,
            scale_by_std=self.scale_by_std, std_floor=self.std_floor,
            scale_floors=self._scale_floors(batch, turn_ids),
        )  # fmt: skip
        advantages = broadcast_turns(per_turn, turn_ids, batch.mask)
        counted = batch.valid_mask().to(advantages.dtype)
        return AdvantageResult(
            advantages=advantages * counted,
            metrics={"advantage/turns_without_baseline": float(unmatched.sum().item())},
        )


@hookimpl
def rlver_register_advantages(register):
    register("gae", GAEEstimator)
    register("grpo", GRPOEstimator)
    register("turn_gae", TurnGAEEstimator)
    register("turn_credit", TurnCreditEstimator)
