"""Step statistics that mean what their names say across micro-batches and ranks."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch


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
