"""An ablation's numbers: arms x seeds of training runs, summarized per arm and paired against the first.

Each run (one arm, one training seed) brings the greedy held-out score of every user before and
after training (`BeforeAfter`'s `before_after.json`) and its training curve (the mean final
emotion of each step's training dialogues: the one measure every arm shares, whatever its own
reward). Per arm: the mean over seeds of each run's mean over users, with the standard error
over seeds (the spread a reader should compare differences against).

Each arm's paired difference to the first arm (the reference): same training seed, same users,
so per (seed, user) the difference of the two greedy scores after training. Which interval:
a Student t interval over the seeds' mean differences (n_seeds - 1 degrees of freedom,
`rlver.evaluate.intervals.mean_interval`, scipy). Why not over all seeds x users as if
independent: the users of one seed talked with the same trained weights, so their differences
share that run's luck (the runs of the published ablations spread gains over 6+ points between
seeds, per-user noise is much smaller); pooling them would count one lucky run as 64 pieces of
evidence and give intervals far too narrow. The seed is the unit that is replicated
independently, so the interval is over seeds; the users enter through each seed's mean (which
averages their noise away) and are the same fixed set everywhere, like a benchmark's items, so
the interval speaks for these users. With a single common seed no training noise can be
measured: the interval is then over that seed's users and is labelled so (`unit: "users"`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rlver.evaluate.intervals import mean_interval, paired_by_key, training_rise

# The training reward's tail: the mean of a run's last steps, a less noisy end point than one step.
TAIL_STEPS = 3
# The evaluation against the users each run trained against (BeforeAfter's own scores).
TRAINING_SIMULATOR = "train"


@dataclass(frozen=True)
class RunScores:
    """One finished run: its arm, its seed, per-user greedy scores, and the training curve by step."""

    arm: str
    seed: int
    after: Mapping[str, float]
    before: Mapping[str, float] | None = None
    curve: Mapping[int, float] = field(default_factory=dict)
    seconds: float | None = None
    gaming: Mapping[str, Any] | None = None  # BeforeAfter's shares of the after-training replies
    evaluator: str = TRAINING_SIMULATOR  # whose users gave the scores (BeforeAfter's evaluator label)

    @property
    def after_mean(self) -> float:
        return math.fsum(self.after.values()) / len(self.after)

    @property
    def before_mean(self) -> float | None:
        if not self.before:
            return None
        return math.fsum(self.before.values()) / len(self.before)

    @property
    def gain(self) -> float | None:
        """After minus before, paired per user (None without a `before`)."""
        if not self.before:
            return None
        users = _same_users(self.before, self.after, f"arm {self.arm} seed {self.seed}: before and after")
        return math.fsum(self.after[u] - self.before[u] for u in users) / len(users)

    def change(self) -> dict[str, Any] | None:
        """The paired change over users with its 95% t interval and the users happier (None without
        a `before`): how sure this one run is of its own gain."""
        if not self.before:
            return None
        _same_users(self.before, self.after, f"arm {self.arm} seed {self.seed}: before and after")
        change = paired_by_key(self.before, self.after)
        return {
            **change.change.as_dict(),
            "better": change.better,
            "worse": change.worse,
            "users": change.users,
        }

    def quarters(self) -> tuple[float, float] | None:
        """The training curve's first and last quarter means (None with fewer than 4 steps)."""
        rise = training_rise(self.curve)
        return None if rise is None else (rise.first, rise.last)

    def rise(self) -> dict[str, float] | None:
        """The last quarter's mean minus the first's with Welch's 95% interval over their steps
        (`rlver.evaluate.intervals.training_rise`); None with fewer than 8 steps (no spread)."""
        rise = training_rise(self.curve)
        return None if rise is None or rise.rise.count < 2 else rise.rise.as_dict()

    @property
    def tail(self) -> float | None:
        if not self.curve:
            return None
        last = [self.curve[step] for step in sorted(self.curve)[-TAIL_STEPS:]]
        return math.fsum(last) / len(last)


@dataclass(frozen=True)
class MeanError:
    """A mean over seeds and its standard error (NaN from one seed)."""

    mean: float
    error: float
    count: int

    def format(self, signed: bool = False) -> str:
        spec = "+.1f" if signed else ".1f"
        if not math.isfinite(self.error):
            return f"{self.mean:{spec}}"
        return f"{self.mean:{spec}} ± {self.error:.1f}"

    def as_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "error": self.error, "count": self.count}


def mean_error(values: Sequence[float]) -> MeanError:
    """The mean and its standard error (scipy's `sem`, n - 1 in the variance)."""
    from scipy import stats

    if not values:
        raise ValueError("mean_error needs at least one value")
    mean = math.fsum(values) / len(values)
    error = float(stats.sem(values)) if len(values) > 1 else math.nan
    return MeanError(mean, error, len(values))


def _same_users(first: Mapping[str, float], second: Mapping[str, float], what: str) -> list[str]:
    unpaired = sorted(set(first) ^ set(second))
    if unpaired:
        shown = ", ".join(unpaired[:5]) + (" ..." if len(unpaired) > 5 else "")
        raise ValueError(f"{what}: not the same users ({len(unpaired)} unpaired: {shown})")
    return sorted(first)


