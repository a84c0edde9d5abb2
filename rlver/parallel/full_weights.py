"""Full weights of a (possibly sharded) module: all at once, streamed unit by unit, or in place.

Each function is a collective under FSDP: every rank calls it, in the same order. For the
FSDP1 / FSDP2 flavours and how modules get sharded, see `rlver.parallel.sharding`. Nothing here
writes a checkpoint or changes a weight's value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from rlver.parallel.sharding import (
    clean_name,
    dtensor_class,
    fsdp1_class,
    top_fsdp1_units,
    unwrap_ddp,
    uses_fsdp1,
)


def full_state_dict(module: nn.Module, *, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """Full, unsharded tensors under plain Hugging Face names (a collective: call on every rank).

    Works for a plain module, a DDP module, an FSDP1 root (or a module holding FSDP1 roots)
    and an FSDP2 / DTensor module. Every rank gets the whole dict (not only rank 0), which is
    what a per-rank rollout engine needs. Must be called outside any FSDP1 forward, i.e. not
    from a `training_step` of a LightningModule that Lightning itself wrapped in FSDP.

    For a plain or DDP module the tensors are the parameters' own storage (no copy), as
    `state_dict()` gives them; clone them to keep a snapshot across optimizer steps.

    Args:
        module: The (possibly sharded) model.
        cpu_offload: Return CPU tensors (gathered unit by unit, so the device holds one unit at a
            time under FSDP1, one tensor at a time under FSDP2). False: the module's device.
    """
    module = unwrap_ddp(module)
    if uses_fsdp1(module):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType

        fsdp = fsdp1_class()
        # FSDP1 "offloading" from a CPU compute device frees the memory the returned tensors
        # point to (a segfault in torch 2.13): offload only from accelerators.
        on_accelerator = any(
            getattr(unit.compute_device, "type", "cpu") != "cpu" for unit in top_fsdp1_units(module)
        )
        config = FullStateDictConfig(offload_to_cpu=cpu_offload and on_accelerator, rank0_only=False)
        with fsdp.state_dict_type(module, StateDictType.FULL_STATE_DICT, config):
            state = module.state_dict()
        if cpu_offload:
            state = {name: tensor.cpu() for name, tensor in state.items()}
    else:
        dtensor = dtensor_class()
        state = {}
        for name, tensor in module.state_dict().items():
            if isinstance(tensor, dtensor):
                tensor = tensor.full_tensor()
            state[name] = tensor.cpu() if cpu_offload else tensor
    return {clean_name(name): tensor.detach() for name, tensor in state.items()}


def iter_full_weights(module: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Full parameters under Hugging Face names, one FSDP unit at a time (a collective).

    Where `full_state_dict` holds every full tensor at once (a 7B model is 15 GiB in bf16, 30 GiB
    in float32, on every GPU), this gathers one unit (a decoder layer) per chunk: a weight sync
    needs one layer's worth of memory. Every rank must consume the whole iterator, in order.
    The tensors of a chunk are valid until the next chunk is asked for: copy what you keep.

    * FSDP1: `summon_full_params(unit, recurse=False)` over every unit, deepest owner first
      counted (a parameter belongs to the innermost unit that holds it).
    * FSDP2 / DTensor: one `full_tensor()` per parameter.
    * Plain and DDP modules: one chunk of the parameters themselves (no copy).
    Buffers are left out: inference engines compute their own (rotary tables and the like).
    """
    module = unwrap_ddp(module)
    # Every name of a parameter: a tied head is `lm_head.weight` as well as the embeddings'
    # (engines such as vLLM's CPU build keep their own copy of the head and load it by that name).
    names: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(clean_name(name))
    if uses_fsdp1(module):
        fsdp = fsdp1_class()
        units = [unit for root in top_fsdp1_units(module) for unit in fsdp.fsdp_modules(root)]
        owner: dict[int, nn.Module] = {}
        for unit in units:  # pre-order: inner units overwrite their parents
            for parameter in unit.parameters():
                owner[id(parameter)] = unit
        for unit in units:
            own = [p for p in unit.parameters() if owner[id(p)] is unit]
            if not own:
                continue
            with fsdp.summon_full_params(unit, recurse=False, writeback=False):
                yield {name: p.detach() for p in own for name in names[id(p)]}
        return
    dtensor = dtensor_class()
    if not any(isinstance(p, dtensor) for p in module.parameters()):
        yield {name: p.detach() for p in module.parameters() for name in names[id(p)]}
        return
    from torch.distributed.fsdp import FSDPModule

    groups: dict[int, nn.Module] = {}  # by innermost fully_shard unit (a decoder layer)
    for shard_unit in [module, *(m for m in module.modules() if isinstance(m, FSDPModule))]:
        for parameter in shard_unit.parameters():
            groups[id(parameter)] = shard_unit
    chunks: dict[int, list[nn.Parameter]] = {}
    for parameter in module.parameters():
        chunks.setdefault(id(groups[id(parameter)]), []).append(parameter)
    for own in chunks.values():
        full = {id(p): (p.full_tensor() if isinstance(p, dtensor) else p).detach() for p in own}
        yield {name: full[id(p)] for p in own for name in names[id(p)]}


