"""Transcript files: JSONL, one dialogue a line (see Trajectory.to_record)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rlver.core.emotion import band
from rlver.core.trajectory import Trajectory
from rlver.core.types import UserTurn


class TranscriptWriter:
    """Appends dialogues to a JSONL file as they finish, flushing each batch.

    Opening with `overwrite=True` starts the file afresh.
    """

    def __init__(self, path: str | Path, *, overwrite: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = self.path.open("w" if overwrite else "a", encoding="utf-8")
        self.count = 0

    def write(self, trajectories: Iterable[Trajectory], **fields: Any) -> None:
        for trajectory in trajectories:
            record = {**trajectory.to_record(), **fields}
            self._handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.count += 1
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> TranscriptWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_transcripts(path: str | Path) -> Iterator[dict[str, Any]]:
    for _, record in read_numbered_transcripts(path):
        yield record


def read_numbered_transcripts(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, decoded JSON) for every non-blank line; bad JSON raises naming file:line."""
    with Path(path).open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                where = f"{path}:{line_number}"
                raise ValueError(f"{where}: not UTF-8 text (byte {error.start + 1} of the line)") from None
            if line.strip():
                try:
                    yield line_number, json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{line_number}: invalid JSON: {error.msg}") from None


# --------------------------------------------------------------------------- SAGE records
SAGE_FIELDS = (
    "id",
    "emo_point",
    "emo_state",
    "target",
    "player",
    "scene",
    "character",
    "topic",
    "task",
    "history",
)
PLANNING_FIELDS = ("activity", "TargetCompletion", "content", "analyse", "change")  # as recorded


def to_sage_record(trajectory: Trajectory) -> dict[str, Any]:
    """The dialogue as a line of the recorded SAGE / Sentient transcripts (fields SAGE_FIELDS).

    User messages carry `emotion-point` and, after the opening, `planning` (with the
    signed `change`) and, when the simulator reported one, `thinking`. A simulator
    whose `UserTurn.reason` has no SAGE `planning` (the embedded rubric user) gets
    one built from its record: the record as JSON under `analyse`, and the change.
    Assistant messages carry the visible reply as `content` and the policy's
    reasoning as `think` when it had any.
    """
    profile = trajectory.profile
    history: list[dict[str, Any]] = []
    for index, user_turn in enumerate(trajectory.user_turns):
        message: dict[str, Any] = {"role": "user", "content": user_turn.text}
        if index > 0:
            thinking = user_turn.reason.get("thinking")
            if isinstance(thinking, str):
                message["thinking"] = thinking
        message["emotion-point"] = _plain_number(user_turn.emotion)
        if index > 0:
            message["planning"] = _sage_planning(user_turn)
        history.append(message)
        if index < len(trajectory.policy_turns):
            parsed = trajectory.policy_turns[index].parsed
            reply: dict[str, Any] = {"role": "assistant", "content": parsed.visible}
            if parsed.thinking is not None:
                reply["think"] = parsed.thinking
            history.append(reply)
    final = trajectory.final_emotion
    return {
        "id": profile.id,
        "emo_point": _plain_number(final),
        "emo_state": f"Emotion-{band(final)}",
        "target": "eq",
        "player": profile.player,
        "scene": profile.scene,
        "character": profile.main_cha,
        "topic": profile.extra.get("topic", ""),
        "task": profile.task,
        "history": history,
    }


def _sage_planning(user_turn: UserTurn) -> dict[str, Any]:
    planning = user_turn.reason.get("planning")
    if isinstance(planning, dict):
        change = planning.get("change")
        if isinstance(change, bool) or not isinstance(change, (int, float)):
            change = user_turn.change
        ordered = {name: planning[name] for name in PLANNING_FIELDS if name in planning}
        return {**ordered, **planning, "change": _plain_number(change)}
    summary = json.dumps(user_turn.reason, ensure_ascii=False)
    return {"analyse": summary, "change": _plain_number(user_turn.change)}


def _plain_number(value: float) -> int | float:
    """An int when the value is integral (as SAGE writes emotions), else the float."""
    return int(value) if float(value).is_integer() else value
