"""A sharded checkpoint each rank writes alone, from its own shards: the hang watchdog's under FSDP.

A hung peer never joins a collective, and every way FSDP saves is one: its sharded state dicts
gather the weights to cut them into chunks again, its optimizer state dict all-gathers the
parameter keys, torch.distributed.checkpoint plans across ranks. Yet each rank holds all it
needs to write its own part, and to take it back on the same ranks:

* the local shard of every FSDP unit's flat parameter (FSDP1 keeps it in `_local_shard`, also
  while a rollout holds the full weights gathered);
* its optimizers' states, which are per rank already (they hold the local views of the weights);
* the rest of the module whole: parameters outside any unit, persistent buffers.

The folder (rank 0 adds what Lightning keeps beside a sharded checkpoint's shards, meta.pt):

    last.ckpt/
      meta.pt                   the loops, schedulers, callbacks, hyper parameters, rlver's RNG state
      local_shard_rank<R>.pt    rank R's part (`local_state`)

It resumes on as many ranks as wrote it, with the same wrapping: each rank takes its own file back
(`restore_local_state`, which rlver.checkpoint.io installs on the strategy); `full_weights`
assembles the whole weights in one process, for export and evaluation, as the other kinds of
checkpoint are read. Nothing here is a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlver.parallel.sharding import clean_name, fsdp1_class

META_FILENAME = "meta.pt"  # Lightning's name for it, so `--ckpt_path` finds a sharded checkpoint
PART_PREFIX = "local_shard_rank"


def part_filename(rank: int) -> str:
    return f"{PART_PREFIX}{rank}.pt"


def is_local_shards_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a folder written by `local_state`'s ranks (rank 0's part and meta.pt)."""
    path = Path(path)
    return path.is_dir() and (path / META_FILENAME).is_file() and (path / part_filename(0)).is_file()


def flat_units(module: nn.Module) -> dict[str, Any]:
    """The FSDP1 units of `module` that hold weights, by their names in `module`."""
    fsdp = fsdp1_class()
    return {
        name: unit
        for name, unit in module.named_modules()
        if isinstance(unit, fsdp) and unit._flat_param is not None
    }


def _shard_of(flat: torch.Tensor) -> torch.Tensor:
    # Before FSDP's first forward the flat parameter's data is its shard; afterwards the shard is
    # `_local_shard`, while the data may be the gathered weights (inside a rollout).
    return getattr(flat, "_local_shard", flat.data)


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    buffers = {}
    for prefix, sub in module.named_modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                buffers[_joined(prefix, name)] = buffer.detach()
    return buffers


def local_state(
    module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], rank: int, world_size: int
) -> dict[str, Any]:
    """This rank's part of the checkpoint: its shards, its optimizers' states, the rest whole.

    `layout` says how each unit's shards make whole weights (`full_weights`); it is the same on
    every rank. The tensors are the live ones, not copies: write the part before the weights change.
    """
    shards, layout = {}, {}
    for name, unit in flat_units(module).items():
        flat = unit._flat_param
        shards[name] = _shard_of(flat).detach()
        layout[name] = {
            "fqns": list(flat._fqns),
            "shapes": [list(shape) for shape in flat._shapes],
            "numels": list(flat._numels_with_padding),
            "padding": list(flat._is_padding_mask),
            # weights that share a tensor (tied embeddings): flattened once, named twice
            "tied": [
                (
                    _joined(shared.module_name, shared.param_name),
                    _joined(shared.prim_module_name, shared.prim_param_name),
                )
                for shared in flat._shared_param_infos
            ],
            # NO_SHARD: every rank's "shard" is the whole flat parameter
            "shard_world_size": unit.world_size if unit._handle.uses_sharded_strategy else 1,
        }
    whole = {  # FSDP marks the parameters it flattened (and its flat parameters)
        name: p.detach() for name, p in module.named_parameters() if not getattr(p, "_fsdp_flattened", False)
    }
    return {
        "rank": rank,
        "world_size": world_size,
        "flat_shards": shards,
        "layout": layout,
        "parameters": whole,
        "buffers": _persistent_buffers(module),
        "optimizer_states": [optimizer.state_dict() for optimizer in optimizers],
    }


