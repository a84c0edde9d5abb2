"""`rlver eval`'s tables: one model's scores, and the change from BEFORE to AFTER with its 95% interval.

A change is paired item by item where both runs scored the same items (same task, same `--limit`):
each item's after-minus-before, as `paired_change` does for users, which is far narrower than two
unpaired means because an item's difficulty sets most of its score. Where the items differ, the
difference of the two means gets Welch's interval instead, and the table says which it is.
Scores are fractions in lm-eval's JSON and percentages in the tables.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlver.evaluate.intervals import difference_of_means, paired_change


def load_summary(path: str | Path, flag: str) -> dict[str, Any]:
    """A summary written by `rlver eval` (its JSON file, or the folder holding exactly one)."""
    path = Path(path)
    if path.is_dir():
        candidates = sorted(path.glob("*.json"))
        if len(candidates) != 1:
            raise ValueError(f"{flag}: {path} holds {len(candidates)} JSON files; name one")
        path = candidates[0]
    if not path.is_file():
        raise ValueError(f"{flag}: {path} not found (a JSON file written by `rlver eval`)")
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag}: {path} is not JSON ({error})") from None
    if not isinstance(summary, dict) or "tasks" not in summary:
        raise ValueError(f"{flag}: {path} is not an `rlver eval` result (no 'tasks')")
    return summary


def _percent(value: float) -> str:
    return f"{100 * value:.1f}"


def results_markdown(summary: dict[str, Any]) -> str:
    """One model's scores: task, metric (filter), value with lm-eval's stderr, items."""
    lines = [
        f"`{summary['label']}` (limit {summary.get('limit') or 'none'}, {summary.get('date', '')})",
        "",
        "| Task | Metric | Score % | ± stderr | Items |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for task, result in sorted(summary["tasks"].items()):
        for key, metric in sorted(result["metrics"].items()):
            stderr = metric.get("stderr")
            shown = "" if stderr is None else _percent(stderr)
            lines.append(
                f"| {task} | {key} | {_percent(metric['value'])} | {shown} | {result.get('count', '')} |"
            )
    for task, reason in sorted(summary.get("skipped", {}).items()):
        lines.append(f"| {task} | skipped: {reason} | | | |")
    return "\n".join(lines)


def compare_task_metric(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The change of one metric: paired over the items both runs scored alike, else unpaired."""
    if before and set(before) == set(after):
        keys = sorted(before)
        paired = paired_change([before[k] for k in keys], [after[k] for k in keys])
        return {
            "before": paired.before,
            "after": paired.after,
            "change": paired.change,
            "items": len(keys),
            "better": paired.better,
            "worse": paired.worse,
            "paired": True,
        }
    if not before or not after:
        raise ValueError("a change needs per-item scores on both sides")
    change = difference_of_means(list(before.values()), list(after.values()))
    return {
        "before": sum(before.values()) / len(before),
        "after": sum(after.values()) / len(after),
        "change": change,
        "items": f"{len(before)}/{len(after)}",
        "better": None,
        "worse": None,
        "paired": False,
    }


def compare_summaries(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task and metric that both summaries scored."""
    rows = []
    for task in sorted(set(before["tasks"]) & set(after["tasks"])):
        before_items = before["tasks"][task].get("items", {})
        after_items = after["tasks"][task].get("items", {})
        for key in sorted(set(before_items) & set(after_items)):
            rows.append(
                {"task": task, "metric": key, **compare_task_metric(before_items[key], after_items[key])}
            )
    return rows


def compare_markdown(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The before/after table: each task's change in percentage points with its 95% interval."""
    rows = compare_summaries(before, after)
    if not rows:
        raise ValueError("--compare: the two results share no task and metric with per-item scores")
    lines = [
        f"Before: `{before['label']}` ({before.get('date', '')}); after: `{after['label']}` "
        f"({after.get('date', '')}); limit {before.get('limit') or 'none'} / {after.get('limit') or 'none'}",
        "",
        "| Task | Metric | Before % | After % | Change (points) [95% CI] | Items | Better / worse |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        change = row["change"]
        interval = f"{100 * change.mean:+.1f}"
        if change.count >= 2 and change.low != change.high:
            interval += f" [{100 * change.low:+.1f}, {100 * change.high:+.1f}]"
        moved = f"{row['better']} / {row['worse']}" if row["paired"] else "unpaired"
        lines.append(
            f"| {row['task']} | {row['metric']} | {_percent(row['before'])} | {_percent(row['after'])} | "
            f"{interval} | {row['items']} | {moved} |"
        )
    return "\n".join(lines)


def write_tensorboard(summary: dict[str, Any], folder: str | Path, step: int) -> Path:
    """Each task's metrics as scalars `eval/<task>/<metric>,<filter>` in the run's TensorBoard folder."""
    from torch.utils.tensorboard import SummaryWriter

    folder = Path(folder)
    writer = SummaryWriter(log_dir=str(folder))
    try:
        for task, result in summary["tasks"].items():
            for key, metric in result["metrics"].items():
                writer.add_scalar(f"eval/{task}/{key}", metric["value"], global_step=step)
    finally:
        writer.close()
    return folder
