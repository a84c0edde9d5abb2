"""An ablation's summary (`rlver.evaluate.ablation.summarize`) as Markdown tables and a curves plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rlver.evaluate.ablation import MeanError
from rlver.evaluate.intervals import Interval, TrainingRise
from rlver.rollout.gaming import GamingShares


def _cell(value: dict[str, float] | None, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return MeanError(value["mean"], value["error"], int(value["count"])).format(signed)


def _difference_cell(difference: dict[str, Any] | None) -> str:
    if difference is None:
        return "(reference)"
    if "error" in difference:
        return f"n/a ({difference['error']})"
    interval = f"{difference['mean']:+.1f} [{difference['low']:+.1f}, {difference['high']:+.1f}]"
    if difference["count"] < 2:
        interval = f"{difference['mean']:+.1f} (no interval: one value)"
    verdict = "**outside the noise**" if difference["outside_noise"] else "within the noise"
    over = f"t over {difference['count']} {difference['unit']}"
    return f"{interval}, {verdict} ({over}; {difference['better']}/{difference['pairs']} pairs better)"


def markdown(summary: dict[str, Any], title: str = "Ablation") -> str:
    """The per-arm table, the paired differences to the reference arm, and the curves by step."""
    arms = summary["arms"]
    reference = summary["reference"]
    lines = [
        f"# {title}",
        "",
        "Greedy held-out score: each run's mean final emotion of the held-out users before and after"
        " training (`BeforeAfter`); training: the mean final emotion of each step's training dialogues,"
        f" its last {summary['tail_steps']} steps. Mean ± standard error over seeds.",
        "",
        "| arm | seeds | users | greedy before | greedy after | gain | training, last steps | s/run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in arms.items():
        if not row["runs"]:
            lines.append(f"| {name} | 0 | | | | | | |")
            continue
        seconds = "n/a" if row["seconds"] is None else f"{row['seconds']['mean']:.0f}"
        lines.append(
            f"| {name} | {', '.join(map(str, row['seeds']))} | {row['users']} | {_cell(row['before'])} | "
            f"{_cell(row['after'])} | {_cell(row['gain'], signed=True)} | {_cell(row['training_tail'])} "
            f"| {seconds} |"
        )
    lines += [
        "",
        f"Paired difference to `{reference}` after training (same seed, same users; 95% interval: Student t"
        " over the seeds' mean differences, or over the users when only one seed is shared):",
        "",
        "| arm | difference [95% interval] |",
        "|---|---|",
    ]
    for name, row in arms.items():
        if row["runs"]:
            lines.append(f"| {name} | {_difference_cell(row.get('difference'))} |")
    lines += ["", *_matrix(summary.get("evaluation_matrix")), *_gain_over_seeds(arms), "", *_per_run(arms)]
    lines += ["", *_gaming(arms)]
    with_curves = [name for name, row in arms.items() if row.get("curve")]
    if with_curves:
        steps = sorted({int(step) for name in with_curves for step in arms[name]["curve"]})
        lines += [
            "",
            "Training reward by step (mean ± standard error over seeds):",
            "",
            "| step | " + " | ".join(with_curves) + " |",
            "|---" * (len(with_curves) + 1) + "|",
        ]
        for step in steps:
            cells = [_cell(arms[name]["curve"].get(str(step))) for name in with_curves]
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _matrix(matrix: dict[str, Any] | None) -> list[str]:
    """The train x evaluation matrix: each arm (what it trained against) scored by every evaluation
    simulator; empty when BeforeAfter had no other evaluators."""
    if not matrix:
        return []
    evaluators = matrix["evaluators"]
    header = " | ".join(f"on {name}" for name in evaluators)
    lines = [
        "Train x evaluation: each arm's greedy score after training on the held-out users of every"
        " evaluation simulator (`train`: the one it trained against; the others: users it never trained"
        " against). Gain: after minus before, paired per user, t interval over seeds; Δ: the paired"
        f" difference to `{matrix['reference']}` (same seed, same users). A gain `train` shows and"
        " the others do not is the training simulator's, not the users'.",
        "",
        f"| arm | {header} |",
        "|---" * (len(evaluators) + 1) + "|",
    ]
    for arm, row in matrix["cells"].items():
        cells = []
        for name in evaluators:
            cell = row.get(name)
            if cell is None:
                cells.append("n/a")
                continue
            text = f"{_cell(cell['after'])}; gain {_interval_cell(cell['gain'], cell['gain_interval'])}"
            difference = cell.get("difference")
            if difference is not None and "error" not in difference:
                text += f"; Δ {difference['mean']:+.1f} [{difference['low']:+.1f}, {difference['high']:+.1f}]"
            cells.append(text)
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _interval_cell(gain: dict[str, float] | None, interval: dict[str, Any] | None) -> str:
    if gain is None:
        return "n/a"
    if interval is None:
        return f"{gain['mean']:+.1f} (one seed)"
    return f"{interval['mean']:+.1f} [{interval['low']:+.1f}, {interval['high']:+.1f}]"


def _gain_over_seeds(arms: dict[str, Any]) -> list[str]:
    lines = [
        "Each arm's own gain (after minus before), its 95% interval: Student t over the seeds' gains:",
        "",
        "| arm | mean gain [95% interval over seeds] | lowest seed's gain |",
        "|---|---|---|",
    ]
    for name, row in arms.items():
        interval = row.get("gain_interval")
        gains = [run["gain"] for run in row.get("per_seed", {}).values() if run["gain"] is not None]
        if interval is None or not gains:
            continue
        verdict = "above 0" if interval["low"] > 0 else ("below 0" if interval["high"] < 0 else "includes 0")
        bounds = f"{interval['mean']:+.1f} [{interval['low']:+.1f}, {interval['high']:+.1f}]"
        lines.append(f"| {name} | {bounds} ({verdict}) | {min(gains):+.1f} |")
    return lines


def _rise_cell(quarters: dict[str, float], rise: dict[str, float] | None) -> str:
    """`31.5 -> 35.7 (+4.2 [+3.0, +5.4])`: the quarters, and the rise with its interval when known."""
    first, last = quarters["first"], quarters["last"]
    interval = Interval(**rise) if rise is not None else Interval(last - first, last - first, last - first, 1)
    return TrainingRise(first, last, interval).format()


def _per_run(arms: dict[str, Any]) -> list[str]:
    lines = [
        "Per run: the greedy change over the held-out users with its paired 95% t interval over users,"
        " and the training reward's first and last quarter (mean final emotion of the steps' dialogues;"
        " the rise with its 95% Welch interval over the quarters' steps):",
        "",
        "| arm | seed | greedy before -> after | change [95% interval over users] | users happier"
        " | training, first -> last quarter |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in arms.items():
        for seed, run in row.get("per_seed", {}).items():
            change, quarters = run.get("change"), run.get("training_quarters")
            before = "n/a" if run["before"] is None else f"{run['before']:.1f}"
            changed = (
                "n/a"
                if change is None
                else f"{change['mean']:+.1f} [{change['low']:+.1f}, {change['high']:+.1f}]"
            )
            happier = "n/a" if change is None else f"{change['better']}/{change['users']}"
            trained = "n/a" if quarters is None else _rise_cell(quarters, run.get("training_rise"))
            lines.append(
                f"| {name} | {seed} | {before} -> {run['after']:.1f} | {changed} | {happier} | {trained} |"
            )
    return lines


def plot_curves(summary: dict[str, Any], path: Path) -> None:
    """The training reward by step per arm: the mean over seeds with a ±1 standard error band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for name, row in summary["arms"].items():
        curve = row.get("curve") or {}
        if not curve:
            continue
        steps = sorted(int(step) for step in curve)
        means = [curve[str(step)]["mean"] for step in steps]
        errors = [curve[str(step)]["error"] for step in steps]
        (line,) = axes.plot(steps, means, label=f"{name} ({row['runs']} seeds)")
        if all(math.isfinite(error) for error in errors):
            low = [m - e for m, e in zip(means, errors, strict=True)]
            high = [m + e for m, e in zip(means, errors, strict=True)]
            axes.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
    axes.set_xlabel("training step")
    axes.set_ylabel("mean final emotion of the step's dialogues")
    axes.set_title("training reward by step (band: ±1 standard error over seeds)")
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _gaming(arms: dict[str, Any]) -> list[str]:
    """Per run, what the after-training replies show (rlver.rollout.gaming), and what passed its threshold."""
    lines = [
        "Gaming signs in each run's after-training replies (rlver/rollout/gaming.py: shares of replies"
        " that repeat an earlier one of their dialogue, copy the user, are cut by the length limit;"
        " distinct-2; the most common opening):",
        "",
        "| arm | seed | repeats | copies | cut | distinct-2 | top opening | watch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in arms.items():
        for seed, run in row.get("per_seed", {}).items():
            record = run.get("gaming")
            if not record:
                lines.append(f"| {name} | {seed} | n/a | n/a | n/a | n/a | n/a | |")
                continue
            shares = GamingShares.from_record(record)
            opening = f"{shares.top_opening_share:.0%}" + (
                f" ({shares.top_openings[0][0]!r})" if shares.top_openings else ""
            )
            watch = "; ".join(shares.warnings())
            lines.append(
                f"| {name} | {seed} | {shares.repeat_share:.0%} | {shares.copy_share:.0%} | "
                f"{shares.cut_share:.0%} | {shares.distinct_2:.2f} | {opening} | {watch} |"
            )
    return lines