def restore_local_state(
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] | None,
    part: dict[str, Any],
    world_size: int,
    source: str | Path,
) -> None:
    """Put back this rank's `local_state` part, written by a run on `world_size` ranks as this one;
    the optimizers' states too, unless `optimizers` is None (an evaluation).

    Raises:
        ValueError: the part was written on another number of ranks, for other FSDP units or
            other optimizers (a shard is only this rank's piece of the weights it was cut from).
    """
    if part["world_size"] != world_size:
        raise ValueError(
            f"{source}: written by the hang watchdog on {part['world_size']} ranks, each its own shards; "
            f"resume it on {part['world_size']} ranks (this run has {world_size})"
        )
    units = flat_units(module)
    if set(units) != set(part["flat_shards"]):
        raise ValueError(
            f"{source}: written for the FSDP units {sorted(part['flat_shards'])}, but this model has "
            f"{sorted(units)}: resume with the model and wrapping that wrote it"
        )
    if optimizers is not None and len(optimizers) != len(part["optimizer_states"]):
        raise ValueError(
            f"{source}: holds {len(part['optimizer_states'])} optimizer states, this run has "
            f"{len(optimizers)} optimizers"
        )
    with torch.no_grad():
        for name, shard in part["flat_shards"].items():
            flat = units[name]._flat_param
            for target in {id(t): t for t in (_shard_of(flat), flat.data)}.values():
                if target.shape != shard.shape:
                    here, there = list(target.shape), list(shard.shape)
                    raise ValueError(f"{source}: {name}'s shard is {there}, here {here}")
                target.copy_(shard)
        parameters = dict(module.named_parameters())
        for name, tensor in part["parameters"].items():
            parameters[name].copy_(tensor)
        for name, tensor in part["buffers"].items():
            module.get_buffer(name).copy_(tensor)
    for optimizer, state in zip(optimizers or [], part["optimizer_states"], strict=False):
        optimizer.load_state_dict(state)  # None: no optimizers, nothing zipped (counts checked above)


def full_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The whole weights of a local-shards checkpoint, under the LightningModule's names, on CPU.

    Every rank's shards of a unit, in rank order, are its flat parameter (with FSDP's padding),
    which `layout` cuts into the original tensors.

    Raises:
        ValueError: a rank's part is missing, or the units were sharded over fewer ranks than
            wrote it (HYBRID_SHARD: each node holds a whole copy; not assembled here).
    """
    path = Path(path)
    first = torch.load(path / part_filename(0), map_location="cpu", weights_only=True)
    world = first["world_size"]
    parts = [first]
    for rank in range(1, world):
        file = path / part_filename(rank)
        if not file.is_file():
            raise ValueError(f"{path}: rank {rank}'s part ({file.name}) is missing; it has {world} ranks")
        parts.append(torch.load(file, map_location="cpu", weights_only=True))
    state: dict[str, torch.Tensor] = {}
    for unit, layout in first["layout"].items():
        sharded_over = layout["shard_world_size"]
        if sharded_over not in (1, world):
            raise ValueError(
                f"{path}: {unit} is sharded over {sharded_over} of the {world} ranks (HYBRID_SHARD): "
                "not assembled in one process; resume it on its ranks instead"
            )
        flat = torch.cat([part["flat_shards"][unit] for part in parts[:sharded_over]])
        tensors = iter(zip(layout["fqns"], layout["shapes"], strict=True))
        offset = 0
        for numel, is_padding in zip(layout["numels"], layout["padding"], strict=True):
            if not is_padding:
                fqn, shape = next(tensors)
                state[clean_name(_joined(unit, fqn))] = flat[offset : offset + numel].view(shape).clone()
            offset += numel
        for alias, primary in layout["tied"]:
            state[clean_name(_joined(unit, alias))] = state[clean_name(_joined(unit, primary))]
    for name, tensor in {**first["parameters"], **first["buffers"]}.items():
        state[clean_name(name)] = tensor
    return state
