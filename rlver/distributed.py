"""Sharded training helpers: wrapping, full weights, global grad norms, sharded checkpoints.

Two sharding flavours are supported, both measured on CPU (2 processes, gloo) with torch 2.13
and Lightning 2.6.6 (tests/test_distributed.py):

* FSDP1 (`FullyShardedDataParallel`) under Lightning's `FSDPStrategy`. The policy (and critic)
  must be wrapped in `configure_model` (`shard_for_strategy`), each as its own FSDP root, with
  `use_orig_params=True`: if Lightning wraps the whole LightningModule instead, `training_step`
  runs inside the root's forward, where `summon_full_params` and full state dicts raise and a
  `manual_backward` through parameters of the root unit fails. Lightning refuses `FSDPStrategy`
  with `accelerator="cpu"`; `AnyDeviceFSDPStrategy` lifts that.
* FSDP2 (`fully_shard`) under Lightning's `ModelParallelStrategy(data_parallel_size=N,
  tensor_parallel_size=1)`, which runs on CPU as it is.

Every function that gathers (`full_state_dict`, `clip_grad_norm`, `gathered_for_generation`) is a
collective: every rank must call it, in the same order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Names that wrappers insert into parameter names; Hugging Face and vLLM know none of them.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
# What Lightning writes next to the torch.distributed.checkpoint files of a sharded checkpoint.
METADATA_FILENAME = "meta.pt"
# The top-level key of the weights in a sharded checkpoint: FSDPStrategy, ModelParallelStrategy.
_STATE_KEYS = ("model", "state_dict")


# ---------------------------------------------------------------------------------------- detection
def _fsdp1_class() -> type:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _dtensor_class() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def uses_fsdp1(module: nn.Module) -> bool:
    """Whether `module` is or contains a `FullyShardedDataParallel` (FSDP1) unit."""
    fsdp = _fsdp1_class()
    return any(isinstance(m, fsdp) for m in module.modules())


def uses_fsdp2(module: nn.Module) -> bool:
    """Whether `module` holds DTensor parameters (FSDP2 `fully_shard`, or tensor parallelism)."""
    dtensor = _dtensor_class()
    return any(isinstance(p, dtensor) for p in module.parameters())


def is_sharded(module: nn.Module) -> bool:
    """Whether `module`'s parameters are sharded across ranks (FSDP1 or FSDP2)."""
    return uses_fsdp1(module) or uses_fsdp2(module)


def clean_name(name: str) -> str:
    """A parameter name without the prefixes FSDP, activation checkpointing and compile insert."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _unwrap_ddp(module: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def _top_fsdp1_units(module: nn.Module) -> list[nn.Module]:
    """The FSDP1 units of `module` that are not nested inside another one (roots)."""
    fsdp = _fsdp1_class()
    units: list[nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():
        if isinstance(sub, fsdp) and id(sub) not in inside:
            units.append(sub)
            inside.update(id(m) for m in sub.modules())
    return units


# ---------------------------------------------------------------------------------------- wrapping
def decoder_layer_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The transformer block classes of a Hugging Face model (its `_no_split_modules`).

    These are the units to shard one by one (LlamaDecoderLayer, Qwen2DecoderLayer, ...); the
    names are read from every submodule, so a critic holding an HF backbone works too.
    """
    names: set[str] = set()
    for sub in model.modules():
        declared = getattr(sub, "_no_split_modules", None)
        if declared:
            names.update(declared)
    return {type(sub) for sub in model.modules() if type(sub).__name__ in names}


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fsdp1_wrap(
    module: nn.Module,
    *,
    device: torch.device | str | None = None,
    layer_classes: Iterable[type[nn.Module]] | None = None,
    **fsdp_kwargs: Any,
) -> nn.Module:
    """`module` as an FSDP1 root with one unit per decoder layer, `use_orig_params=True`.

    Args:
        module: The model to shard (a policy, a critic); it becomes its own FSDP root.
        device: The compute device. On CPU it must be passed explicitly as `torch.device("cpu")`
            (FSDP1 raises "FSDP needs a non-CPU accelerator device" for `device_id=None`).
            None: the current CUDA device, else CPU.
        layer_classes: Classes to wrap as units (default: `decoder_layer_classes(module)`);
            ignored when `auto_wrap_policy` is given.
        fsdp_kwargs: More `FullyShardedDataParallel` arguments (mixed_precision,
            sharding_strategy, cpu_offload, auto_wrap_policy, ...).

    `use_orig_params=True` is forced: with flat parameters, a forward inside
    `summon_full_params` (generation) fails with "Expects tensor to be unsharded".
    """
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    fsdp = _fsdp1_class()
    if isinstance(module, fsdp):
        return module
    device = torch.device(device) if device is not None else _default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if fsdp_kwargs.get("auto_wrap_policy") is None:
        classes = set(layer_classes) if layer_classes is not None else decoder_layer_classes(module)
        fsdp_kwargs["auto_wrap_policy"] = ModuleWrapPolicy(classes) if classes else None
    fsdp_kwargs["use_orig_params"] = True
    return fsdp(module, device_id=device, **fsdp_kwargs)


