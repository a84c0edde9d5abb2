"""Dialogue capabilities by dimension: a judge plugin's scores beside Score / Success / Failure.

`rlver score FILE... --judge SPEC` reads the dialogues of each transcript file (SAGE records or
rlver's own), has the judge (a plugin of kind `judges`) score each on its dimensions, and adds one
column per dimension to the leaderboard: the mean over the dialogues the judge scored (a missing
score is left out of the mean and counted in `judge missing`). With `--by`, per group as well.
`rlver test` with `--model.judge SPEC` does the same to the records it has just written
(`judge_test_records`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlver.core.interfaces import DialogueJudge
from rlver.core.plugins import get_registry
from rlver.evaluate.score import ScoredDialogue, ScoredFile, ScoreError, dialogue_emotions

MISSING_COLUMN = "judge missing"


def read_judge_spec(text: str | dict[str, Any], flag: str = "--judge") -> str | dict[str, Any]:
    """A judge name, a YAML/JSON mapping with `name` and its options, or a file of one (a mapping
    from a recipe is taken as it is); errors name `flag`."""
    import yaml

    if isinstance(text, dict):
        return text
    path = Path(text)
    if text.endswith((".yaml", ".yml", ".json")):
        if not path.is_file():
            raise ValueError(f"{flag}: {path} not found")
        text = path.read_text()
    elif not text.lstrip().startswith("{"):
        return text
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"{flag}: not a YAML/JSON mapping ({error})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{flag}: expected a name or a mapping with 'name', got {spec!r}")
    return spec


def check_judge_spec(text: str | dict[str, Any], flag: str) -> None:
    """Refuse an unknown judge or option before any dialogue is run (nothing is built)."""
    get_registry().check("judges", read_judge_spec(text, flag), flag=flag)


def build_judge(spec: str | dict[str, Any], flag: str = "--judge") -> DialogueJudge:
    return get_registry().build("judges", spec, flag=flag)


def judged_path(transcripts: Path) -> Path:
    """Where a transcript file's judgements go: `<file stem>.judged.jsonl` beside it."""
    return transcripts.with_name(f"{transcripts.stem}.judged.jsonl")


def judge_and_write(
    files: Sequence[ScoredFile], spec: str | dict[str, Any], *, flag: str = "--judge", write: bool = True
) -> tuple[list[list[dict[str, float | None]]], tuple[str, ...]]:
    """Judge every dialogue of `files` with one judge (closed after) and, with `write`, each file's
    scores to `judged_path` beside it; the scores per file and the judge's dimensions."""
    judge = build_judge(read_judge_spec(spec, flag), flag=flag)
    try:
        judged = judge_files(files, judge)
    finally:
        judge.close()
    if write:
        for scored, per_file in zip(files, judged, strict=True):
            write_judgements(judged_path(scored.path), [scored], [per_file])
    return judged, tuple(judge.dimensions)


def judge_test_records(
    parts: Sequence[tuple[Path, Sequence[dict[str, Any]]]],
    spec: str | dict[str, Any],
    *,
    flag: str,
    write: bool,
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """`rlver test`'s judge: the SAGE records of each rank's file (path, records) judged as `rlver
    score --judge` judges those files, each file's judgements beside it with `write`; the means of
    the dimensions over all the dialogues (and `judge missing`), and the dimensions."""
    files = [
        ScoredFile(
            path.stem,
            path,
            [
                ScoredDialogue(dialogue_emotions(record, where=f"{path} dialogue {index + 1}"), record)
                for index, record in enumerate(records)
            ],
        )
        for path, records in parts
    ]
    judged, dimensions = judge_and_write(files, spec, flag=flag, write=write)
    return dimension_means([scores for per_file in judged for scores in per_file], dimensions), dimensions


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
