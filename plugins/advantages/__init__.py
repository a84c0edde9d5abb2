"""Built-in advantage estimators: `gae` (PPO with a critic) and `grpo` (group baseline)."""

from __future__ import annotations

import torch

from rlver import hookimpl
from rlver.interfaces import AdvantageBatch, AdvantageEstimator, AdvantageResult
from rlver.rl.advantages import gae, group_normalized


class GAEEstimator(AdvantageEstimator):
    """Generalised advantage estimation with a learned critic (PPO).

    The dialogue reward sits on the last policy token of the last turn: the
    simulator's final emotion is only known then, and with gamma = lambda = 1
    (the paper's setting) every policy token's advantage is R - V(s_t).

    Args:
        gamma: Discount per policy token.
        lam: GAE lambda.
        whiten: Normalise advantages to zero mean, unit variance over the tokens of the whole
            step: every rank's valid dialogues (failed ones are left out). With one dialogue per
            rank (the paper's PPO recipes) a per-rank statistic would cancel the reward.
    """

    requires_critic = True

    def __init__(self, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True) -> None:
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma ({gamma}) must be within [0, 1]")
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam ({lam}) must be within [0, 1]")
        self.gamma, self.lam, self.whiten = gamma, lam, whiten

    def __call__(self, batch: AdvantageBatch) -> AdvantageResult:
        if batch.values is None:
            raise ValueError("the gae estimator needs critic values")
        advantages, returns = gae(batch.token_rewards, batch.values, batch.mask, self.gamma, self.lam)
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


@hookimpl
def rlver_register_advantages(register):
    register("gae", GAEEstimator)
    register("grpo", GRPOEstimator)