def fsdp2_shard(
    module: nn.Module,
    *,
    mesh: Any = None,
    layer_classes: Iterable[type[nn.Module]] | None = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """`module` sharded in place with FSDP2 `fully_shard`: each decoder layer, then the root.

    Args:
        module: The model to shard; returned (the same object, its class swapped by FSDP2).
        mesh: The 1-D data-parallel DeviceMesh (None: all ranks, on the default device type).
        layer_classes: Classes to shard one by one (default: `decoder_layer_classes(module)`).
        fully_shard_kwargs: More `fully_shard` arguments (mp_policy, reshard_after_forward, ...).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    classes = tuple(set(layer_classes) if layer_classes is not None else decoder_layer_classes(module))
    if classes:
        for sub in list(module.modules()):
            if sub is not module and isinstance(sub, classes) and not isinstance(sub, FSDPModule):
                fully_shard(sub, mesh=mesh, **fully_shard_kwargs)
    if not isinstance(module, FSDPModule):
        fully_shard(module, mesh=mesh, **fully_shard_kwargs)
    return module


def full_precision_reductions(config: Any) -> Any:
    """FSDP1 mixed precision that computes in the low dtype but keeps buffers and reductions float32.

    Lightning's `bf16-mixed` gives `MixedPrecision(bf16, bf16, bf16)`: the RoPE `inv_freq` buffer is
    cast to bf16 (positions then drift from the engine's at long context) and gradients are
    reduce-scattered in bf16 (rounded before they reach the float32 weights). The parameters are
    still gathered in the low dtype; buffers and gradient reductions stay float32.
    """
    if config is None or getattr(config, "param_dtype", None) is None:
        return config
    return dataclasses.replace(config, reduce_dtype=torch.float32, buffer_dtype=torch.float32)


def shard_for_strategy(module: nn.Module, strategy: Any) -> nn.Module:
    """Shard `module` the way the Lightning `strategy` expects; call it in `configure_model`.

    * `FSDPStrategy` (and `AnyDeviceFSDPStrategy`): an FSDP1 root over `module`, built from the
      strategy's settings (cpu_offload, mixed precision, sharding strategy, auto_wrap_policy and
      the other FSDP kwargs) on the strategy's root device. The strategy's `use_orig_params` is
      set to True so Lightning's optimizer check agrees with the wrapping.
    * `ModelParallelStrategy`: FSDP2 `fully_shard` over its "data_parallel" mesh dimension
      (tensor parallelism is not supported: tensor_parallel_size must be 1).
    * Anything else (DDP, single device): `module` unchanged.

    Returns the module to keep (for FSDP1 a new wrapper; assign it back to the attribute).
    """
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, FSDPStrategy):
        kwargs = dict(strategy.kwargs)
        kwargs.pop("use_orig_params", None)
        strategy.kwargs["use_orig_params"] = True
        return fsdp1_wrap(
            module,
            device=strategy.root_device,
            cpu_offload=strategy.cpu_offload,
            mixed_precision=full_precision_reductions(strategy.mixed_precision_config),
            sharding_strategy=strategy.sharding_strategy,
            **kwargs,
        )
    if isinstance(strategy, ModelParallelStrategy):
        mesh = strategy.device_mesh
        if mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                "rlver shards data-parallel only: use ModelParallelStrategy(data_parallel_size=<processes>, "
                f"tensor_parallel_size=1), got tensor_parallel_size={mesh['tensor_parallel'].size()}"
            )
        return fsdp2_shard(module, mesh=mesh["data_parallel"])
    return module


def _lightning_fsdp_strategy() -> type:
    from lightning.pytorch.strategies import FSDPStrategy

    return FSDPStrategy


class AnyDeviceFSDPStrategy(_lightning_fsdp_strategy()):  # type: ignore[misc]
    """Lightning's `FSDPStrategy`, allowed on CPU (gloo) too; on GPUs it behaves the same.

    Lightning 2.6 refuses `FSDPStrategy` unless the accelerator is "cuda"/"gpu" (its check
    compares the exact class, so a subclass passes), and when it wraps the model itself it
    passes `device_id=root_device.index`, None on CPU, which FSDP1 rejects. This class only
    changes those two things, defaults `use_orig_params` to True, and refuses
    `state_dict_type="full"` on CPU (saving it segfaults in torch 2.13: FSDP1's offload of full
    state dicts from a CPU compute device), where "sharded" works.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("use_orig_params", True)
        super().__init__(*args, **kwargs)

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.root_device.type == "cpu" and self._state_dict_type == "full":
            # Lightning gathers full checkpoints with offload_to_cpu=True, which in torch 2.13
            # segfaults when the FSDP compute device is the CPU.
            raise ValueError(
                "FSDP on CPU: use state_dict_type='sharded' (a 'full' checkpoint crashes torch 2.13 "
                "there); rlver.distributed.consolidate_checkpoint makes a single file of it"
            )

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if self.root_device.type != "cpu" or uses_fsdp1(model):
            return super()._setup_model(model)
        from lightning.fabric.strategies.fsdp import (
            _move_torchmetrics_to_device,
            _setup_activation_checkpointing,
        )

        model = _fsdp1_class()(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=full_precision_reductions(self.mixed_precision_config),
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )
        _move_torchmetrics_to_device(model, self.root_device)
        _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
        return model


# ---------------------------------------------------------------------------------------- full weights
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
    module = _unwrap_ddp(module)
    if uses_fsdp1(module):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType

        fsdp = _fsdp1_class()
        # FSDP1 "offloading" from a CPU compute device frees the memory the returned tensors
        # point to (a segfault in torch 2.13): offload only from accelerators.
        on_accelerator = any(unit.compute_device.type != "cpu" for unit in _top_fsdp1_units(module))
        config = FullStateDictConfig(offload_to_cpu=cpu_offload and on_accelerator, rank0_only=False)
        with fsdp.state_dict_type(module, StateDictType.FULL_STATE_DICT, config):
            state = module.state_dict()
        if cpu_offload:
            state = {name: tensor.cpu() for name, tensor in state.items()}
    else:
        dtensor = _dtensor_class()
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
    module = _unwrap_ddp(module)
    names = {id(p): clean_name(n) for n, p in module.named_parameters()}
    if uses_fsdp1(module):
        fsdp = _fsdp1_class()
        units = [unit for root in _top_fsdp1_units(module) for unit in fsdp.fsdp_modules(root)]
        owner: dict[int, nn.Module] = {}
        for unit in units:  # pre-order: inner units overwrite their parents
            for parameter in unit.parameters():
                owner[id(parameter)] = unit
        for unit in units:
            own = [p for p in unit.parameters() if owner[id(p)] is unit]
            if not own:
                continue
            with fsdp.summon_full_params(unit, recurse=False, writeback=False):
                yield {names[id(p)]: p.detach() for p in own}
        return
    dtensor = _dtensor_class()
    if not any(isinstance(p, dtensor) for p in module.parameters()):
        yield {names[id(p)]: p.detach() for p in module.parameters()}
        return
    from torch.distributed.fsdp import FSDPModule

    groups: dict[int, nn.Module] = {}  # by innermost fully_shard unit (a decoder layer)
    for unit in [module, *(m for m in module.modules() if isinstance(m, FSDPModule))]:
        for parameter in unit.parameters():
            groups[id(parameter)] = unit
    chunks: dict[int, list[nn.Parameter]] = {}
    for parameter in module.parameters():
        chunks.setdefault(id(groups[id(parameter)]), []).append(parameter)
    for own in chunks.values():
        yield {names[id(p)]: (p.full_tensor() if isinstance(p, dtensor) else p).detach() for p in own}


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
    module = _unwrap_ddp(module)
    if uses_fsdp1(module):
        fsdp = _fsdp1_class()
        units = fsdp.fsdp_modules(module)
        if any(not getattr(unit, "_use_orig_params", True) for unit in units):
            raise ValueError(
                "generation from FSDP1 units needs use_orig_params=True "
                "(shard with rlver.distributed.fsdp1_wrap)"
            )
        with fsdp.summon_full_params(module, writeback=False, recurse=True):
            for unit in units:  # an instance attribute wins over FullyShardedDataParallel.forward
                unit.forward = unit.module.__call__
            try:
                yield
            finally:
                for unit in units:
                    del unit.forward
        return
    from torch.distributed.fsdp import FSDPModule

    units = [sub for sub in module.modules() if isinstance(sub, FSDPModule)]
    if not units:
        yield
        return
    saved = [_reshard_settings(unit) for unit in units]
    try:
        for unit in units:
            unit.unshard()
            unit.set_reshard_after_forward(False, recurse=False)
        yield
    finally:
        for unit, settings in zip(units, saved, strict=True):
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


# ---------------------------------------------------------------------------------------- gradients
def clip_grad_norm(
    module_or_params: nn.Module | Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0
) -> float:
    """Clip gradients to the global norm over all shards and ranks; returns the pre-clip norm.

    The norm is the one the unsharded model would have (with the ranks' gradients averaged,
    as DDP/FSDP do), identical on every rank. A collective under FSDP: call on every rank.

    * FSDP1: the root's `clip_grad_norm_` (pass the FSDP root, or a module holding exactly one
      FSDP1 root; parameters alone are refused, their gradients are shards).
    * FSDP2 / DTensor parameters: each local shard's norm, reduced over the mesh dims it is
      sharded on, then every gradient scaled by the same factor; plain-tensor parameters
      alongside count as replicated. Every rank must hold the same parameters (it does).
    * DDP / plain: `torch.nn.utils.clip_grad_norm_` (DDP gradients are already all-reduced).

    Args:
        module_or_params: A module, or an iterable of parameters.
        max_norm: The largest allowed norm (`float("inf")`: measure without clipping).
        norm_type: The p of the p-norm (`float("inf")` allowed).
    """
    if isinstance(module_or_params, nn.Module):
        module = _unwrap_ddp(module_or_params)
        if uses_fsdp1(module):
            units = _top_fsdp1_units(module)
            if len(units) != 1:
                raise ValueError(
                    f"clip_grad_norm: {len(units)} FSDP1 roots in one module; clip each root separately"
                )
            inside = {id(p) for p in units[0].parameters()}
            if any(id(p) not in inside for p in module.parameters()):
                raise ValueError("clip_grad_norm: the module has parameters outside its FSDP1 root")
            return float(units[0].clip_grad_norm_(max_norm, norm_type))
        params = list(module.parameters())
    else:
        params = list(module_or_params)
    if any(getattr(p, "_fsdp_flattened", False) for p in params):
        raise ValueError("clip_grad_norm: FSDP1 parameters are shards; pass the FSDP module instead")
    dtensor = _dtensor_class()
    if not any(isinstance(p, dtensor) for p in params):
        if not any(p.grad is not None for p in params):
            return 0.0
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type))
    total_norm = _dtensor_grad_norm(params, float(norm_type))
    coefficient = max_norm / (total_norm + 1e-6)
    if coefficient < 1.0:
        with torch.no_grad():
            for param in params:
                if param.grad is not None:
                    param.grad.mul_(coefficient)
    return total_norm


