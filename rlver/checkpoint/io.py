"""Checkpoint files and folders that survive kills, and sharded checkpoints read in one process.

* Files: `atomic_torch_save` (a temporary file, fsynced, renamed over the old one), through
  Lightning's CheckpointIO plugin (`AtomicCheckpointIO`; `ShardedCheckpointReader` also reads
  sharded folders where the strategy cannot).
* Sharded folders (FSDP `state_dict_type="sharded"`, FSDP2): written beside their target and
  swapped in whole (`atomic_folder_saves`, `swap_in`); `recover_checkpoints` undoes a swap a kill
  interrupted.
* Reading: `read_checkpoint_state` gives one dict of full tensors from any kind (the hang
  watchdog's one file a rank too, rlver.checkpoint.local_shards), without a process group;
  `consolidate_checkpoint` writes it as one file. Under FSDP, `local_shard_loads` resumes the
  watchdog's kind, each rank from its own file.

`use_rlver_checkpoint_io(strategy)` installs all of it on a Lightning strategy. It decides how
bytes reach the disk, never what a checkpoint holds (that is `checkpoint_state`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from rlver.checkpoint.local_shards import (
    full_weights,
    is_local_shards_checkpoint,
    part_filename,
    restore_local_state,
)
from rlver.core.legacy_paths import legacy_module_paths

# What Lightning writes next to the torch.distributed.checkpoint files of a sharded checkpoint.
METADATA_FILENAME = "meta.pt"
# The top-level key of the weights in a sharded checkpoint: FSDPStrategy, ModelParallelStrategy.
_STATE_KEYS = ("model", "state_dict")


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a Lightning sharded checkpoint: a folder of DCP files with a meta.pt."""
    path = Path(path)
    return path.is_dir() and (path / METADATA_FILENAME).is_file()


def read_checkpoint_state(path: str | Path, *, weights_only: bool = True) -> dict[str, Any]:
    """A Lightning checkpoint as one dict: {"state_dict": full tensors, "hyper_parameters": ..., ...}.

    Reads a single-file checkpoint (`torch.load`) or a sharded checkpoint folder written by
    `FSDPStrategy(state_dict_type="sharded")` (weights under "model") or by
    `ModelParallelStrategy(save_distributed_checkpoint=True)` (weights under "state_dict"):
    torch.distributed.checkpoint files plus meta.pt, which holds everything else (hyper
    parameters, loops, callbacks, rlver's RNG state). The shards are consolidated in this one
    process, without a process group, into full CPU tensors under the LightningModule's names
    ("policy_model.model.layers.0..."). Optimizer states are not read. The hang watchdog's FSDP
    checkpoint, one file a rank (rlver.checkpoint.local_shards), is read the same way.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: a folder that is not a Lightning sharded checkpoint, or one without weights.
    """
    path = Path(path)
    if path.is_file():
        with legacy_module_paths():  # a checkpoint pickled before issue 40 names the flat layout's modules
            return torch.load(path, map_location="cpu", weights_only=weights_only)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} not found")
    if is_local_shards_checkpoint(path):  # the hang watchdog's, under FSDP
        with legacy_module_paths():
            checkpoint = torch.load(path / METADATA_FILENAME, map_location="cpu", weights_only=weights_only)
        checkpoint["state_dict"] = full_weights(path)
        return checkpoint
    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"{path} is a folder but not a Lightning sharded checkpoint (no {METADATA_FILENAME})"
        )
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = FileSystemReader(path)
    tops = {keys[0] for keys in reader.read_metadata().planner_data.values() if keys}
    key = next((k for k in _STATE_KEYS if k in tops), None)
    if key is None:
        raise ValueError(f"{path}: the sharded checkpoint holds no model weights (found {sorted(tops)})")
    loaded: dict[str, Any] = {}
    _load_state_dict(
        loaded, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys={key}), no_dist=True
    )
    with legacy_module_paths():
        checkpoint = torch.load(path / METADATA_FILENAME, map_location="cpu", weights_only=weights_only)
    checkpoint["state_dict"] = dict(loaded[key])
    return checkpoint


