"""Step statistics that mean what their names say across micro-batches and ranks."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from rlver.rl.advantages import turn_table


class WeightedMeans:
    """Means of per-micro-batch values, each weighted by what its micro-batch weighs in the loss.

    A mean of micro-batch means gives a 3-token micro-batch the say of a 300-token one; weighted by
    tokens (token-mean) or sequences (seq-mean), the result is the step's own token-mean over every
    rank, like the loss the gradient came from.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.sums = dict.fromkeys(self.names, 0.0)
        self.total = 0.0

    def add(self, values: Mapping[str, float], weight: float) -> None:
        unknown = set(values) - set(self.names)
        if unknown:
            raise KeyError(f"not a declared statistic: {sorted(unknown)}")
        for name, value in values.items():
            self.sums[name] += value * weight
        self.total += weight

    def means(
        self,
        reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor,
        device: torch.device | str = "cpu",
    ) -> dict[str, float]:
        """The weighted means over every rank (`reduce_sum` sums a tensor across ranks); a
        collective: every rank calls it with the same names. Empty when nothing was added anywhere."""
        local = torch.tensor([*(self.sums[name] for name in self.names), self.total], dtype=torch.float64)
        summed = reduce_sum(local.to(device)).cpu()
        if summed[-1] <= 0:
            return {}
        return {name: float(summed[i] / summed[-1]) for i, name in enumerate(self.names)}


def turn_metrics(
    turn_rewards: torch.Tensor,
    advantages: torch.Tensor,
    turn_ids: torch.Tensor,
    mask: torch.Tensor,
    valid: torch.Tensor,
    turns: int,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, float]:
    """Where the step's credit went, by turn index (1-based), over every rank's valid dialogues:
    `turn/reward_mean_k` (turn k's reward, over the dialogues that reached it),
    `turn/advantage_mean_k` (over their tokens of turn k) and `turn/dialogues_k`.

    A collective (the sums are global), so every rank logs the same keys and values; a turn
    index no dialogue reached is left out.
    """

    def widened(table: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((table.shape[0], turns), dtype=torch.float64, device=table.device)
        width = min(turns, table.shape[1])
        out[:, :width] = table[:, :width]
        return out

    tokens = widened(turn_table(mask.to(advantages.dtype), turn_ids, mask, "sum"))
    counted = (tokens > 0) & valid.bool()[:, None]
    tokens = tokens * counted
    stats = torch.stack(
        [
            (widened(turn_rewards.to(advantages.device)) * counted).sum(dim=0),
            counted.sum(dim=0).to(torch.float64),
            (widened(turn_table(advantages, turn_ids, mask, "sum")) * counted).sum(dim=0),
            tokens.sum(dim=0),
        ]
    )
    reward_sums, dialogues, advantage_sums, token_counts = reduce_sum(stats).cpu()
    metrics = {}
    for turn in range(turns):
        if dialogues[turn] > 0:
            k = turn + 1
            metrics[f"turn/reward_mean_{k}"] = float(reward_sums[turn] / dialogues[turn])
            tokens = token_counts[turn].clamp(min=1)
            metrics[f"turn/advantage_mean_{k}"] = float(advantage_sums[turn] / tokens)
            metrics[f"turn/dialogues_{k}"] = float(dialogues[turn])
    return metrics
