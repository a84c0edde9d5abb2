"""Sentient-benchmark scores of transcript files (see PAPER.md, "The Sentient benchmark").

Reads both transcript formats: recorded SAGE lines (`emo_point`, `history` whose user
messages carry `emotion-point`) and rlver's own (Trajectory.to_record: `emotions`,
`final_emotion`, `turns`). A dialogue's emotions are taken from the per-message data when
it is there, the top-level final value only when it is not.

Score = mean final emotion; Success = dialogues ending at >= 100; Failure = below 10.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlver.evaluate.intervals import mean_interval
from rlver.rollout.transcripts import read_numbered_transcripts

SUCCESS_AT = 100.0
FAILURE_BELOW = 10.0


class ScoreError(ValueError):
    """A transcript line cannot be scored; the message names file:line and the field."""


@dataclass(frozen=True)
class ScoredDialogue:
    """The emotion after each user message (index 0: the opening line) and the record it came from."""

    emotions: tuple[float, ...]
    record: dict[str, Any] = field(repr=False, compare=False)

    @property
    def final(self) -> float:
        return self.emotions[-1]


@dataclass(frozen=True)
class ScoredFile:
    name: str
    path: Path
    dialogues: list[ScoredDialogue]

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, **score_emotions([d.emotions for d in self.dialogues])}


# --------------------------------------------------------------------------- reading one dialogue
def dialogue_emotions(record: Any, *, where: str) -> tuple[float, ...]:
    """The emotion after each user message of one transcript line, in either format."""
    if not isinstance(record, dict):
        raise ScoreError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "history" in record:  # SAGE
        history = record["history"]
        if not isinstance(history, list):
            raise ScoreError(f"{where}: field 'history': expected a list, got {type(history).__name__}")
        emotions = [
            _number(message.get("emotion-point"), where, f"history[{i}].emotion-point")
            for i, message in enumerate(history)
            if isinstance(message, dict) and message.get("role") == "user"
        ]
        return tuple(emotions) or (_final_field(record, where, "emo_point"),)
    if "emotions" in record:  # rlver
        emotions = record["emotions"]
        if not isinstance(emotions, list) or not emotions:
            raise ScoreError(f"{where}: field 'emotions': expected a non-empty list, got {emotions!r}")
        return tuple(_number(value, where, f"emotions[{i}]") for i, value in enumerate(emotions))
    if "turns" in record and isinstance(record["turns"], list):
        emotions = [
            _number(turn.get("emotion"), where, f"turns[{i}].emotion")
            for i, turn in enumerate(record["turns"])
            if isinstance(turn, dict) and turn.get("role") == "user"
        ]
        if emotions:
            return tuple(emotions)
    for name in ("emo_point", "final_emotion"):
        if name in record:
            return (_final_field(record, where, name),)
    raise ScoreError(
        f"{where}: no emotions: expected a SAGE record ('history' / 'emo_point') "
        "or an rlver transcript ('emotions' / 'final_emotion')"
    )


def _final_field(record: dict[str, Any], where: str, name: str) -> float:
    if name not in record:
        raise ScoreError(f"{where}: field '{name}': missing (and no per-message emotions)")
    return _number(record[name], where, name)


def _number(value: Any, where: str, name: str) -> float:
    # SAGE writes emotions as ints; some SAGE dumps write them as numeric strings.
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        with contextlib.suppress(ValueError):
            number = float(value)
    if number is not None:
        if not math.isfinite(number):  # NaN would silently poison every mean it enters
            raise ScoreError(f"{where}: field '{name}': expected a finite number, got {value!r}")
        return number
    if value is None:
        raise ScoreError(f"{where}: field '{name}': missing")
    raise ScoreError(f"{where}: field '{name}': expected a number, got {value!r}")


# --------------------------------------------------------------------------- scores
def score_emotions(trajectories: Sequence[Sequence[float]]) -> dict[str, Any]:
    """Dialogues, Score (mean final emotion), Success, Failure and mean user messages, each with its
    95% interval: Score's a Student t interval over the dialogues, Success's and Failure's Wilson
    intervals of their share of the dialogues (`*_low`, `*_high`, shares in [0, 1])."""
    count = len(trajectories)
    if count == 0:
        return {"dialogues": 0, "score": 0.0, "success": 0, "failure": 0, "mean_user_messages": 0.0}
    finals = [emotions[-1] for emotions in trajectories]
    success = sum(final >= SUCCESS_AT for final in finals)
    failure = sum(final < FAILURE_BELOW for final in finals)
    score = mean_interval(finals)
    return {
        "dialogues": count,
        "score": sum(finals) / count,
        "score_low": max(score.low, 0.0),  # the emotion's own range: a t interval of few dialogues
        "score_high": min(score.high, 100.0),  # can pass it
        "success": success,
        "failure": failure,
        **share_interval("success", success, count),
        **share_interval("failure", failure, count),
        "mean_user_messages": sum(len(emotions) for emotions in trajectories) / count,
    }


def share_interval(name: str, hits: int, count: int) -> dict[str, float]:
    """`<name>_low` and `<name>_high`: the 95% Wilson interval of hits / count (scipy)."""
    from scipy.stats import binomtest

    interval = binomtest(hits, count).proportion_ci(confidence_level=0.95, method="wilson")
    return {f"{name}_low": float(interval.low), f"{name}_high": float(interval.high)}


def with_intervals(scores: dict[str, Any]) -> dict[str, str]:
    """Score, Success and Failure as printed: `61.2 [58.0, 64.4]`, `12 (12% [7%, 20%])`."""
    if not scores.get("dialogues"):
        return {"score": "-", "success": "-", "failure": "-"}
    count = scores["dialogues"]
    cells = {"score": f"{scores['score']:.1f} [{scores['score_low']:.1f}, {scores['score_high']:.1f}]"}
    for name in ("success", "failure"):
        share = scores[name] / count
        cells[name] = (
            f"{scores[name]:d} ({share:.0%} [{scores[f'{name}_low']:.0%}, {scores[f'{name}_high']:.0%}])"
        )
    return cells


def score_records(records: Iterable[Any]) -> dict[str, Any]:
    """Score decoded transcript lines of either format (errors name the record's index)."""
    return score_emotions([dialogue_emotions(r, where=f"record {i}") for i, r in enumerate(records)])


def mean_trajectory(trajectories: Sequence[Sequence[float]]) -> list[float]:
    """Mean emotion by user-message index; a finished dialogue keeps its final emotion.

    Carrying the final value forward keeps every dialogue in every mean, so the
    curve ends at the Score instead of at the mean of the longest dialogues.
    """
    if not trajectories:
        return []
    length = max(len(emotions) for emotions in trajectories)
    return [
        sum(emotions[min(index, len(emotions) - 1)] for emotions in trajectories) / len(trajectories)
        for index in range(length)
    ]


# --------------------------------------------------------------------------- files
def load_scored_file(path: str | Path, *, name: str | None = None) -> ScoredFile:
    """Read and score one JSONL transcript file; the first bad line raises naming file:line."""

    path = Path(path)
    if not path.is_file():
        raise ScoreError(f"{path}: transcript file not found")
    try:
        dialogues = [
            ScoredDialogue(dialogue_emotions(record, where=f"{path}:{line}"), record)
            for line, record in read_numbered_transcripts(path)
        ]
    except ScoreError:
        raise
    except ValueError as error:  # a line that is not JSON, or not UTF-8 (the message names it)
        raise ScoreError(str(error)) from None
    if not dialogues:
        raise ScoreError(f"{path}: no dialogues in file")
    return ScoredFile(name or path.stem, path, dialogues)


def leaderboard_rows(files: Sequence[ScoredFile], *, by: str | None = None) -> list[dict[str, Any]]:
    """One row per file, best Score first; with `by`, one row per (file, value of that field)."""
    rows: list[dict[str, Any]] = []
    for scored in files:
        if by is None:
            rows.append(scored.summary())
            continue
        groups: dict[str, list[tuple[float, ...]]] = {}
        for dialogue in scored.dialogues:
            value = dialogue.record.get(by)
            groups.setdefault("-" if value is None else str(value), []).append(dialogue.emotions)
        for value, trajectories in groups.items():
            rows.append({"name": scored.name, by: value, **score_emotions(trajectories)})
    return sorted(rows, key=lambda row: -row["score"])


def leaderboard_markdown(
    rows: Sequence[dict[str, Any]], *, by: str | None = None, extra: Sequence[str] = ()
) -> str:
    """A Markdown table of leaderboard rows (in the order given); `extra` columns (e.g. a judge's
    dimensions) follow, numbers to one decimal, None as '-'."""
    header = ["model", *([by] if by else []), "N", "Score", "Success", "Failure", "mean user msgs", *extra]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for row in rows:
        cells = [
            _cell(row["name"]),
            *([_cell(row[by])] if by else []),
            f"{row['dialogues']:d}",
            *(with_intervals(row)[name] for name in ("score", "success", "failure")),
            f"{row['mean_user_messages']:.2f}",
            *(_extra_cell(row.get(name)) for name in extra),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _extra_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return _cell(value)


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def plot_trajectories(files: Sequence[ScoredFile], path: str | Path, *, per_dialogue: bool = True) -> Path:
    """Write a PNG: per file, the mean emotion by user message (thick) over its dialogues (thin)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(8, 5))
    try:
        for index, scored in enumerate(files):
            color = f"C{index % 10}"
            trajectories = [d.emotions for d in scored.dialogues]
            if per_dialogue:
                for emotions in trajectories:
                    axes.plot(range(1, len(emotions) + 1), emotions, color=color, alpha=0.08, linewidth=0.7)
            means = mean_trajectory(trajectories)
            score = score_emotions(trajectories)["score"]
            axes.plot(
                range(1, len(means) + 1),
                means,
                color=color,
                linewidth=2.2,
                marker="o",
                markersize=3,
                label=f"{scored.name} ({score:.1f})",
            )
        axes.axhline(SUCCESS_AT, color="grey", linestyle=":", linewidth=0.8)
        axes.axhline(FAILURE_BELOW, color="grey", linestyle=":", linewidth=0.8)
        axes.set_xlabel("user message")
        axes.set_ylabel("emotion")
        axes.set_ylim(-2, 102)
        axes.set_title("Emotion by user message (mean; finished dialogues keep their final emotion)")
        axes.legend(loc="best", fontsize="small")
        figure.tight_layout()
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)
    return path
