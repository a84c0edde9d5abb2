"""Transcript files: JSONL, one dialogue a line (see Trajectory.to_record)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rlver.rollout import Trajectory


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
    with Path(path).open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{line_number}: invalid JSON: {error.msg}") from None