def _dtensor_grad_norm(params: list[nn.Parameter], norm_type: float) -> float:
    """The global gradient norm of parameters some of which are DTensors.

    Each DTensor gradient's local shard contributes to its (mesh, sharded mesh dims) group,
    reduced over those mesh dims; plain gradients count as replicated. Groups come from the
    parameters, not the gradients, so every rank runs the same collectives even where a
    gradient is missing.
    """
    infinite = math.isinf(norm_type)

    def local(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        if tensor is None or tensor.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=device)
        norm = torch.linalg.vector_norm(tensor, norm_type, dtype=torch.float32)
        return norm if infinite else norm**norm_type

    def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.maximum(a, b) if infinite else a + b

    dtensor = _dtensor_class()
    groups: dict[tuple[int, tuple[int, ...]], tuple[Any, torch.Tensor]] = {}
    replicated = torch.zeros((), dtype=torch.float32)
    for param in params:
        grad = param.grad
        if isinstance(param, dtensor):
            dims = tuple(i for i, placement in enumerate(param.placements) if placement.is_shard())
            key = (id(param.device_mesh), dims)
            part = local(grad.to_local() if grad is not None else None, param.device)
            mesh, total = groups.get(key, (param.device_mesh, torch.zeros_like(part)))
            groups[key] = (mesh, combine(total, part))
        elif grad is not None:
            replicated = combine(replicated, local(grad, grad.device).cpu())
    op = torch.distributed.ReduceOp.MAX if infinite else torch.distributed.ReduceOp.SUM
    overall = replicated
    for (_, dims), (mesh, total) in groups.items():  # insertion order: the same on every rank
        for dim in dims:
            torch.distributed.all_reduce(total, op=op, group=mesh.get_group(dim))
        overall = combine(overall, total.cpu())
    return float(overall if infinite else overall ** (1.0 / norm_type))


