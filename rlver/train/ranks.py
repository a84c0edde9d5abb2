"""The LightningModule's collectives across ranks, each a no-op in one process or without a Trainer.

They only move numbers between ranks (and size CPU thread pools); they never decide what is trained.
`Ranks` is the part of `RLVERModule` that holds them (`module.ranks`); `Lockstep` is the ranks'
side of the update as plain callables (`rlver.train.ppo_update` takes one), built by
`Ranks.lockstep` for the module under its Trainer."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rlver.checkpoint.stopping import graceful_stop


def _plain_step(optimizer: Any, counts_as_global_step: bool) -> None:
    optimizer.step()


@dataclass
class Lockstep:
    """What the update needs from the ranks and the trainer; the defaults are one plain process.

    Args:
        world: Number of ranks (DDP averages gradients over them).
        device: Where the ranks' reductions run.
        reduce_sum: A tensor summed over ranks.
        reduce_max: A number's maximum over ranks.
        backward: Backward of a loss (Lightning's `manual_backward` under a trainer).
        optimizer_step: `(optimizer, counts_as_global_step)`: one optimizer step; only the last of
            an iteration advances the trainer's global step.
        gradient_sync: `(sync)` -> a context in which DDP all-reduces gradients only if `sync`.
        stop_requested: Whether a graceful stop was asked for (checked before the first step).
    """

    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor
    reduce_max: Callable[[float], float] = lambda value: value
    backward: Callable[[torch.Tensor], None] = lambda loss: loss.backward()
    optimizer_step: Callable[[Any, bool], None] = _plain_step
    gradient_sync: Callable[[bool], contextlib.AbstractContextManager] = lambda sync: contextlib.nullcontext()
    stop_requested: Callable[[], bool] = lambda: False


def _several(trainer: Any) -> bool:
    return trainer is not None and trainer.world_size > 1


def reduce_sum(trainer: Any, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over all ranks (the tensor itself in one process)."""
    if not _several(trainer):
        return tensor
    return trainer.strategy.reduce(tensor.clone(), reduce_op="sum")


def reduce_max(trainer: Any, value: float, device: torch.device) -> float:
    """`value`'s maximum over all ranks."""
    if not _several(trainer):
        return value
    tensor = torch.tensor([float(value)], device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return float(tensor.item())


def gather_objects(trainer: Any, value: Any) -> list[Any]:
    """`value` from every rank, in rank order ([value] in one process)."""
    if not _several(trainer) or not torch.distributed.is_initialized():
        return [value]
    gathered: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(gathered, value)
    return gathered


@contextlib.contextmanager
def gradient_sync(trainer: Any, sync: bool) -> Iterator[None]:
    """Skip the DDP gradient all-reduce on all but a minibatch's last backward."""
    wrapped = trainer.strategy.model if trainer is not None else None
    no_sync = getattr(wrapped, "no_sync", None)
    if sync or no_sync is None or not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        yield
    else:
        with no_sync():
            yield


def share_cpu_cores(trainer: Any, device: torch.device) -> None:
    """Several ranks on one CPU machine: split the cores instead of each taking them all.

    Oversubscribed threads make every rank spin and the step several times slower.
    An explicit OMP_NUM_THREADS wins.
    """
    if trainer is None or device.type != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    local_ranks = max(1, trainer.world_size // max(1, trainer.num_nodes))
    if local_ranks > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))


class Ranks:
    """The module's collectives over its Trainer's ranks (a part of `RLVERModule`).

    Each is a no-op in one process or without a Trainer; the Trainer is looked up at each call
    (Lightning attaches it after the module is built).
    """

    def __init__(self, module: Any) -> None:
        self.module = module

    @property
    def rank(self) -> int:
        return self.module.global_rank

    @property
    def has_trainer(self) -> bool:
        return self.module._trainer is not None

    def gather_objects(self, value: Any) -> list[Any]:
        return gather_objects(self.module._trainer, value)

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return reduce_sum(self.module._trainer, tensor)

    def reduce_max(self, value: float) -> float:
        return reduce_max(self.module._trainer, value, self.module.device)

    def share_cpu_cores(self) -> None:
        share_cpu_cores(self.module._trainer, self.module.device)

    def lockstep(self, optimizer_step: Callable[[Any, bool], None]) -> Lockstep:
        """How the module's update reaches the other ranks and its Trainer (manual optimization).

        `optimizer_step(optimizer, counts_as_global_step)`: only the last step of an iteration
        advances the Trainer's global step.
        """
        trainer = self.module._trainer
        stop = graceful_stop(trainer)
        return Lockstep(
            world=trainer.world_size if trainer is not None else 1,
            device=self.module.device,
            reduce_sum=self.reduce_sum,
            reduce_max=lambda value: self.reduce_max(value),  # looked up at each call: tests stand in
            backward=self.module.manual_backward,
            optimizer_step=optimizer_step,
            gradient_sync=lambda sync: gradient_sync(trainer, sync),
            stop_requested=lambda: stop is not None and bool(stop.requested),
        )
