"""Exactly-once run files across crashes: what a resumed run replays is written once.

A run killed at any moment (SIGKILL, OOM, preemption) resumes from its last checkpoint at
step G and replays steps G, G+1, ... exactly (same data order, seeds and weights). What the
dead process wrote about those steps must not stay beside the replay:

- transcripts (`<log dir>/rollouts/train_rank<R>.jsonl`): records of steps >= G, and a line
  torn by the kill, are dropped when training starts (the file is rewritten atomically);
- TensorBoard: a SessionLog START event at step G makes TensorBoard discard the older events
  of steps >= G (its documented purge of orphaned data after a restart);
- and nothing of a step before G may be missing: the scalars and transcripts of every step
  are flushed before the checkpoint that covers it is written.

A fresh run (G = 0) in a folder that already holds a run starts those files afresh, as its
checkpoints do.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L

from rlver.core.console import note

TRAIN_TRANSCRIPTS = "train"


def transcript_path(log_dir: str | Path, split: str, rank: int) -> Path:
    return Path(log_dir) / "rollouts" / f"{split}_rank{rank}.jsonl"


def truncate_transcripts(path: Path, before_step: int) -> tuple[int, int]:
    """Keep the complete records of steps < `before_step`; (records dropped, torn lines dropped)."""
    if not path.is_file():
        return 0, 0
    kept: list[str] = []
    dropped = torn = 0
    with path.open("rb") as handle:
        data = handle.read()
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            torn += 1  # a line the killed process did not finish
            continue
        if step < before_step:
            kept.append(raw.decode("utf-8"))
        else:
            dropped += 1
    if dropped or torn or (data and not data.endswith(b"\n")):
        text = "".join(line + "\n" for line in kept)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    return dropped, torn


def purge_tensorboard_from(logger: Any, step: int) -> bool:
    """Tell TensorBoard that the run restarted at `step` (older events at >= step are discarded)."""
    experiment = getattr(logger, "experiment", None)
    file_writer = getattr(experiment, "file_writer", None) if experiment is not None else None
    if file_writer is None:  # not a TensorBoard logger, or not rank 0
        return False
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    restart = SessionLog(status=SessionLog.START)
    file_writer.add_event(Event(step=step, wall_time=time.time(), session_log=restart))
    experiment.flush()
    return True


def flush_loggers(trainer: L.Trainer) -> None:
    for logger in trainer.loggers:
        experiment = getattr(logger, "_experiment", None)  # only one already opened
        flush = getattr(experiment, "flush", None)
        if callable(flush):
            flush()


class ExactlyOnce(L.Callback):
    """Drops what a crashed run wrote past its last checkpoint (added first by rlver's Trainer)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step
        log_dir = trainer.log_dir or trainer.default_root_dir
        if log_dir:
            path = transcript_path(log_dir, TRAIN_TRANSCRIPTS, trainer.global_rank)
            dropped, torn = truncate_transcripts(path, step)
            if (dropped or torn) and step > 0:
                torn_text = f" and {torn} torn line{'s' * (torn != 1)}" if torn else ""
                note(
                    f"rank {trainer.global_rank}: dropped {dropped} transcript record{'s' * (dropped != 1)} "
                    f"of steps >= {step}{torn_text} from {path} (they are replayed from the checkpoint)"
                )
        if trainer.global_rank == 0:
            for logger in trainer.loggers:
                log_dir = getattr(logger, "log_dir", None)
                earlier = len(list(Path(log_dir).glob("events.out.tfevents.*"))) > 1 if log_dir else True
                if step > 0 or earlier:  # a fresh run in a fresh folder has nothing to discard
                    purge_tensorboard_from(logger, step)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: Any) -> None:
        # Called while the checkpoint is assembled, before it is written: every scalar of the
        # steps it covers is on disk first, so a kill right after the write loses none.
        flush_loggers(trainer)