def consolidate_checkpoint(path: str | Path, out: str | Path) -> Path:
    """Write a sharded checkpoint folder as one `torch.load`-able file (weights, no optimizer states)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(read_checkpoint_state(path), out)
    return out


def _torch_checkpoint_io() -> type:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    return TorchCheckpointIO


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. the disk is full); the previous one is intact."""


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """`torch.save` that leaves either the old file or the whole new one, never a torn one.

    The bytes go to a hidden temporary file beside `path` (same filesystem, so the rename is
    atomic), are fsynced, and replace `path` in one rename; the folder is fsynced so the rename
    survives a power cut. A write that fails (a full disk, a kill) leaves `path` as it was;
    the temporary files of writers that died are removed by the next write. Lightning's own
    save goes through an in-memory copy (the whole checkpoint twice in RAM) and, with /tmp on
    another filesystem, a non-atomic copy.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = None
    try:
        with temporary.open("wb") as handle:
            writer = _WriteErrors(handle)
            torch.save(obj, writer)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except (OSError, RuntimeError) as error:  # a full disk, a quota, a file size limit
        temporary.unlink(missing_ok=True)
        if isinstance(error, RuntimeError):
            if writer is None or writer.error is None:
                raise  # not the disk: a real serialization problem
            error = writer.error  # torch's zip writer reports it as a RuntimeError
        kept = "the previous checkpoint there is unchanged" if path.exists() else "nothing was there before"
        raise CheckpointWriteError(
            f"{path}: checkpoint not written ({error.strerror or error}); {kept}"
        ) from None
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


class _WriteErrors:
    """A binary file for torch.save that remembers the OSError a write raised (torch's zip
    writer turns it into an uninformative RuntimeError)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.name = getattr(handle, "name", "")
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.handle.flush()


