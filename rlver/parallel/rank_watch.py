"""When one rank fails, the others stop within seconds instead of waiting out the collective timeout.

A rank that raises (a checkpoint write on a full disk, a bug in a reward plugin) leaves the other
ranks blocked in their next collective. NCCL does not notice a dead peer, so they wait for the
process group's timeout, which rlver raises to cover the simulator's retries (an hour or more
with the paper's endpoints), holding every GPU of the job. torchrun stops the other workers
itself; Lightning's own launcher and `srun` without `--kill-on-bad-exit` do not.

`RankFailureWatch`, a callback every rlver Trainer gets, posts a failing rank's error in the
process group's key-value store; on every rank a thread reads the store every few seconds and,
when another rank has posted, ends its process (exit status 1) with one line naming that rank
and its error. A store that stops answering for `grace_seconds` (its host, rank 0, is gone) ends
the process the same way. Checkpoints already written stay as they are: nothing done is lost.
It never issues a collective and never stops a rank before another one has failed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks import Callback

FAILED_KEY = "rlver/failed_rank"


class FailureBoard:
    """The first failure of a job, kept in a `torch.distributed.Store` every rank can read."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store = store
        self.rank = rank

    def post(self, error: str) -> None:
        # compare_set with an empty expected value writes only if nobody has: the first failure wins.
        self.store.compare_set(FAILED_KEY, "", f"{self.rank}\t{error}")

    def read(self) -> tuple[int, str] | None:
        """(rank, error) of the first failure posted, None while there is none."""
        if not self.store.check([FAILED_KEY]):
            return None
        rank, _, error = self.store.get(FAILED_KEY).decode("utf-8", "replace").partition("\t")
        return int(rank), error


class FailureWatcher(threading.Thread):
    """Calls `on_failure(rank, error)` once another rank has posted, or the board is unreachable."""

    def __init__(
        self,
        board: FailureBoard,
        on_failure: Callable[[int | None, str], None],
        interval_seconds: float = 5.0,
        grace_seconds: float = 60.0,
    ) -> None:
        super().__init__(name="rlver-rank-watch", daemon=True)
        self.board = board
        self.on_failure = on_failure
        self.interval_seconds = interval_seconds
        self.grace_seconds = grace_seconds
        self.stopped = threading.Event()

    def run(self) -> None:
        unreachable_since: float | None = None
        while not self.stopped.wait(self.interval_seconds):
            try:
                posted: tuple[int | None, str] | None = self.board.read()
                unreachable_since = None
            except Exception as error:  # any store error means the same: it is gone
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since < self.grace_seconds:
                    continue  # a moment's trouble, or every rank is shutting down normally
                posted = (None, f"the process group's store stopped answering ({error}): rank 0 is gone")
            if posted is not None and posted[0] != self.board.rank and not self.stopped.is_set():
                self.on_failure(*posted)
                return

    def stop(self) -> None:
        self.stopped.set()


def end_this_process(rank: int, loggers: list[Any]) -> Callable[[int | None, str], None]:
    """What a watching rank does when another has failed: flush its logs, say why, exit with 1."""

    def end(failed_rank: int | None, error: str) -> None:
        for logger in loggers:
            experiment = getattr(logger, "_experiment", None)  # only one that already exists
            if experiment is not None and hasattr(experiment, "flush"):
                with contextlib.suppress(Exception):  # exiting anyway; the message below matters more
                    experiment.flush()
        who = "another rank" if failed_rank is None else f"rank {failed_rank}"
        sys.stderr.write(
            f"\nrlver: {who} failed ({error}); rank {rank} stops too rather than wait out the "
            "collective timeout. Checkpoints already written are kept.\n"
        )
        sys.stderr.flush()
        os._exit(1)  # the main thread is blocked in a collective that will never complete

    return end


def default_store() -> Any:
    """The store of the default process group (None when there is no group or no store)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


class RankFailureWatch(Callback):
    """Posts this rank's error for the others, and ends this rank when another has posted one.

    Args:
        interval_seconds: How often each rank reads the store.
        grace_seconds: How long an unreachable store is tolerated before this rank ends.
    """

    def __init__(self, interval_seconds: float = 5.0, grace_seconds: float = 60.0) -> None:
        self.interval_seconds = interval_seconds
        self.grace_seconds = grace_seconds
        self.board: FailureBoard | None = None
        self.watcher: FailureWatcher | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.world_size < 2 or self.watcher is not None:
            return
        store = default_store()
        if store is None:
            return
        self.board = FailureBoard(store, trainer.global_rank)
        self.watcher = FailureWatcher(
            self.board,
            end_this_process(trainer.global_rank, list(trainer.loggers)),
            self.interval_seconds,
            self.grace_seconds,
        )
        self.watcher.start()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop_watching()
        if self.board is None:
            return
        with contextlib.suppress(Exception):  # the store's host may be this failing job's first casualty
            self.board.post(f"{type(exception).__name__}: {exception}"[:400])

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._stop_watching()

    def _stop_watching(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
