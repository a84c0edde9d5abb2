"""Sharding: which flavour a module uses, wrapping it, and the CPU-capable FSDP strategy.

Two sharding flavours are supported, both measured on CPU (2 processes, gloo) with torch 2.13
and Lightning 2.6.6 (tests/integration/test_distributed.py):

* FSDP1 (`FullyShardedDataParallel`) under Lightning's `FSDPStrategy`. The policy (and critic)
  must be wrapped in `configure_model` (`shard_for_strategy`), each as its own FSDP root, with
  `use_orig_params=True`: if Lightning wraps the whole LightningModule instead, `training_step`
  runs inside the root's forward, where `summon_full_params` and full state dicts raise and a
  `manual_backward` through parameters of the root unit fails. Lightning refuses `FSDPStrategy`
  with `accelerator="cpu"`; `AnyDeviceFSDPStrategy` lifts that.
* FSDP2 (`fully_shard`) under Lightning's `ModelParallelStrategy(data_parallel_size=N,
  tensor_parallel_size=1)`, which runs on CPU as it is.

Full weights of a sharded module are in `rlver.parallel.full_weights`, its global gradient norm in
`rlver.parallel.grad_clip`, checkpoint files and folders in `rlver.checkpoint.io`. Every function there that
gathers (`full_state_dict`, `iter_full_weights`, `gathered_for_generation`, `clip_grad_norm`) is a
collective: every rank must call it, in the same order. This module only wraps and names;
it never gathers full weights or touches files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # imported when first needed at run time (a CPU-only import stays light)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

# Names that wrappers insert into parameter names; Hugging Face and vLLM know none of them.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


# ---------------------------------------------------------------------------------------- detection
def fsdp1_class() -> type[FullyShardedDataParallel]:
    """FSDP1's `FullyShardedDataParallel` (imported when first needed)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def dtensor_class() -> type[DTensor]:
    """`DTensor`, the parameter type of FSDP2 (imported when first needed)."""
    from torch.distributed.tensor import DTensor

    return DTensor


def uses_fsdp1(module: nn.Module) -> bool:
    """Whether `module` is or contains a `FullyShardedDataParallel` (FSDP1) unit."""
    fsdp = fsdp1_class()
    return any(isinstance(m, fsdp) for m in module.modules())


def uses_fsdp2(module: nn.Module) -> bool:
    """Whether `module` holds DTensor parameters (FSDP2 `fully_shard`, or tensor parallelism)."""
    dtensor = dtensor_class()
    return any(isinstance(p, dtensor) for p in module.parameters())


def is_sharded(module: nn.Module) -> bool:
    """Whether `module`'s parameters are sharded across ranks (FSDP1 or FSDP2)."""
    return uses_fsdp1(module) or uses_fsdp2(module)


def clean_name(name: str) -> str:
    """A parameter name without the prefixes FSDP, activation checkpointing and compile insert."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def unwrap_ddp(module: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel wrapper (others unchanged)."""
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def top_fsdp1_units(module: nn.Module) -> list[FullyShardedDataParallel]:
    """The FSDP1 units of `module` that are not nested inside another one (roots)."""
    fsdp = fsdp1_class()
    units: list[FullyShardedDataParallel] = []
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

    fsdp = fsdp1_class()
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
                "there); rlver.checkpoint.io.consolidate_checkpoint makes a single file of it"
            )

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if self.root_device.type != "cpu" or uses_fsdp1(model):
            return super()._setup_model(model)
        from lightning.fabric.strategies.fsdp import (
            _move_torchmetrics_to_device,
            _setup_activation_checkpointing,
        )

        model = fsdp1_class()(
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
