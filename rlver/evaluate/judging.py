"""Dialogue capabilities by dimension: a judge plugin's scores beside Score / Success / Failure.

`rlver score FILE... --judge SPEC` reads the dialogues of each transcript file (SAGE records or
rlver's own), has the judge (a plugin of kind `judges`) score each on its dimensions, and adds one
column per dimension to the leaderboard: the mean over the dialogues the judge scored (a missing
score is left out of the mean and counted in `judge missing`). With `--by`, per group as well.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlver.core.interfaces import DialogueJudge
from rlver.core.plugins import get_registry
from rlver.evaluate.score import ScoredFile, ScoreError

MISSING_COLUMN = "judge missing"


def read_judge_spec(text: str) -> str | dict[str, Any]:
    """`--judge`: a judge name, a YAML/JSON mapping with `name` and its options, or a file of one."""
    import yaml

    path = Path(text)
    if text.endswith((".yaml", ".yml", ".json")):
        if not path.is_file():
            raise ValueError(f"--judge: {path} not found")
        text = path.read_text()
    elif not text.lstrip().startswith("{"):
        return text
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"--judge: not a YAML/JSON mapping ({error})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"--judge: expected a name or a mapping with 'name', got {spec!r}")
    return spec


def build_judge(spec: str | dict[str, Any]) -> DialogueJudge:
    return get_registry().build("judges", spec, flag="--judge")


def dialogue_messages(record: dict[str, Any], *, where: str) -> list[dict[str, str]]:
    """The user and assistant messages of one transcript line (SAGE `history` or rlver `turns`)."""
    for field_name in ("history", "turns"):
        messages = record.get(field_name)
        if isinstance(messages, list):
            kept = [
                {"role": m["role"], "content": str(m.get("content", m.get("text", "")))}
                for m in messages
                if isinstance(m, dict) and m.get("role") in ("user", "assistant")
            ]
            if any(m["role"] == "assistant" for m in kept):
                return kept
    raise ScoreError(f"{where}: no assistant messages to judge (expected 'history' or 'turns')")


def judge_files(files: Sequence[ScoredFile], judge: DialogueJudge) -> list[list[dict[str, float | None]]]:
    """Per file, per dialogue: the judge's score of each dimension (None: not scored)."""
    dialogues = [
        [
            dialogue_messages(d.record, where=f"{scored.path} dialogue {i + 1}")
            for i, d in enumerate(scored.dialogues)
        ]
        for scored in files
    ]
    flat = judge.judge([messages for per_file in dialogues for messages in per_file])
    judged, start = [], 0
    for per_file in dialogues:
        judged.append(flat[start : start + len(per_file)])
        start += len(per_file)
    return judged


def dimension_means(scores: Sequence[dict[str, float | None]], dimensions: Sequence[str]) -> dict[str, Any]:
    """Each dimension's mean over the dialogues that have it (None when none does), and the misses."""
    means: dict[str, Any] = {}
    missing = 0
    for name in dimensions:
        values = [s[name] for s in scores if s.get(name) is not None]
        missing += len(scores) - len(values)
        means[name] = math.fsum(values) / len(values) if values else None
    means[MISSING_COLUMN] = missing
    return means


def add_dimensions(
    rows: list[dict[str, Any]],
    files: Sequence[ScoredFile],
    judged: Sequence[Sequence[dict[str, float | None]]],
    dimensions: Sequence[str],
    by: str | None = None,
) -> list[dict[str, Any]]:
    """Leaderboard rows (as `leaderboard_rows` made them, same `by`) with the dimension means added."""
    groups: dict[tuple[str, str | None], list[dict[str, float | None]]] = {}
    for scored, per_dialogue in zip(files, judged, strict=True):
        for dialogue, scores in zip(scored.dialogues, per_dialogue, strict=True):
            value = None
            if by is not None:
                raw = dialogue.record.get(by)
                value = "-" if raw is None else str(raw)
            groups.setdefault((scored.name, value), []).append(scores)
    return [
        {**row, **dimension_means(groups.get((row["name"], row.get(by) if by else None), []), dimensions)}
        for row in rows
    ]


def write_judgements(path: Path, files: Sequence[ScoredFile], judged: Sequence[Sequence[Any]]) -> Path:
    """Every dialogue's scores as JSONL (file, index, id, scores), for a reader to check or re-plot."""
    with path.open("w", encoding="utf-8") as handle:
        for scored, per_dialogue in zip(files, judged, strict=True):
            for index, (dialogue, scores) in enumerate(zip(scored.dialogues, per_dialogue, strict=True)):
                line = {
                    "file": scored.name,
                    "index": index,
                    "id": dialogue.record.get("id"),
                    "scores": scores,
                }
                handle.write(json.dumps(line, ensure_ascii=False) + "\n")
    return path
