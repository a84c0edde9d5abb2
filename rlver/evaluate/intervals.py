"""Error bars for scores: a mean with its t interval, and a paired before/after change.

A score over a handful of simulated users is a sample, not a measurement: 16 users whose final
emotion moves by 5-10 points each give a mean whose 95% interval is several points wide. Every
before/after figure rlver prints carries that interval, so a reader can tell a gain from noise.
Paired, because before and after talk with the same users: the interval of the per-user changes
is much narrower than the difference of two unpaired means (a user's story sets most of its score).
The intervals are Student t intervals from scipy (exact for normally distributed per-user changes,
close to it for the means of 16 or more bounded scores).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    """A mean with its confidence interval (`low` = `high` = `mean` with fewer than two values)."""

    mean: float
    low: float
    high: float
    count: int
    confidence: float = CONFIDENCE

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def format(self, signed: bool = False) -> str:
        spec = "+.1f" if signed else ".1f"
        if self.count < 2:
            return f"{self.mean:{spec}}"
        return f"{self.mean:{spec}} [{self.low:{spec}}, {self.high:{spec}}]"

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class PairedChange:
    """After minus before, user by user: the mean change's interval and how many users moved which way."""

    change: Interval
    before: float
    after: float
    better: int
    worse: int

    @property
    def users(self) -> int:
        return self.change.count

    def format(self, noun: str = "users", verb: str = "ended happier") -> str:
        return f"{self.change.format(signed=True)}; {self.better}/{self.users} {noun} {verb}"

    def as_dict(self) -> dict[str, float]:
        return {
            "before": self.before,
            "after": self.after,
            "better": self.better,
            "worse": self.worse,
            **{f"change_{key}": value for key, value in self.change.as_dict().items()},
        }


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """The mean of `values` and its two-sided Student t interval."""
    from scipy import stats

    count = len(values)
    if count == 0:
        raise ValueError("mean_interval needs at least one value")
    mean = math.fsum(values) / count
    if count < 2:
        return Interval(mean, mean, mean, count, confidence)
    spread = stats.sem(values)
    if spread == 0 or not math.isfinite(spread):
        return Interval(mean, mean, mean, count, confidence)
    low, high = stats.t.interval(confidence, count - 1, loc=mean, scale=spread)
    return Interval(mean, float(low), float(high), count, confidence)


def paired_change(
    before: Sequence[float], after: Sequence[float], confidence: float = CONFIDENCE
) -> PairedChange:
    """The per-unit changes `after[i] - before[i]` (same users, same order) as a mean with its interval."""
    if len(before) != len(after):
        raise ValueError(f"paired_change needs as many values after ({len(after)}) as before ({len(before)})")
    changes = [b - a for a, b in zip(before, after, strict=True)]
    return PairedChange(
        change=mean_interval(changes, confidence),
        before=math.fsum(before) / max(len(before), 1),
        after=math.fsum(after) / max(len(after), 1),
        better=sum(change > 0 for change in changes),
        worse=sum(change < 0 for change in changes),
    )


def difference_of_means(
    before: Sequence[float], after: Sequence[float], confidence: float = CONFIDENCE
) -> Interval:
    """`mean(after) - mean(before)` of two independent samples, with Welch's t interval.

    For before/after scores on different items (nothing to pair): wider than a paired interval.
    `count` is the smaller sample's size; with fewer than two values a side, or no spread at all,
    the interval is the difference itself.
    """
    from scipy import stats

    if not before or not after:
        raise ValueError("difference_of_means needs at least one value on each side")
    difference = math.fsum(after) / len(after) - math.fsum(before) / len(before)
    count = min(len(before), len(after))
    if count < 2 or (max(before) == min(before) and max(after) == min(after)):
        return Interval(difference, difference, difference, count, confidence)
    test = stats.ttest_ind(after, before, equal_var=False)
    low, high = test.confidence_interval(confidence)
    return Interval(difference, float(low), float(high), count, confidence)


def paired_by_key(before: Mapping[str, float], after: Mapping[str, float]) -> PairedChange:
    """`paired_change` over the keys (profile ids) both sides have; refuses disjoint or partial pairs."""
    missing = sorted(set(before) ^ set(after))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"a paired change needs the same users on both sides; unpaired: {shown}")
    keys = sorted(before)
    return paired_change([before[k] for k in keys], [after[k] for k in keys])


def per_user_means(ids: Sequence[str], scores: Sequence[float]) -> dict[str, float]:
    """Scores averaged per user id (several evaluation samples per user count as one paired unit)."""
    sums: dict[str, list[float]] = {}
    for user, score in zip(ids, scores, strict=True):
        sums.setdefault(user, []).append(score)
    return {user: math.fsum(values) / len(values) for user, values in sums.items()}


@dataclass(frozen=True)
class TrainingRise:
    """A training curve's first and last quarter means and the rise between them, with its interval."""

    first: float
    last: float
    rise: Interval

    def format(self) -> str:
        """`31.5 -> 35.7 (+4.2 [+3.0, +5.4])`."""
        return f"{self.first:.1f} -> {self.last:.1f} ({self.rise.format(signed=True)})"


def training_rise(curve: Mapping[int, float]) -> TrainingRise | None:
    """The last quarter of a curve's steps against the first (None with fewer than 4 steps).

    Issue 39's measure of whether the training reward rose: a quarter's mean is far less noisy
    than one step's few dialogues. The rise's interval is Welch's over the two quarters' steps
    (`difference_of_means`): a step's mean final emotion moves about a point from step to step on
    a plateau (which users the step drew, the sampling), so a rise of 2.7 and one of 3.3 can be the
    same run's luck. The steps are taken as independent draws; a trend inside a quarter widens the
    interval, so it errs wide. With 1-step quarters (4-7 steps) there is no spread: no interval.
    """
    steps = sorted(curve)
    if len(steps) < 4:
        return None
    quarter = len(steps) // 4
    first = [curve[step] for step in steps[:quarter]]
    last = [curve[step] for step in steps[-quarter:]]
    return TrainingRise(
        math.fsum(first) / quarter, math.fsum(last) / quarter, difference_of_means(first, last)
    )
