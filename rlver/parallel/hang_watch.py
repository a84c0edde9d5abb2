"""A job that stops making progress ends within a set time, not at the collective timeout.

A rank can hang without failing: its simulator endpoint stopped answering (the client retries
for an hour and a half before it gives up), or a collective never completes. The other ranks
then sit in their next collective for the process group's timeout, which rlver raises to cover
the simulator's retries (106 min with the paper's endpoints), holding every GPU of the job.

`HangWatchdog`, a callback every rlver Trainer gets, ends the job when no rank has made progress
for `timeout_minutes` while the run is in a phase that should progress (a training step, the time
between steps, a validation batch during training, a checkpoint write). Progress is a batch
starting or ending, the end of a step's rollouts, every rollout turn (training turns through
`rlver.checkpoint.stopping`; validation, test and the overlapped mode's turns ahead through
`turn_progress`) and a checkpoint write beginning, so a slow but answering simulator never trips
it. A checkpoint write gets `checkpoint_minutes` on top of the timeout, and the default timeout
covers the simulator's worst request time, retries included. Progress is counted job-wide, in a
counter in the process group's store: a rank waiting in a collective for a peer whose dialogues
still advance is not hung.

On expiry each rank, from its watchdog thread (its main thread may be blocked for good):
1. writes one line naming the phase and how long nothing progressed;
2. writes its share of `last.ckpt` where that needs no collective and the state is whole: only
   while its step is still in its rollouts (no update has begun: the weights and optimizer are
   those of the last finished step; a rank waiting in the stop agreement after its rollouts is
   still there), never during the update or a checkpoint already in progress. What a share is
   depends on the strategy (`checkpoint`, rlver.checkpoint.emergency, set by rlver's Trainer):
   under one device or DDP, rank 0 holds the whole state and writes it, the others nothing;
   under FSDP every rank writes its own shards and optimizer states (no gather), and rank 0,
   once every rank's share is in (reported through the store, within `checkpoint_seconds`),
   adds the loops' state and swaps the folder in as `last.ckpt`. A rank past its rollouts, or
   one that never reports, leaves no checkpoint, and rank 0 says which and why. The resumed run
   repeats the interrupted step;
3. posts the hang in the store, so ranks that are not hung themselves stop too
   (`rlver.parallel.rank_watch`); every other rank, its share written, waits for rank 0's post
   before it ends, because a peer that exits can break rank 0's collective (gloo notices the
   closed socket) and end it before the checkpoint is complete;
4. ends its process with exit status 1.
A job therefore ends within `timeout_minutes` plus the poll interval plus `checkpoint_seconds`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from lightning.pytorch.callbacks import Callback

from rlver.core.console import note
from rlver.parallel.rank_watch import FailureBoard, RankFailureWatch, default_store

PROGRESS_KEY = "rlver/progress"
ACKNOWLEDGED_KEY = "rlver/hang_acknowledged"
SHARE_KEY = "rlver/hang_share"  # "/<rank>": "written at step N", or why that rank wrote nothing

# A step's first phase: nothing has changed the weights yet, so a checkpoint there is the last
# finished step's.
ROLLOUTS = "rollouts"


class CheckpointWriter(Protocol):
    """How the ranks write `last.ckpt` without a collective (rlver.checkpoint.emergency)."""

    def every_rank_writes(self, trainer: Any) -> bool: ...  # else rank 0's share is the whole state
    def cannot_write(self, trainer: Any) -> str | None: ...  # why this strategy cannot, or None
    def write_share(self, trainer: Any, path: str) -> None: ...  # this rank's share
    def complete(self, trainer: Any, path: str) -> None: ...  # rank 0, once every share is written


class ProgressClock:
    """When the job last progressed, as seen by this rank: its own marks and, through the store, everyone's.

    `check(now)` is one poll; it returns how long nothing progressed once that reaches `timeout`.
    """

    def __init__(self, timeout_seconds: float, store: Any = None) -> None:
        self.timeout_seconds = timeout_seconds
        self.store = store
        self.marks = 0  # this rank's progress marks (written by the training threads)
        self.published = 0  # of those, the ones the store has heard of
        self.job_marks = -1  # the job's counter as last read
        self.last_progress: float | None = None  # None: disarmed
        self.extra_seconds = 0.0  # the current phase's allowance beyond the timeout (a checkpoint write)

    def mark(self) -> None:
        self.marks += 1  # one writer at a time in practice; a lost increment is only a missed mark

    def arm(self, now: float) -> None:
        if self.last_progress is None:
            self.last_progress = now

    def disarm(self) -> None:
        self.last_progress = None

    def check(self, now: float) -> float | None:
        if self.last_progress is None:
            return None
        marks = self.marks
        job_marks = marks
        if self.store is not None:
            with contextlib.suppress(Exception):  # an unreachable store is RankFailureWatch's to judge
                job_marks = self.store.add(PROGRESS_KEY, 1 if marks != self.published else 0)
                self.published = marks
        if job_marks != self.job_marks:
            self.job_marks = job_marks
            self.last_progress = now
            return None
        stalled = now - self.last_progress
        return stalled if stalled >= self.timeout_seconds + self.extra_seconds else None


class HangWatchdog(Callback):
    """Ends the job, with `last.ckpt` where possible, when no rank progresses for `timeout_minutes`.

    Set it in a recipe as `trainer.callbacks: [{class_path: rlver.parallel.hang_watch.HangWatchdog,
    init_args: {timeout_minutes: 30}}]` (or `--trainer.callbacks+=...` on the command line).

    Args:
        timeout_minutes: How long the job may go without progress in a training step, between
            steps or in a validation batch during training. None (the default): 10 minutes, or
            the module's longest healthy silence plus 2 minutes where that is longer; for an
            RLVERModule, the simulator's worst request time with every retry (a sage endpoint's
            defaults: 12 min), so that a dead endpoint stops the run the clean way first (the
            simulator gives up, `last.ckpt` is written, `rlver fit` says why). Raise it if one
            PPO update or one validation batch of your run takes longer. 0 turns the watchdog off.
        checkpoint_minutes: Allowed on top of the timeout while a checkpoint is written (a
            sharded 7B PPO checkpoint is ~176 GB, written twice at a step with `save_last`).
        checkpoint_seconds: How long the `last.ckpt` write on expiry may take before the
            process ends without it.
        poll_seconds: How often the watchdog looks (at most a tenth of the timeout).
    """

    DEFAULT_MINUTES = 10.0
    MARGIN_SECONDS = 120.0  # after the longest healthy silence: the turn's own work, two polls

    def __init__(
        self,
        timeout_minutes: float | None = None,
        checkpoint_minutes: float = 30.0,
        checkpoint_seconds: float = 300.0,
        poll_seconds: float = 10.0,
    ) -> None:
        if timeout_minutes is not None and timeout_minutes < 0:
            raise ValueError(f"HangWatchdog timeout_minutes ({timeout_minutes}) must be >= 0 (0: off)")
        if checkpoint_minutes < 0:
            raise ValueError(f"HangWatchdog checkpoint_minutes ({checkpoint_minutes}) must be >= 0")
        self.derived = timeout_minutes is None  # set from the module at setup
        minutes = self.DEFAULT_MINUTES if timeout_minutes is None else timeout_minutes
        self.timeout_seconds = minutes * 60.0
        self.checkpoint_allowance = checkpoint_minutes * 60.0
        self.checkpoint_seconds = checkpoint_seconds
        self.requested_poll = poll_seconds
        self.poll_seconds = max(0.05, min(poll_seconds, self.timeout_seconds / 10))
        self.phase = "starting"
        # Held by a phase change and by the emergency save from its phase check to the write's
        # end: a slow but live main thread cannot begin the update (or end the step) while
        # the watchdog dumps the state it is about to change.
        self.phase_lock = threading.RLock()  # re-entrant: a hook the dump calls may mark a phase
        self.clock = ProgressClock(self.timeout_seconds)
        self.trainer: Any = None
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.expire: Callable[[float], None] = self._end_job
        # What a rank's share of the checkpoint on expiry is (rlver's Trainer sets it: the
        # strategies' checkpoints live in a layer above this one). None: nothing is written.
        self.checkpoint: CheckpointWriter | None = None

    def fit_module(self, pl_module: Any) -> None:
        """A derived timeout covers the module's longest healthy silence (`expected_quiet_seconds`)."""
        if not self.derived:
            return
        quiet = getattr(pl_module, "expected_quiet_seconds", lambda: None)()
        seconds = self.DEFAULT_MINUTES * 60.0
        if quiet is not None:
            seconds = max(seconds, quiet + self.MARGIN_SECONDS)
        self.timeout_seconds = self.clock.timeout_seconds = seconds
        self.poll_seconds = max(0.05, min(self.requested_poll, seconds / 10))

    # ------------------------------------------------------------------ progress marks
    def progress(self, phase: str | None = None) -> None:
        """Mark progress (any thread); with `phase`, also say what this rank is doing now."""
        if phase is not None:
            with self.phase_lock:
                self.phase = phase
        self.clock.mark()

    def _enter(self, phase: str, allowance: float = 0.0) -> None:
        with self.phase_lock:
            self.progress(phase)
            self.clock.extra_seconds = allowance
        self.clock.arm(time.monotonic())

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        # Every rank dumps (and, sharded, writes): the write is a phase with its own allowance,
        # which ends when the next phase begins. Not the dump of this watchdog's own expiry.
        on_expiry = threading.current_thread() is self.thread
        if in_fit(trainer) and self.clock.last_progress is not None and not on_expiry:
            self._enter(f"writing a checkpoint at step {trainer.global_step}", self.checkpoint_allowance)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self._enter(f"training step {trainer.global_step + 1} ({ROLLOUTS})")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self._enter(f"after training step {trainer.global_step} (checkpoint, logging, next batch)")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.clock.disarm()  # the sanity check is over; an evaluation before training has no batches

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        # `rlver validate`, `rlver test` and the sanity check before training are not watched
        if in_fit(trainer) and not getattr(trainer, "sanity_checking", False):
            self._enter(f"validation at step {trainer.global_step}")

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.progress()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if in_fit(trainer) and not getattr(trainer, "sanity_checking", False):
            self.progress(f"after validation at step {trainer.global_step}")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.clock.disarm()  # an evaluation after training (BeforeAfter) has no batches to mark

    def rollouts_done(self) -> None:
        """The step's update begins: from here to the step's end a checkpoint would not be whole."""
        self.progress(self.phase.replace(f"({ROLLOUTS})", "(update)"))

    # ------------------------------------------------------------------ the thread
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.timeout_seconds == 0 or self.thread is not None:
            return
        self.fit_module(pl_module)
        self.trainer = trainer
        self.clock.store = default_store() if trainer.world_size > 1 else None
        self.stopped.clear()
        self.thread = threading.Thread(target=self._watch, name="rlver-hang-watch", daemon=True)
        self.thread.start()
        group_timeout = getattr(trainer.strategy, "_timeout", None)
        budget = self.timeout_seconds + self.checkpoint_seconds
        if trainer.world_size > 1 and group_timeout is not None and group_timeout.total_seconds() < budget:
            note(
                f"the collective timeout ({group_timeout.total_seconds() / 60:g} min) is shorter than "
                f"HangWatchdog's timeout_minutes + checkpoint_seconds: a hung collective aborts first, "
                "without last.ckpt"
            )

    def _watch(self) -> None:
        while not self.stopped.wait(self.poll_seconds):
            stalled = self.clock.check(time.monotonic())
            if stalled is not None and not self.stopped.is_set():
                self.expire(stalled)
                return

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        self.stopped.set()
        self.clock.disarm()
        self.thread = None

    # ------------------------------------------------------------------ expiry
    def describe(self, stalled: float) -> str:
        return (
            f"no progress for {stalled / 60:.1f} min in {self.phase} "
            f"(HangWatchdog timeout_minutes={self.timeout_seconds / 60:g})"
        )

    def _end_job(self, stalled: float) -> None:
        trainer = self.trainer
        rank = getattr(trainer, "global_rank", 0)
        say(f"rlver: rank {rank}: {self.describe(stalled)}; ending the job.")
        for callback in getattr(trainer, "callbacks", []):
            if isinstance(callback, RankFailureWatch):
                callback._stop_watching()  # this rank ends on its own, after the checkpoint
        # However the write goes, the process ends within checkpoint_seconds; rank 0 stops
        # waiting for the others' shares a little before, to say what became of the checkpoint.
        threading.Timer(self.checkpoint_seconds, os._exit, (1,)).start()
        deadline = time.monotonic() + 0.9 * self.checkpoint_seconds
        store = self.clock.store
        every_rank = self.checkpoint is not None and self.checkpoint.every_rank_writes(trainer)
        share = self.write_share(trainer) if rank == 0 or every_rank else None
        board = None if store is None else FailureBoard(store, rank)
        if board is not None and rank != 0:
            with contextlib.suppress(Exception):  # the store is gone: rank 0 is too
                if share is not None:
                    store.set(f"{SHARE_KEY}/{rank}", share)
                # A peer that exits first can break rank 0's collectives (gloo notices a closed
                # socket) and end it before the checkpoint is complete. Wait for its post.
                while board.read() is None:
                    time.sleep(self.poll_seconds)
                store.add(ACKNOWLEDGED_KEY, 1)
            os._exit(1)
        with contextlib.suppress(Exception):
            ranks = range(trainer.world_size if every_rank else 1)
            shares = {0: share or "", **self._collect_shares(ranks, deadline)}
            self._complete_checkpoint(trainer, shares, ranks)
        if board is not None:
            with contextlib.suppress(Exception):
                board.post(f"hung: {self.describe(stalled)}")
                # Rank 0 hosts the store: stay until the others have read the post (bounded).
                acknowledged_by = time.monotonic() + 3 * self.poll_seconds + 5
                others = trainer.world_size - 1
                while store.add(ACKNOWLEDGED_KEY, 0) < others and time.monotonic() < acknowledged_by:
                    time.sleep(0.05)
        os._exit(1)

    def write_share(self, trainer: Any) -> str:
        """Write this rank's share of `last.ckpt` without a collective; "written at step N", or why not.

        The phase stays in the step's rollouts until the write ends (`phase_lock`): the main
        thread's next phase change, the update's start, waits for it."""
        with self.phase_lock:
            reason = self._why_no_checkpoint(trainer)
            if reason is not None:
                return reason
            assert self.checkpoint is not None  # _why_no_checkpoint said so
            try:
                self.checkpoint.write_share(trainer, str(last_checkpoint_file(trainer)))
            except Exception as error:
                return f"its write failed ({type(error).__name__}: {error})"
            return f"written at step {trainer.global_step}"

    def _why_no_checkpoint(self, trainer: Any) -> str | None:
        if self.checkpoint is None:
            return "no checkpoint writer"
        if f"({ROLLOUTS})" not in self.phase:
            return f"it was in {self.phase}, past the rollouts: the state may be half updated"
        if trainer.global_step == 0:
            return "no step had finished"
        if last_checkpoint_file(trainer) is None:
            return "no ModelCheckpoint with save_last"
        return self.checkpoint.cannot_write(trainer)

    def _collect_shares(self, ranks: range, deadline: float) -> dict[int, str]:
        """What the other ranks reported of their shares by `deadline`."""
        store, shares = self.clock.store, {}
        waiting = set(ranks) - {0}
        while waiting and time.monotonic() < deadline:
            for rank in sorted(waiting):
                key = f"{SHARE_KEY}/{rank}"
                if store.check([key]):
                    shares[rank] = store.get(key).decode("utf-8", "replace")
                    waiting.discard(rank)
            time.sleep(0.05 if waiting else 0)
        return shares

    def _complete_checkpoint(self, trainer: Any, shares: dict[int, str], ranks: range) -> None:
        """Rank 0: make `last.ckpt` whole once every rank in `ranks` wrote its share at rank 0's step."""
        written = shares[0]
        missing: dict[int, str | None] = {0: written} if not written.startswith("written") else {}
        missing = missing or {rank: shares.get(rank) for rank in ranks if shares.get(rank) != written}
        if missing:
            reasons = "; ".join(f"rank {r}: {why or 'no answer in time'}" for r, why in missing.items())
            say(f"rlver: rank 0: no last.ckpt written ({reasons})")
            return
        path = last_checkpoint_file(trainer)
        assert self.checkpoint is not None and path is not None  # every share was written
        self.checkpoint.complete(trainer, path)
        say(f"rlver: rank 0: wrote {path} ({written}: the last finished step); resume with --ckpt_path last")


