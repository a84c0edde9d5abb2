"""The training progress bar: optimizer steps with the reward, readable in a terminal and in a log file."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks.progress import ProgressBar
from tqdm import tqdm

# Progress-bar metric -> (short name, format).
_SHOWN = {
    "reward/total": ("reward", "{:.3f}"),
    "rollout/final_emotion": ("emotion", "{:.1f}"),
    "val/final_emotion": ("val emotion", "{:.1f}"),
}


class StepProgress(ProgressBar):
    """One bar over the run's optimizer steps, showing the reward and the final emotion.

    RL steps are few and slow, so the bar counts steps (not batches of an epoch) from the
    resumed step on. Where the output is not a terminal (a log file, CI) it prints one line
    per `log_every_n_steps` steps instead of redrawing. Validation and test loops get their
    own bar in a terminal and nothing in a log.
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._bar: tqdm | None = None
        self._loop_bar: tqdm | None = None
        self._step_started: float | None = None  # when the printed interval's first step began

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def _interactive(self) -> bool:
        return sys.stderr.isatty()

    def _shows(self, trainer: L.Trainer) -> bool:
        return self._enabled and trainer.is_global_zero

    def _fields(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, str]:
        metrics = self.get_metrics(trainer, pl_module)
        shown = {}
        for key, (name, fmt) in _SHOWN.items():
            value = metrics.get(key)
            if isinstance(value, int | float) and math.isfinite(value):
                shown[name] = fmt.format(value)
        return shown

    # ---------------------------------------------------------------- training
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step_started = None
        if not self._shows(trainer) or not self._interactive:
            return
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        self._bar = tqdm(
            total=total,
            initial=trainer.global_step,
            desc="training",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            leave=True,
        )

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # From the step's own start: callbacks' work before the first step (BeforeAfter's
        # evaluation, minutes) is not the step's.
        if self._step_started is None:
            self._step_started = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not self._shows(trainer):
            return
        fields = self._fields(trainer, pl_module)
        step = trainer.global_step
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(fields, refresh=False)
            self._bar.refresh()
            return
        every = max(1, trainer.log_every_n_steps)
        if step % every == 0 or step == trainer.max_steps:
            now = time.perf_counter()
            elapsed = now - (now if self._step_started is None else self._step_started)
            total = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
            values = "  ".join(f"{name} {value}" for name, value in fields.items())
            print(f"step {step}{total}  {values}  ({elapsed:.0f} s)", flush=True)
            self._step_started = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # ---------------------------------------------------------------- validation / test
    def _start_loop(self, trainer: L.Trainer, description: str, totals: Any) -> None:
        if not self._shows(trainer) or not self._interactive:
            return
        total = sum(int(t) for t in totals if math.isfinite(t)) if totals else None
        self._loop_bar = tqdm(
            total=total or None,
            desc=description,
            unit="batch",
            dynamic_ncols=True,
            leave=False,
            file=sys.stderr,
        )

    def _advance_loop(self) -> None:
        if self._loop_bar is not None:
            self._loop_bar.update(1)

    def _end_loop(self) -> None:
        if self._loop_bar is not None:
            self._loop_bar.close()
            self._loop_bar = None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._start_loop(trainer, "validation", trainer.num_val_batches)

    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._advance_loop()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._end_loop()

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start_loop(trainer, "test", trainer.num_test_batches)

    def on_test_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._advance_loop()

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._end_loop()
