"""Dialogue capabilities by dimension: a judge plugin's scores beside Score / Success / Failure.

`rlver score FILE... --judge SPEC` reads the dialogues of each transcript file (SAGE records or
rlver's own), has the judge (a plugin of kind `judges`) score each on its dimensions, and adds one
column per dimension to the leaderboard: the mean over the dialogues the judge scored (a missing
score is left out of the mean and counted in `judge missing`). With `--by`, per group as well.
`rlver test` with `--model.judge SPEC` does the same to the records it has just written
(`judge_test_records`).

A pool of judges (`--judge` given several times, or a YAML/JSON list of specs, or a file holding
one) has each judge score every dialogue; each dimension is then the pool's mean, with the
judges' agreement (Krippendorff's alpha) beside it (judge_pool.py). One judge reads as before.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlver.core.interfaces import DialogueJudge
from rlver.core.plugins import get_registry
from rlver.evaluate.judge_pool import (
    AGREEMENT_KEY,
    JUDGES_KEY,
    Scores,
    agreement_text,
    dimension_agreement,
    judge_labels,
    pool_cell,
    pooled_scores,
)
from rlver.evaluate.score import ScoredDialogue, ScoredFile, ScoreError, dialogue_emotions

MISSING_COLUMN = "judge missing"
JudgeSpec = str | dict[str, Any]


@dataclass(frozen=True)
class Judgements:
    """Every judge's scores of every dialogue of some files: `verdicts[file][dialogue][judge]`."""

    judges: tuple[str, ...]  # each judge's label (judge_labels), in the pool's order
    dimensions: tuple[str, ...]  # every judge's, in order of first appearance
    verdicts: list[list[list[Scores]]]

    @property
    def is_pool(self) -> bool:
        return len(self.judges) > 1

    @property
    def pooled(self) -> list[list[dict[str, float | None]]]:
        """Per file, per dialogue: each dimension's score (one judge's own, or the pool's mean)."""
        if not self.is_pool:
            return [[dict(verdict[0]) for verdict in per_file] for per_file in self.verdicts]
        return [[pooled_scores(v, self.dimensions) for v in per_file] for per_file in self.verdicts]


def read_judge_spec(text: str | dict[str, Any] | list[Any], flag: str = "--judge") -> JudgeSpec | list[Any]:
    """A judge name, a YAML/JSON mapping with `name` and its options, a list of those (a pool), or
    a file holding one (a mapping or list from a recipe is taken as it is); errors name `flag`."""
    import yaml

    if isinstance(text, dict | list):
        return text
    path = Path(text)
    if text.endswith((".yaml", ".yml", ".json")):
        if not path.is_file():
            raise ValueError(f"{flag}: {path} not found")
        text = path.read_text()
    elif not text.lstrip().startswith(("{", "[")):
        return text
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"{flag}: not a YAML/JSON mapping or list ({error})") from None
    if not isinstance(spec, dict | list):
        raise ValueError(f"{flag}: expected a name, a mapping with 'name' or a list of them, got {spec!r}")
    return spec


def read_judge_specs(
    text: str | dict[str, Any] | Sequence[str | dict[str, Any]], flag: str = "--judge"
) -> list[tuple[JudgeSpec, str]]:
    """Every judge of a spec, a list of specs (`--judge` given several times) or a file of either,
    each with the flag its errors name: `flag` for one judge, `flag[i]` for the i-th of a pool."""
    read = read_judge_spec(text, flag) if isinstance(text, str | dict) else list(text)
    members = read if isinstance(read, list) else [read]
    specs: list[JudgeSpec] = []
    for member in members:
        spec = read_judge_spec(member, flag) if isinstance(member, str | dict) else member
        for one in spec if isinstance(spec, list) else [spec]:
            if not isinstance(one, str | dict):
                raise ValueError(f"{flag}: a judge is a name or a mapping with 'name', got {one!r}")
            specs.append(one)
    if not specs:
        raise ValueError(f"{flag}: an empty list of judges")
    if len(specs) == 1:
        return [(specs[0], flag)]
    return [(spec, f"{flag}[{index}]") for index, spec in enumerate(specs)]


def check_judge_spec(text: str | dict[str, Any] | Sequence[Any], flag: str) -> None:
    """Refuse an unknown judge or option before any dialogue is run (nothing is built)."""
    for spec, member_flag in read_judge_specs(text, flag):
        get_registry().check("judges", spec, flag=member_flag)


def build_judge(spec: JudgeSpec, flag: str = "--judge") -> DialogueJudge:
    return get_registry().build("judges", spec, flag=flag)


def judged_path(transcripts: Path) -> Path:
    """Where a transcript file's judgements go: `<file stem>.judged.jsonl` beside it."""
    return transcripts.with_name(f"{transcripts.stem}.judged.jsonl")