def last_checkpoint_file(trainer: Any) -> str | None:
    """Where the run's ModelCheckpoint keeps `last.ckpt` (None: none with save_last)."""
    checkpoint = getattr(trainer, "checkpoint_callback", None)
    if checkpoint is None or not getattr(checkpoint, "save_last", False) or not checkpoint.dirpath:
        return None
    return os.path.join(str(checkpoint.dirpath), checkpoint.CHECKPOINT_NAME_LAST + checkpoint.FILE_EXTENSION)


def in_fit(trainer: Any) -> bool:
    return getattr(getattr(trainer, "state", None), "fn", None) == "fit"  # TrainerFn is a str enum


def say(line: str) -> None:
    sys.stderr.write(f"\n{line}\n")
    sys.stderr.flush()


def hang_watchdog(trainer: Any) -> HangWatchdog | None:
    """The trainer's HangWatchdog, if it has one."""
    callbacks = getattr(trainer, "callbacks", None) or []
    return next((c for c in callbacks if isinstance(c, HangWatchdog)), None)


def turn_progress(trainer: Any) -> Callable[[int, int], None] | None:
    """An `on_turn` for `RolloutRunner.run` that marks every turn as progress (None: no watchdog).

    For rollouts that take no `should_stop` (validation, test, the overlapped mode's rollouts
    ahead, on their own thread): a long evaluation with a slow user is not a hang."""
    watchdog = hang_watchdog(trainer)
    if watchdog is None:
        return None
    return lambda turn, active: watchdog.progress()
