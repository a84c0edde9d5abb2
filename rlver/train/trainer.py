"""The Trainer `rlver fit/validate/test` build: Lightning's, with `precision: auto` and one run folder."""

from __future__ import annotations

import math
import os
import subprocess
import time
from datetime import timedelta
from typing import Any

import lightning as L
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.loggers import TensorBoardLogger

from rlver.checkpoint.emergency import CollectiveFreeCheckpoint
from rlver.checkpoint.io import recover_checkpoints
from rlver.checkpoint.resume import ExactlyOnce
from rlver.checkpoint.stopping import GracefulStop
from rlver.core.console import is_verbose, note
from rlver.modeling.precision import resolve_precision
from rlver.parallel.allocator import FreedMemoryBetweenSteps, keep_freed_memory
from rlver.parallel.hang_watch import HangWatchdog
from rlver.parallel.rank_watch import RankFailureWatch
from rlver.parallel.rendezvous import bound_rendezvous
from rlver.parallel.slurm_launch import refuse_launch_without_srun, refuse_nodes_without_launcher
from rlver.train.progress import StepProgress


class Trainer(L.Trainer):
    """Lightning's Trainer; every option is Lightning's.

    A run lives in one folder, `default_root_dir`: unless a logger is configured, TensorBoard
    events and transcripts go to `<default_root_dir>/tensorboard` (no version subfolders, so a
    resumed run keeps writing where it was), and a ModelCheckpoint without a `dirpath` writes to
    `<default_root_dir>/checkpoints`. `--trainer.default_root_dir DIR` moves all of it.
    The first SIGTERM or Ctrl-C stops the run within a step with `last.ckpt` (rlver.checkpoint.stopping);
    when one rank fails, the others end within seconds, not at the collective timeout
    (rlver.parallel.rank_watch); when no rank progresses for 10 min the job ends
    (rlver.parallel.hang_watch);
    after a crash, `--ckpt_path last` replays the lost steps and the run's transcripts and
    TensorBoard events hold every step once (rlver.checkpoint.resume).
    Unless a progress bar is configured, rlver's StepProgress shows steps and the reward, and the
    model summary table is left out (both: rlver.core.console's quiet defaults; --verbose shows it).

    Args:
        precision: As Lightning's, plus "auto": bf16-mixed on a CUDA device with bf16, 32-true
            elsewhere, every CPU included (bf16's learning depended on the CPU's bf16 kernels:
            rlver.modeling.precision). One line at start says what was chosen and why.
        rendezvous_seconds: How long each rank waits at start for every other rank of the job
            (all nodes' processes) before it ends, naming the ranks that never came; the process
            group's own timeout, raised to cover the simulator's retries, applies only after
            (rlver.parallel.rendezvous).
        limit_train_batches, limit_val_batches, limit_test_batches, limit_predict_batches,
        val_check_interval, overfit_batches: As Lightning's (an int counts batches, a float is
            a fraction), declared here with `int` first: Lightning's signature says
            `float | int`, and a recipe's `limit_test_batches: 1` parsed by that type becomes
            1.0, that is all batches instead of one.
    """

    def __init__(
        self,
        *args: Any,
        precision: str | int | None = "auto",
        rendezvous_seconds: float = 60.0,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        val_check_interval: int | float | None = None,
        overfit_batches: int | float = 0.0,
        **kwargs: Any,
    ) -> None:
        kwargs.update(
            limit_train_batches=limit_train_batches,
            limit_val_batches=limit_val_batches,
            limit_test_batches=limit_test_batches,
            limit_predict_batches=limit_predict_batches,
            val_check_interval=val_check_interval,
            overfit_batches=overfit_batches,
        )
        if not rendezvous_seconds > 0:
            raise ValueError(f"--trainer.rendezvous_seconds ({rendezvous_seconds}) must be > 0")
        refuse_launch_without_srun()  # before Lightning takes SLURM as the launcher and waits
        refuse_nodes_without_launcher(int(kwargs.get("num_nodes") or 1), kwargs.get("devices", "auto"))
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
        bound_rendezvous(self.strategy, rendezvous_seconds)  # a node that never starts: a minute, not 106
        if isinstance(self.accelerator, CPUAccelerator) and keep_freed_memory():
            # each step reuses the pages its tensors freed, and hands them back when it ends
            # (rlver.parallel.allocator: kept across steps, they grew the quickstart past 4 GiB)
            self.callbacks.append(FreedMemoryBetweenSteps())
        for callback in self.callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = os.path.join(root, "checkpoints")
        if not any(isinstance(callback, GracefulStop) for callback in self.callbacks):
            self.callbacks.insert(0, GracefulStop())  # the first SIGTERM / Ctrl-C: checkpoint, stop
        if not any(isinstance(callback, RankFailureWatch) for callback in self.callbacks):
            self.callbacks.insert(0, RankFailureWatch())  # one rank fails: the others stop in seconds
        if not any(isinstance(callback, HangWatchdog) for callback in self.callbacks):
            self.callbacks.insert(0, HangWatchdog())  # no rank progresses: end the job, not at the timeout
        for callback in self.callbacks:
            if isinstance(callback, HangWatchdog) and callback.checkpoint is None:
                callback.checkpoint = CollectiveFreeCheckpoint()  # its last.ckpt, under every strategy
        if not any(isinstance(callback, ExactlyOnce) for callback in self.callbacks):
            self.callbacks.insert(0, ExactlyOnce())  # first: a resumed run's files drop what it replays

    def fit(self, *args: Any, **kwargs: Any) -> None:
        model = kwargs.get("model", args[0] if args else None)
        needed = getattr(model, "collective_timeout_seconds", lambda: None)()
        if needed is not None:
            widen_collective_timeout(self.strategy, needed)
        # Before Lightning looks for `last.ckpt`: put back a checkpoint a kill left mid-swap.
        # Only the global rank 0 (the folder is shared by every node); under Lightning's own
        # launcher the ranks it starts find the folders settled.
        if launcher_global_rank() == 0:
            for callback in self.callbacks:
                if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                    for path in recover_checkpoints(callback.dirpath):
                        note(f"{path}: put back (a kill interrupted the checkpoint write that replaced it)")
        return super().fit(*args, **kwargs)

    def wait_for_launched_ranks(self, timeout_seconds: float = 300.0) -> dict[int, int]:
        """Wait for the ranks Lightning's own launcher started from this process (none elsewhere).

        Lightning's launcher does not: rank 0 would exit, and `rlver fit` return, while another
        rank still writes its transcripts or end-of-training files, and a rank that failed after
        rank 0 finished would go unreported. Returns the exit codes that are not 0, by local rank.
        """
        children = getattr(getattr(self.strategy, "launcher", None), "procs", None) or []
        return wait_for_processes(children, timeout_seconds)


