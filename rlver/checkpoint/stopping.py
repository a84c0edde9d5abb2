"""Stopping a run on the first SIGTERM or Ctrl-C, with a checkpoint that resumes exactly.

The first signal only raises a flag. The trainer acts on it at points where the training
state is whole: during a rollout (the step is dropped: nothing has changed yet), before the
update in a single process, or at the end of a step; then it writes `last.ckpt` and stops.
Every rank decides together (one all-reduce a step), so a signal that reached one rank stops
them all. A second signal acts as usual (Ctrl-C raises KeyboardInterrupt at once, SIGTERM
terminates), for a run that must die now.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from rlver.core.console import note
from rlver.core.interfaces import SimulatorUnavailable, StopRequested
from rlver.parallel.hang_watch import hang_watchdog

__all__ = ["GracefulStop", "StopRequested", "graceful_stop"]


class GracefulStop(L.Callback):
    """Turns the first SIGTERM / SIGINT into a clean stop with `last.ckpt` (added by rlver's Trainer)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested: str | None = None  # the signal's name, once one arrived on this rank
        self.agreed = False  # every rank knows a stop was asked for
        self._previous: dict[int, Any] = {}

    # ------------------------------------------------------------------ signals
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.requested, self.agreed = None, False
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for number in self.SIGNALS:
            self._previous[number] = signal.getsignal(number)
            signal.signal(number, self._on_signal)

    def _on_signal(self, number: int, frame: Any) -> None:
        if self.requested is not None:  # the second signal: the usual meaning, at once
            self._restore()
            if number == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), number)
            return
        self.requested = signal.Signals(number).name

    def _restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()
        self._save_final_state(trainer)

    @staticmethod
    def _save_final_state(trainer: L.Trainer) -> None:
        """A run that ends between checkpoints (`max_time`, `max_steps` off the checkpoint
        interval) still leaves `last.ckpt` at its final step, where a `save_last` asks for one."""
        checkpoints = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c.save_last]
        if not checkpoints or trainer.global_step == 0:
            return
        saved_at = getattr(checkpoints[0], "_last_global_step_saved", None)
        if saved_at == trainer.global_step:
            return
        trainer.save_checkpoint(_last_checkpoint_path(trainer))
        for callback in checkpoints:  # it is theirs now: no second copy of the same state
            callback._last_global_step_saved = trainer.global_step
            callback._last_checkpoint_saved = callback.last_model_path

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._restore()

    # ------------------------------------------------------------------ deciding and stopping
    def agree(self, trainer: L.Trainer) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it at the same point)."""
        if not self.agreed:
            import torch

            flag = torch.tensor(1.0 if self.requested else 0.0, device=trainer.strategy.root_device)
            if trainer.world_size > 1:
                flag = trainer.strategy.reduce(flag, reduce_op="sum")
            self.agreed = bool(flag.item() > 0)
        return self.agreed

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not self.agree(trainer):
            return
        path = _last_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        trainer.should_stop = True
        note(
            f"stopped by {self.requested or 'another rank'} after step {trainer.global_step}; "
            f"resume with --ckpt_path {path}"
        )


def last_checkpoint_path(trainer: L.Trainer) -> str:
    """Where the run's ModelCheckpoint keeps `last.ckpt` (or `<default_root_dir>/checkpoints/`)."""
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            name = callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION
            return os.path.join(str(callback.dirpath), name)
    return os.path.join(trainer.default_root_dir, "checkpoints", "last.ckpt")


def _last_checkpoint_path(trainer: L.Trainer) -> str:
    """`last_checkpoint_path`, claimed as the ModelCheckpoint's own.

    ModelCheckpoint would otherwise take a last.ckpt it did not write for someone else's
    and save the next one as last-v1.ckpt.
    """
    path = last_checkpoint_path(trainer)
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            callback.last_model_path = path
            break
    return path


def graceful_stop(trainer: Any) -> GracefulStop | None:
    """The trainer's GracefulStop callback, if it has one."""
    if trainer is None:
        return None
    return next((c for c in trainer.callbacks if isinstance(c, GracefulStop)), None)


def run_unless_stopped(
    run: Callable[[Callable[[], bool] | None], list[Any]], trainer: Any, gather: Callable[[Any], list[Any]]
) -> tuple[list[Any] | None, SimulatorUnavailable | None]:
    """A step's rollouts, `run(should_stop)`, or None when every rank agrees to stop instead.

    A stop asked for during the rollouts (SIGTERM, Ctrl-C) or a simulator that became
    unavailable drops the step, which has changed nothing yet, on every rank together; the
    GracefulStop callback then checkpoints the state as of the last finished step. Returns the
    trajectories (None: stop) and the unavailability error that stopped the run, if one did:
    every rank learns it (`gather` collects a value from each), so each exits with the error.
    """
    stop = graceful_stop(trainer)
    watchdog = hang_watchdog(trainer)
    fatal: SimulatorUnavailable | None = None

    def should_stop() -> bool:  # asked before every turn: each turn is progress for the watchdog
        if watchdog is not None:
            watchdog.progress()
        return stop is not None and stop.requested is not None

    try:
        trajectories = run(None if stop is None and watchdog is None else should_stop)
    except StopRequested:
        trajectories = []
    except SimulatorUnavailable as error:
        # Stop every rank with last.ckpt at the last finished step; `rlver fit` then exits with
        # this message (an error on one rank stops all).
        if stop is None:
            raise
        fatal = error
        stop.requested = stop.requested or "the simulator becoming unavailable"
        trajectories = []
    # The agreement is the step's first collective after its rollouts: a rank waiting in it for a
    # peer still rolling out (or hung there) has changed nothing yet, so its phase stays the
    # rollouts, where the hang watchdog may still write its share of last.ckpt.
    stopping = stop is not None and stop.agree(trainer)
    if watchdog is not None:
        watchdog.rollouts_done()
    if not stopping:
        return trajectories, fatal
    reasons = [reason for reason in gather(str(fatal or "")) if reason]
    if reasons and fatal is None:
        fatal = SimulatorUnavailable(reasons[0])
    return None, fatal