def judge_and_write(
    files: Sequence[ScoredFile],
    spec: str | dict[str, Any] | Sequence[Any],
    *,
    flag: str = "--judge",
    write: bool = True,
) -> Judgements:
    """Judge every dialogue of `files` with each judge of `spec` (one, or a pool; closed after)
    and, with `write`, each file's judgements to `judged_path` beside it."""
    specs = read_judge_specs(spec, flag)
    # Every judge is built before any is asked: a missing key variable fails before the spend.
    judges: list[DialogueJudge] = []
    try:
        for one, member_flag in specs:
            try:
                judges.append(build_judge(one, flag=member_flag))
            except ValueError as error:  # the judge's own check (a key variable unset, ...)
                raise ValueError(f"{member_flag}: {error}") from None
        per_judge = [judge_files(files, judge) for judge in judges]
    finally:
        for judge in judges:
            judge.close()
    dimensions = tuple(dict.fromkeys(name for judge in judges for name in judge.dimensions))
    verdicts = [
        [list(scores) for scores in zip(*(judged[f] for judged in per_judge), strict=True)]
        for f in range(len(files))
    ]
    judgements = Judgements(tuple(judge_labels([one for one, _ in specs])), dimensions, verdicts)
    if write:
        for index, scored in enumerate(files):
            by_judge = None
            if judgements.is_pool:
                by_judge = [
                    [dict(zip(judgements.judges, v, strict=True)) for v in judgements.verdicts[index]]
                ]
            write_judgements(judged_path(scored.path), [scored], [judgements.pooled[index]], by_judge)
    return judgements


def judge_test_records(
    parts: Sequence[tuple[Path, Sequence[dict[str, Any]]]],
    spec: str | dict[str, Any] | Sequence[Any],
    *,
    flag: str,
    write: bool,
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """`rlver test`'s judge: the SAGE records of each rank's file (path, records) judged as `rlver
    score --judge` judges those files, each file's judgements beside it with `write`; the means of
    the dimensions over all the dialogues (and `judge missing`; for a pool also the judges'
    agreement, see `dimension_summary`), and the dimensions. `dimension_lines` prints them."""
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
    judgements = judge_and_write(files, spec, flag=flag, write=write)
    verdicts = [verdict for per_file in judgements.verdicts for verdict in per_file]
    return dimension_summary(verdicts, judgements), judgements.dimensions


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


def dimension_summary(verdicts: Sequence[Sequence[Scores]], judgements: Judgements) -> dict[str, Any]:
    """`dimension_means` of the dialogues' (pooled) scores; for a pool also each dimension's
    agreement over these dialogues (`AGREEMENT_KEY`) and the judges (`JUDGES_KEY`)."""
    dimensions = judgements.dimensions
    summary = dimension_means([pooled_scores(v, dimensions) for v in verdicts], dimensions)
    if judgements.is_pool:
        summary[AGREEMENT_KEY] = dimension_agreement(verdicts, dimensions)
        summary[JUDGES_KEY] = list(judgements.judges)
    return summary


def dimension_lines(summary: dict[str, Any], dimensions: Sequence[str]) -> str:
    """The dimensions as `rlver test` prints them below Failure: one line each (its mean; for a
    pool the judges' agreement beside it), then `judge missing` (and a pool's judges)."""
    agreement = summary.get(AGREEMENT_KEY)
    lines = []
    for name in dimensions:
        mean = summary[name]
        text = "-" if mean is None else f"{mean:.1f}"
        if agreement is not None:
            text += f"  ({agreement_text(agreement.get(name))})"
        lines.append(f"{name:<8} {text}\n")
    lines.append(f"{MISSING_COLUMN}  {summary[MISSING_COLUMN]}\n")
    if JUDGES_KEY in summary:
        lines.append(f"judges   {', '.join(summary[JUDGES_KEY])} (agreement: Krippendorff's alpha)\n")
    return "".join(lines)


def add_dimensions(
    rows: list[dict[str, Any]], files: Sequence[ScoredFile], judgements: Judgements, by: str | None = None
) -> list[dict[str, Any]]:
    """Leaderboard rows (as `leaderboard_rows` made them, same `by`) with the dimension means added;
    for a pool each cell also carries the judges' agreement over that row's dialogues."""
    groups: dict[tuple[str, str | None], list[Sequence[Scores]]] = {}
    for scored, per_dialogue in zip(files, judgements.verdicts, strict=True):
        for dialogue, verdict in zip(scored.dialogues, per_dialogue, strict=True):
            value = None
            if by is not None:
                raw = dialogue.record.get(by)
                value = "-" if raw is None else str(raw)
            groups.setdefault((scored.name, value), []).append(verdict)
    added = []
    for row in rows:
        summary = dimension_summary(groups.get((row["name"], row.get(by) if by else None), []), judgements)
        agreement = summary.pop(AGREEMENT_KEY, None)
        summary.pop(JUDGES_KEY, None)
        if agreement is not None:
            for name in judgements.dimensions:
                summary[name] = pool_cell(summary[name], agreement[name])
        added.append({**row, **summary})
    return added


def write_judgements(
    path: Path,
    files: Sequence[ScoredFile],
    judged: Sequence[Sequence[Any]],
    by_judge: Sequence[Sequence[dict[str, Scores]]] | None = None,
) -> Path:
    """Every dialogue's scores as JSONL (file, index, id, scores), for a reader to check or re-plot;
    with `by_judge` (a pool: per file, per dialogue, each judge's scores by its label) those are
    written too, under `judges`, and `scores` are the pool's means."""
    with path.open("w", encoding="utf-8") as handle:
        for number, (scored, per_dialogue) in enumerate(zip(files, judged, strict=True)):
            for index, (dialogue, scores) in enumerate(zip(scored.dialogues, per_dialogue, strict=True)):
                line = {
                    "file": scored.name,
                    "index": index,
                    "id": dialogue.record.get("id"),
                    "scores": scores,
                }
                if by_judge is not None:
                    line["judges"] = by_judge[number][index]
                handle.write(json.dumps(line, ensure_ascii=False) + "\n")
    return path