@contextlib.contextmanager
def gathered_for_generation(module: nn.Module) -> Iterator[None]:
    """Full weights in `module` while generating from it (e.g. the hf engine); a collective.

    Entering and leaving are collectives; inside, no collective runs per forward, so ranks
    may run different numbers of forwards (different reply lengths, different numbers of
    `generate` calls). Call transformers' `generate` with `synced_gpus=False` inside: its
    default under FSDP (True) adds an all_reduce per token and makes ranks wait for each other.

    * FSDP1: `summon_full_params(writeback=False)`, and every FSDP unit's forward calls its
      wrapped module directly (FSDP1 would otherwise reshard after each unit's forward and
      all-gather again in the next one). Needs `use_orig_params=True` and no enclosing FSDP
      forward. Under FSDP mixed precision the summoned weights are the full-precision ones.
    * FSDP2: every `fully_shard` unit is unsharded and kept unsharded after its forwards,
      then resharded on exit.
    * Plain and DDP modules: nothing to do.

    Weights must not be changed inside, and no backward may run inside.
    """
    module = unwrap_ddp(module)
    if uses_fsdp1(module):
        fsdp = fsdp1_class()
        units = fsdp.fsdp_modules(module)
        if any(not getattr(unit, "_use_orig_params", True) for unit in units):
            raise ValueError(
                "generation from FSDP1 units needs use_orig_params=True "
                "(shard with rlver.parallel.sharding.fsdp1_wrap)"
            )
        with fsdp.summon_full_params(module, writeback=False, recurse=True):
            for unit in units:  # an instance attribute wins over FullyShardedDataParallel.forward
                unit.forward = unit.module.__call__  # type: ignore[method-assign]
            try:
                yield
            finally:
                for unit in units:
                    del unit.forward
        return
    from torch.distributed.fsdp import FSDPModule

    fsdp2_units: list[Any] = [sub for sub in module.modules() if isinstance(sub, FSDPModule)]
    if not fsdp2_units:
        yield
        return
    saved = [_reshard_settings(unit) for unit in fsdp2_units]
    try:
        for unit in fsdp2_units:
            unit.unshard()
            unit.set_reshard_after_forward(False, recurse=False)
        yield
    finally:
        for unit, settings in zip(fsdp2_units, saved, strict=True):
            _restore_reshard_settings(unit, settings)
            unit.reshard()


def _reshard_settings(unit: Any) -> Any:
    """An FSDP2 unit's reshard-after-forward settings (torch 2.13 has no public getter)."""
    try:
        state = unit._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch < 2.13: one group per state
            groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        return state._auto_reshard_after_forward, [(g, g.post_forward_mesh_info) for g in groups]
    except AttributeError:
        return None


def _restore_reshard_settings(unit: Any, settings: Any) -> None:
    if settings is None:  # unknown internals: FSDP2's default for non-root units
        unit.set_reshard_after_forward(True, recurse=False)
        return
    auto, groups = settings
    unit._get_fsdp_state()._auto_reshard_after_forward = auto
    for group, mesh_info in groups:
        group.post_forward_mesh_info = mesh_info