def paired_difference(reference: Sequence[RunScores], arm: Sequence[RunScores]) -> dict[str, Any]:
    """`arm` minus `reference` after training, paired per (seed, user); the interval as the module says.

    Only seeds both arms finished count; each such seed must have the same users in both.
    """
    by_seed = {run.seed: run for run in reference}
    pairs = [(by_seed[run.seed], run) for run in sorted(arm, key=lambda r: r.seed) if run.seed in by_seed]
    if not pairs:
        raise ValueError("no seed finished in both arms: nothing to pair")
    seed_means, user_differences = [], []
    for ref, run in pairs:
        users = _same_users(ref.after, run.after, f"arm {run.arm} against {ref.arm} at seed {run.seed}")
        differences = [run.after[u] - ref.after[u] for u in users]
        user_differences.append(differences)
        seed_means.append(math.fsum(differences) / len(differences))
    if len(pairs) > 1:
        interval, unit = mean_interval(seed_means), "seeds"
    else:  # one seed: only the users' noise is measurable
        interval, unit = mean_interval(user_differences[0]), "users"
    flat = [d for differences in user_differences for d in differences]
    return {
        "seeds": [run.seed for _, run in pairs],
        "per_seed": seed_means,
        "pairs": len(flat),
        "better": sum(d > 0 for d in flat),
        "worse": sum(d < 0 for d in flat),
        "unit": unit,
        **interval.as_dict(),
        "outside_noise": interval.excludes_zero,
    }


def curve_by_step(runs: Sequence[RunScores]) -> dict[int, MeanError]:
    """Per step that every run logged: the training reward's mean and standard error over seeds."""
    common = set.intersection(*(set(run.curve) for run in runs)) if runs else set()
    return {step: mean_error([run.curve[step] for run in runs]) for step in sorted(common)}


def _run_detail(run: RunScores) -> dict[str, Any]:
    quarters = run.quarters()
    return {
        "before": run.before_mean,
        "after": run.after_mean,
        "gain": run.gain,
        "change": run.change(),
        "training_quarters": None if quarters is None else {"first": quarters[0], "last": quarters[1]},
        "training_rise": run.rise(),
        "gaming": run.gaming,
    }


def summarize(runs: Sequence[RunScores], arms: Sequence[str]) -> dict[str, Any]:
    """The ablation's results as plain data (results.json): per arm, then paired to `arms[0]`.

    Arms without a finished run are listed with `runs: 0`; they get no numbers. Only the scores
    against each run's training simulator count here (`evaluation_matrix` has the others).
    """
    runs = [r for r in runs if r.evaluator == TRAINING_SIMULATOR]
    by_arm = {name: sorted((r for r in runs if r.arm == name), key=lambda r: r.seed) for name in arms}
    summary: dict[str, Any] = {"reference": arms[0] if arms else None, "arms": {}, "tail_steps": TAIL_STEPS}
    for name, arm_runs in by_arm.items():
        row: dict[str, Any] = {"runs": len(arm_runs), "seeds": [r.seed for r in arm_runs]}
        if arm_runs:
            befores = [r.before_mean for r in arm_runs if r.before_mean is not None]
            gains = [r.gain for r in arm_runs if r.gain is not None]
            tails = [r.tail for r in arm_runs if r.tail is not None]
            seconds = [r.seconds for r in arm_runs if r.seconds is not None]
            row.update(
                users=len(arm_runs[0].after),
                before=mean_error(befores).as_dict() if befores else None,
                after=mean_error([r.after_mean for r in arm_runs]).as_dict(),
                gain=mean_error(gains).as_dict() if gains else None,
                training_tail=mean_error(tails).as_dict() if tails else None,
                seconds=mean_error(seconds).as_dict() if seconds else None,
                curve={str(step): value.as_dict() for step, value in curve_by_step(arm_runs).items()},
                gain_interval=mean_interval(gains).as_dict() if len(gains) > 1 else None,
                per_seed={str(r.seed): _run_detail(r) for r in arm_runs},
            )
            reference = by_arm[arms[0]]
            if name != arms[0] and reference:
                try:
                    row["difference"] = paired_difference(reference, arm_runs)
                except ValueError as error:
                    row["difference"] = {"error": str(error)}
        summary["arms"][name] = row
    return summary


def evaluation_matrix(runs: Sequence[RunScores], arms: Sequence[str]) -> dict[str, Any]:
    """The train x evaluation matrix: for each evaluation (the training simulator, `train`, and
    every other simulator BeforeAfter scored with), each arm's greedy score after training, its
    gain over before paired per user with a t interval over seeds, and its paired difference to
    the reference arm (`summarize`'s rule: per seed, then t over the seeds).

    {"evaluators": [...], "cells": {arm: {evaluator: {after, gain, gain_interval, difference}}}}.
    """
    evaluators = [TRAINING_SIMULATOR, *sorted({r.evaluator for r in runs} - {TRAINING_SIMULATOR})]
    cells: dict[str, dict[str, Any]] = {arm: {} for arm in arms}
    for evaluator in evaluators:
        scored = [replace(r, evaluator=TRAINING_SIMULATOR) for r in runs if r.evaluator == evaluator]
        summary = summarize(scored, arms)
        for arm, row in summary["arms"].items():
            if row["runs"]:
                cells[arm][evaluator] = {
                    "runs": row["runs"],
                    "after": row["after"],
                    "gain": row["gain"],
                    "gain_interval": row["gain_interval"],
                    "difference": row.get("difference"),
                }
    return {"reference": arms[0] if arms else None, "evaluators": evaluators, "cells": cells}
