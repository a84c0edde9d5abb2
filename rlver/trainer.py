"""The Trainer `rlver fit/validate/test` build: Lightning's, with `precision: auto` and one run folder."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.loggers import TensorBoardLogger

from rlver.console import is_verbose, note
from rlver.distributed import recover_checkpoints
from rlver.precision import resolve_precision
from rlver.progress import StepProgress
from rlver.resume import ExactlyOnce
from rlver.stopping import GracefulStop


class Trainer(L.Trainer):
    """Lightning's Trainer; every option is Lightning's.

    A run lives in one folder, `default_root_dir`: unless a logger is configured, TensorBoard
    events and transcripts go to `<default_root_dir>/tensorboard` (no version subfolders, so a
    resumed run keeps writing where it was), and a ModelCheckpoint without a `dirpath` writes to
    `<default_root_dir>/checkpoints`. `--trainer.default_root_dir DIR` moves all of it.
    The first SIGTERM or Ctrl-C stops the run within a step with `last.ckpt` (rlver.stopping);
    after a crash, `--ckpt_path last` replays the lost steps and the run's transcripts and
    TensorBoard events hold every step once (rlver.resume).
    Unless a progress bar is configured, rlver's StepProgress shows steps and the reward, and the
    model summary table is left out (both: rlver.console's quiet defaults; --verbose shows it).

    Args:
        precision: As Lightning's, plus "auto": bf16-mixed where the device computes bfloat16
            natively (CUDA with bf16, CPUs with AVX512-BF16, AMX or ARM BF16), 32-true elsewhere.
            One line at start says what was chosen and why.
    """

    def __init__(self, *args: Any, precision: str | int | None = "auto", **kwargs: Any) -> None:
        precision, reason = resolve_precision(precision, kwargs.get("accelerator", "auto"))
        if reason:
            note(reason)
        # The table of parameters repeats what the policy's name says; shown when verbose.
        if kwargs.get("enable_model_summary") is None:
            kwargs["enable_model_summary"] = is_verbose()
        root = kwargs.get("default_root_dir") or os.getcwd()
        if kwargs.get("logger") in (None, True):
            kwargs["logger"] = TensorBoardLogger(save_dir=root, name="tensorboard", version="")
        callbacks = kwargs.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list | tuple) else [callbacks]
        if kwargs.get("enable_progress_bar", True) and not any(isinstance(c, ProgressBar) for c in callbacks):
            kwargs["callbacks"] = [StepProgress(), *callbacks]  # steps and reward, not an epoch's batches
        super().__init__(*args, precision=precision, **kwargs)
        for callback in self.callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = os.path.join(root, "checkpoints")
        if not any(isinstance(callback, GracefulStop) for callback in self.callbacks):
            self.callbacks.insert(0, GracefulStop())  # the first SIGTERM / Ctrl-C: checkpoint, stop
        if not any(isinstance(callback, ExactlyOnce) for callback in self.callbacks):
            self.callbacks.insert(0, ExactlyOnce())  # first: a resumed run's files drop what it replays

    def fit(self, *args: Any, **kwargs: Any) -> None:
        # Before Lightning looks for `last.ckpt`: put back a checkpoint a kill left mid-swap.
        # Only the launching process (rank 0); the ranks it starts find the folders settled.
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0:
            for callback in self.callbacks:
                if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                    for path in recover_checkpoints(callback.dirpath):
                        note(f"{path}: put back (a kill interrupted the checkpoint write that replaced it)")
        return super().fit(*args, **kwargs)