class AtomicCheckpointIO(_torch_checkpoint_io()):  # type: ignore[misc]
    """Lightning's TorchCheckpointIO writing through `atomic_torch_save`."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r})")
        atomic_torch_save(checkpoint, path)


class ShardedCheckpointReader(AtomicCheckpointIO):
    """AtomicCheckpointIO that also reads sharded checkpoint folders (weights only).

    Lets a single-process or DDP `trainer.test/validate(ckpt_path=<sharded folder>)` load the
    weights; resuming `fit` from such a folder still needs the sharded strategy (the optimizer
    states are not converted).
    """

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if is_sharded_checkpoint(path):
            return read_checkpoint_state(path, weights_only=bool(weights_only))
        with legacy_module_paths():  # a checkpoint pickled before issue 40 names the flat layout's modules
            if map_location is None:
                return super().load_checkpoint(path, weights_only=weights_only)
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)


def writes_sharded_checkpoints(strategy: Any) -> bool:
    """Whether `strategy` saves torch.distributed.checkpoint folders (FSDP sharded, FSDP2)."""
    if getattr(strategy, "_state_dict_type", None) == "sharded":
        return True
    return bool(getattr(strategy, "_save_distributed_checkpoint", False))


def swap_in(staging: Path, path: Path) -> None:
    """Make the finished folder (or file) `staging` the checkpoint at `path`.

    Two renames: the old checkpoint aside, the new one in, then the old one is deleted. A kill
    between the renames leaves the old one at `.<name>.old`, which `recover_checkpoints` puts
    back; at no moment is `path` a mix of two checkpoints.
    """
    old = path.with_name(f".{path.name}.old")
    _remove(old)
    if path.exists():
        os.replace(path, old)
    os.replace(staging, path)
    _fsync_folder(path.parent)
    _remove(old)


def recover_checkpoints(folder: str | Path) -> list[Path]:
    """Undo a swap or a staged write that a kill interrupted, in a checkpoint folder.

    Returns the checkpoints put back. Run it before a run looks for `last.ckpt`.
    """
    folder = Path(folder)
    restored = []
    if not folder.is_dir():
        return restored
    for old in folder.glob(".*.old"):
        target = folder / old.name[1 : -len(".old")]
        if target.exists():
            _remove(old)
        else:
            os.replace(old, target)
            restored.append(target)
    for staging in folder.glob(".*.partial"):
        _remove(staging)
    return restored


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_folder(folder: Path) -> None:
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def atomic_folder_saves(strategy: Any) -> None:
    """Sharded checkpoint folders written beside their target and swapped in whole.

    Lightning writes a sharded checkpoint into the target folder itself, over the previous
    one's files: a kill mid-write would leave shards of two steps side by side. Every rank
    writes into `.<name>.partial` instead; once all are done, rank 0 swaps it in (`swap_in`).
    """
    if getattr(strategy, "_rlver_atomic_folders", False):
        return
    save = strategy.save_checkpoint

    def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if not writes_sharded_checkpoints(strategy):
            save(checkpoint, filepath, storage_options=storage_options)
            return
        path = Path(strategy.broadcast(str(filepath)))
        staging = path.with_name(f".{path.name}.partial")
        if strategy.is_global_zero:
            _remove(staging)
        strategy.barrier()
        save(checkpoint, staging, storage_options=storage_options)
        strategy.barrier()
        if strategy.is_global_zero:
            swap_in(staging, path)
        strategy.barrier()

    strategy.save_checkpoint = save_checkpoint
    strategy._rlver_atomic_folders = True


def local_shard_loads(strategy: Any) -> None:
    """`strategy` (FSDP) also resumes the hang watchdog's checkpoint: each rank its own part.

    Lightning would take the folder (it has a meta.pt) for a torch.distributed.checkpoint one."""
    if getattr(strategy, "_rlver_local_shard_loads", False):
        return
    load = strategy.load_checkpoint

    def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        path = Path(strategy.broadcast(str(checkpoint_path)))
        if not is_local_shards_checkpoint(path):
            return load(checkpoint_path, weights_only=weights_only)
        own = path / part_filename(strategy.global_rank)
        # A rank beyond the writers' reads rank 0's part, whose world size then says what is wrong.
        own = own if own.is_file() else path / part_filename(0)
        part = torch.load(own, map_location="cpu", weights_only=True)
        fitting = strategy.lightning_module.trainer.state.fn == "fit"
        optimizers = strategy.optimizers if fitting else None  # evaluation has none to restore
        restore_local_state(strategy.lightning_module, optimizers, part, strategy.world_size, path)
        return torch.load(path / METADATA_FILENAME, map_location="cpu", weights_only=weights_only)

    strategy.load_checkpoint = load_checkpoint
    strategy._rlver_local_shard_loads = True


def use_rlver_checkpoint_io(strategy: Any) -> bool:
    """Atomic checkpoint files for `strategy`, and sharded-folder reading where it lacks it.

    Strategies that read sharded folders themselves (FSDP, ModelParallel, DeepSpeed) get
    AtomicCheckpointIO (used for their single-file, full-state-dict checkpoints); the others
    (single device, DDP) get ShardedCheckpointReader. Only a plain TorchCheckpointIO is replaced:
    a configured one stays. Sharded strategies also write their folders aside and swap them in
    (`atomic_folder_saves`); FSDP also resumes the hang watchdog's checkpoint (`local_shard_loads`).
    Returns whether the checkpoint IO was replaced. Call it before the checkpoint is restored,
    e.g. in `LightningModule.setup`.
    """
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, FSDPStrategy | ModelParallelStrategy):
        atomic_folder_saves(strategy)
    if isinstance(strategy, FSDPStrategy):
        local_shard_loads(strategy)
    if type(strategy.checkpoint_io) is not _torch_checkpoint_io():
        return False
    if isinstance(strategy, FSDPStrategy | ModelParallelStrategy | DeepSpeedStrategy):
        strategy.checkpoint_io = AtomicCheckpointIO()
    else:
        strategy.checkpoint_io = ShardedCheckpointReader()
    return True