# ---------------------------------------------------------------------------------------- checkpoints
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
    ("policy_model.model.layers.0..."). Optimizer states are not read.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: a folder that is not a Lightning sharded checkpoint, or one without weights.
    """
    path = Path(path)
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} not found")
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


def use_rlver_checkpoint_io(strategy: Any) -> bool:
    """Atomic checkpoint files for `strategy`, and sharded-folder reading where it lacks it.

    Strategies that read sharded folders themselves (FSDP, ModelParallel, DeepSpeed) get
    AtomicCheckpointIO (used for their single-file, full-state-dict checkpoints); the others
    (single device, DDP) get ShardedCheckpointReader. Only a plain TorchCheckpointIO is replaced:
    a configured one stays. Returns whether it was replaced. Call it before the checkpoint is
    restored, e.g. in `LightningModule.setup`.
    """
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, FSDPStrategy | ModelParallelStrategy):
        atomic_folder_saves(strategy)
    if type(strategy.checkpoint_io) is not _torch_checkpoint_io():
        return False
    if isinstance(strategy, FSDPStrategy | ModelParallelStrategy | DeepSpeedStrategy):
        strategy.checkpoint_io = AtomicCheckpointIO()
    else:
        strategy.checkpoint_io = ShardedCheckpointReader()
    return True