# What launchers say a process is: torchrun (RANK), SLURM, MPI; Lightning's own launcher sets only
# LOCAL_RANK (and NODE_RANK on several nodes) in the processes it starts.
_GLOBAL_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK")
_LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_LOCALID")


def launcher_global_rank(env: dict[str, str] | None = None) -> int:
    """This process's rank before any process group exists: 0 only for the one process of the job.

    torchrun sets no NODE_RANK, SLURM neither, so LOCAL_RANK == 0 alone is true once per node.
    """
    env = dict(os.environ) if env is None else env
    for name in _GLOBAL_RANK_VARIABLES:
        if env.get(name, "").strip().isdigit():
            return int(env[name])
    # Lightning's launcher: not rank 0 if it is not the first process on the first node.
    return max((int(env[n]) for n in _LOCAL_RANK_VARIABLES if env.get(n, "").strip().isdigit()), default=0)


def widen_collective_timeout(strategy: Any, seconds: float) -> bool:
    """Raise the process group's timeout to `seconds` if it is shorter (before the group exists).

    A rank waiting on a slow simulator keeps the others waiting in the next collective; if that
    wait outlasts the group's timeout (torch's default: 30 min) the job aborts without
    `last.ckpt` instead of stopping cleanly when the simulator gives up.
    """
    current = getattr(strategy, "_timeout", None)
    if current is None or current.total_seconds() >= seconds:
        return False
    strategy._timeout = timedelta(seconds=math.ceil(seconds))
    note(
        f"collective timeout raised from {current.total_seconds() / 60:.0f} to {seconds / 60:.0f} min: "
        "the simulator's retries can keep one rank that long"
    )
    return True


def wait_for_processes(processes: list[subprocess.Popen], timeout_seconds: float) -> dict[int, int]:
    """Wait for every process; one still running at the deadline is killed. The exit codes that
    are not 0, keyed by position counted from 1 (for launched ranks: their local rank)."""
    deadline = time.monotonic() + timeout_seconds
    failed = {}
    for number, process in enumerate(processes, start=1):
        try:
            code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        if code != 0:
            failed[number] = code
    return failed
