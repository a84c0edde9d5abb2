"""`last.ckpt` without a collective: each rank's share when the hang watchdog ends the job.

The watchdog (rlver.parallel.hang_watch) decides whether a checkpoint may be written (the step
still in its rollouts on every rank: the state is the last finished step's) and runs the
protocol: every rank writes its share, rank 0 completes the checkpoint once all have. This
module says what a share is, by strategy:

* one device, DDP: every rank holds the whole state; rank 0 writes `last.ckpt` as a checkpoint
  step would (Lightning's dump through rlver's atomic checkpoint IO), the others nothing;
* FSDP (`FSDPStrategy`, FSDP1): each rank writes its own shards and optimizer states
  (rlver.checkpoint.local_shards) into a folder beside `last.ckpt`; rank 0 then adds meta.pt
  and swaps the folder in whole, so `last.ckpt` is never a mix of two steps;
* anything else (DeepSpeed, FSDP2 under ModelParallelStrategy): nothing, and a reason says why.

Lightning's dump would gather a sharded model and its optimizer states (both collectives), so
under FSDP it runs with those two left out (`_dump_without_weights`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlver.checkpoint.io import atomic_torch_save, swap_in
from rlver.checkpoint.local_shards import META_FILENAME, PART_PREFIX, local_state, part_filename


def staging_folder(path: str | Path) -> Path:
    """Where the ranks' shares of the checkpoint at `path` gather before it is swapped in.

    Its own name (not the checkpoint steps' `.<name>.partial`): an interrupted sharded write may
    have left that one; `recover_checkpoints` clears both at the next start."""
    path = Path(path)
    return path.with_name(f".{path.name}.local.partial")


class CollectiveFreeCheckpoint:
    """Writes `last.ckpt` without a collective (see the module's docstring); rlver's Trainer gives
    one to its HangWatchdog."""

    def __init__(self) -> None:
        self.meta: dict[str, Any] | None = None  # rank 0 under FSDP: the loops as of its share

    @staticmethod
    def _sharded(trainer: Any) -> bool:
        from lightning.pytorch.strategies import FSDPStrategy

        return isinstance(trainer.strategy, FSDPStrategy)

    def every_rank_writes(self, trainer: Any) -> bool:
        """Whether rank 0 must wait for every rank's share before the checkpoint is whole."""
        return self._sharded(trainer) and trainer.world_size > 1

    def cannot_write(self, trainer: Any) -> str | None:
        """Why this strategy's state cannot be written without a collective, or None."""
        from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

        strategy = trainer.strategy
        if self._sharded(trainer) or isinstance(strategy, SingleDeviceStrategy):
            return None
        if isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy):
            return None
        return f"{type(strategy).__name__} saves only through collectives"

    def write_share(self, trainer: Any, path: str) -> None:
        """This rank's share of the checkpoint at `path` (rank 0 of a whole-state strategy: all of it)."""
        rank = trainer.global_rank
        if self._sharded(trainer):
            staging = staging_folder(path)
            strategy = trainer.strategy
            part = local_state(trainer.lightning_module, strategy.optimizers, rank, trainer.world_size)
            atomic_torch_save(part, staging / part_filename(rank))
            if rank == 0:
                self.meta = _dump_without_weights(trainer)
        elif rank == 0:
            # Not trainer.save_checkpoint: it ends in a barrier no hung peer would join.
            state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            trainer.strategy.checkpoint_io.save_checkpoint(state, path)

    def complete(self, trainer: Any, path: str) -> None:
        """Rank 0, once every rank's share is written: make `path` the checkpoint."""
        if not self._sharded(trainer):
            return  # the share was the whole checkpoint
        assert self.meta is not None, "complete() before rank 0's write_share()"
        staging = staging_folder(path)
        for stale in staging.glob(f"{PART_PREFIX}*.pt"):  # an earlier job's, on more ranks
            if int(stale.stem[len(PART_PREFIX) :]) >= trainer.world_size:
                stale.unlink(missing_ok=True)
        atomic_torch_save(self.meta, staging / META_FILENAME)  # last: with it the folder is a checkpoint
        swap_in(staging, Path(path))


def _dump_without_weights(trainer: Any) -> dict[str, Any]:
    """Lightning's checkpoint dict (loops, schedulers, callbacks, hyper parameters, the module's
    `on_save_checkpoint` additions) without the weights and optimizer states, whose dump is a
    collective under FSDP; the ranks' local shards hold them."""
    with _no_state_dicts(trainer.strategy):
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    checkpoint.pop("state_dict", None)
    checkpoint.pop("optimizer_states", None)
    return checkpoint


@contextlib.contextmanager
def _no_state_dicts(strategy: Any) -> Iterator[None]:
    # Instance attributes shadow the strategy's two gathering methods for this one dump; the main
    # thread cannot start a checkpoint of its own meanwhile (the watchdog holds the phase).
    strategy.lightning_module_state_dict = dict
    strategy.optimizer_state = lambda optimizer: {}
    try:
        yield
    finally:
        del strategy.lightning_module_state_dict
        del strategy.optimizer_state
