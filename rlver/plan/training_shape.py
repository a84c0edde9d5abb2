"""What memory depends on besides the architecture, read from a recipe or from a running Trainer.

`rlver plan` reads a recipe (`shape_from_recipe`); `rlver fit`'s check reads the module and the
Trainer it is about to train with (`shape_from_run`). Both go through `training_shape`, so a recipe
and the run it starts give the same shape. rlver.plan.memory_plan turns a shape into bytes.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlver.core.interfaces import AdvantageEstimator
from rlver.core.plugins import get_registry, implementing, plain_config, split_spec
from rlver.data.datamodule import profiles_per_rank
from rlver.modeling.lora import LoraSettings

GIB = 2**30
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_WHOLE_SHARDING = "whole"


@dataclass(frozen=True)
class TrainingShape:
    """Everything besides the architecture that memory depends on, as plain values."""

    gpu_memory_gib: float
    world_size: int
    shard_count: int  # GPUs each model is sharded over (1: whole on every GPU)
    master_bytes: int
    compute_bytes: int
    micro_batch_size: int
    context_tokens: int
    critic: bool
    reference: bool
    entropy: bool
    gradient_checkpointing: bool
    engine: str = "vllm"
    engine_on_gpu: bool = True
    gpu_memory_utilization: float = 0.8
    sleep_between_rollouts: bool = False
    engine_bytes: int = 2
    engine_cpu_kv_gib: float = 2.0
    rollout_sequences: int = 1  # sequences an engine without its own weights generates at once
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = ()
    full_state_dict_checkpoint: bool = False
    sharding_name: str = _WHOLE_SHARDING
    overlap: bool = False  # the next step's rollout runs during the update (rlver.rollout.overlap)
    engine_max_model_len: int | None = None  # vLLM's max_model_len (None: the model's max positions)
    dialogues_per_rank: int = 1  # a step's dialogues on each rank: profiles x group_size


def training_shape(
    model: dict[str, Any],
    *,
    critic: bool,
    gpu_memory_gib: float,
    world_size: int,
    devices_per_node: int,
    sharding: str | None,
    state_dict_type: str,
    precision: str,
    accelerator: str,
    batch_size: int = 1,
) -> TrainingShape:
    """A TrainingShape from the model section (plain values, as `rlver fit` reads it) and the trainer's.

    The `ppo` and `rollout` sections are read as parsed, every default filled in (jsonargparse fills
    them from the module's signature; a run's settings are whole dataclasses): the planner never
    imports the classes of the layers it plans for.
    """
    engine_name, engine_options = split_spec(model.get("engine", "hf"), flag="--model.engine")
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(
            get_registry().get("engines", engine_name).factory
        ).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    engine = {**defaults, **engine_options}
    dtype = model.get("dtype", "float32")
    if dtype not in _BYTES:
        raise ValueError(f"--model.dtype ({dtype!r}) must be one of {', '.join(_BYTES)}")
    master = _BYTES[dtype]
    cpu = accelerator == "cpu"
    # `auto` is float32 on a CPU and bf16-mixed on a GPU with bf16 (rlver.modeling.precision)
    low_precision = "16" in str(precision) or (str(precision) == "auto" and not cpu)
    compute = 2 if low_precision else master
    if str(precision).endswith("-true"):
        master = compute  # Lightning converts the weights themselves
    sharding = (sharding or _WHOLE_SHARDING).upper()
    shard_count = {"FULL_SHARD": world_size, "HYBRID_SHARD": min(devices_per_node, world_size)}.get(
        sharding, 1
    )
    ppo, rollout = model.get("ppo") or {}, model.get("rollout") or {}
    lora = LoraSettings(**model["lora"]) if model.get("lora") is not None else None
    return TrainingShape(
        gpu_memory_gib=gpu_memory_gib,
        world_size=world_size,
        shard_count=shard_count,
        master_bytes=master,
        compute_bytes=compute,
        micro_batch_size=int(_setting(ppo, "micro_batch_size", "--model.ppo")),
        context_tokens=int(_setting(rollout, "max_context_tokens", "--model.rollout")),
        critic=critic,
        reference=float(ppo.get("kl_coef", 0.0)) > 0 and lora is None,
        entropy=float(_setting(ppo, "entropy_coef", "--model.ppo")) > 0,
        gradient_checkpointing=bool(model.get("gradient_checkpointing", False)),
        engine=engine_name,
        engine_on_gpu=accelerator != "cpu",
        gpu_memory_utilization=float(engine.get("gpu_memory_utilization", 0.8)),
        # Overlapped steps keep the engine generating through the update: it never sleeps.
        sleep_between_rollouts=bool(engine.get("sleep_between_rollouts", False))
        and accelerator != "cpu"
        and model.get("overlap") is None,
        engine_bytes=4
        if engine.get("dtype") == "float32" or (engine.get("dtype", "auto") == "auto" and cpu)
        else 2,
        engine_cpu_kv_gib=float(engine.get("cpu_kv_cache_gib", 2)),
        # overlapped with max_staleness k: k steps' rollouts generate at once
        rollout_sequences=batch_size * int(model.get("group_size", 1)) * overlap_depth(model.get("overlap")),
        lora_rank=lora.rank if lora is not None else None,
        lora_targets=lora.target_modules if lora is not None else (),
        full_state_dict_checkpoint=state_dict_type == "full",
        sharding_name=sharding if shard_count > 1 else _WHOLE_SHARDING,
        overlap=model.get("overlap") is not None,
        engine_max_model_len=int(engine["max_model_len"]) if engine.get("max_model_len") else None,
        dialogues_per_rank=batch_size * int(model.get("group_size", 1)),
    )


def shape_from_recipe(config: Any, *, gpu_memory_gib: float, world_size: int | None = None) -> TrainingShape:
    """A recipe as `rlver.commands.recipes.parse_recipe` returns it; world_size, not devices x num_nodes."""
    trainer, model = config.trainer, plain_config(config.model)
    accelerator = str(trainer.accelerator or "auto")
    devices = _device_count(trainer.devices, accelerator)
    nodes = int(trainer.num_nodes or 1)
    world = world_size or devices * nodes
    if world < 1:
        raise ValueError(f"--world-size ({world}) must be >= 1")
    strategy = trainer.strategy
    sharding, state_dict_type = None, "none"
    if isinstance(strategy, str) and strategy.lower().startswith("fsdp"):
        sharding, state_dict_type = "FULL_SHARD", "full"  # Lightning's FSDPStrategy defaults
    elif not isinstance(strategy, str) and "FSDP" in str(getattr(strategy, "class_path", "")):
        init_args = plain_config(getattr(strategy, "init_args", None) or {})
        chosen = init_args.get("sharding_strategy") or "FULL_SHARD"
        sharding = getattr(chosen, "name", str(chosen))
        state_dict_type = init_args.get("state_dict_type") or "full"
    built = get_registry().build("advantages", model.get("advantage", "grpo"), flag="--model.advantage")
    estimator = implementing(AdvantageEstimator, built, "--model.advantage")  # type: ignore[type-abstract]
    return training_shape(
        model,
        critic=estimator.requires_critic,
        gpu_memory_gib=gpu_memory_gib,
        world_size=world,
        devices_per_node=devices,
        sharding=sharding,
        state_dict_type=state_dict_type,
        precision=str(trainer.precision or "auto"),
        accelerator="cpu" if accelerator == "cpu" else "gpu",
        batch_size=per_rank_batch(config.data, world),
    )


def shape_from_run(module: Any, trainer: Any, gpu_memory_gib: float) -> TrainingShape:
    """The RLVERModule and the Trainer of a `rlver fit` (in `setup`, before the weights load)."""
    from lightning.pytorch.strategies import FSDPStrategy

    strategy = trainer.strategy
    fsdp = isinstance(strategy, FSDPStrategy)
    hparams = module.hparams
    model = {
        "dtype": hparams.dtype,
        "engine": module.component_specs["engine"],
        "ppo": dataclasses.asdict(module.ppo),
        "rollout": dataclasses.asdict(module.rollout_settings),
        "lora": dataclasses.asdict(module.lora) if module.lora is not None else None,
        "gradient_checkpointing": hparams.gradient_checkpointing,
        "group_size": hparams.group_size,
        "overlap": dataclasses.asdict(module.overlap) if module.overlap is not None else None,
    }
    datamodule = getattr(trainer, "datamodule", None)
    return training_shape(
        model,
        critic=bool(module.uses_critic),
        gpu_memory_gib=gpu_memory_gib,
        world_size=trainer.world_size,
        devices_per_node=max(1, trainer.world_size // max(1, trainer.num_nodes)),
        sharding=strategy.sharding_strategy.name if fsdp else None,
        state_dict_type=getattr(strategy, "_state_dict_type", "full") if fsdp else "none",
        precision=str(trainer.precision),
        accelerator="cpu" if strategy.root_device.type == "cpu" else "gpu",
        batch_size=int(getattr(datamodule, "batch_size", 1) or 1),
    )


def _setting(section: Mapping[str, Any], name: str, flag: str) -> Any:
    """One setting of a parsed section; a section without it was not read the way `rlver fit` reads it."""
    if name not in section:
        raise ValueError(
            f"{flag}.{name} is missing: plan a recipe as `rlver fit` parses it (defaults filled in)"
        )
    return section[name]


def overlap_depth(overlap: Any) -> int:
    """How many steps' rollouts run at once: `--model.overlap.max_staleness` (1 without overlap)."""
    if overlap is None:
        return 1
    value = overlap.get("max_staleness", 1) if isinstance(overlap, dict) else overlap.max_staleness
    return max(1, int(value))


def _device_count(devices: Any, accelerator: str) -> int:
    """Lightning's `devices`: a count, a list or "0,1" of ids, or "auto" / -1 (every visible GPU)."""
    if isinstance(devices, list | tuple):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([part for part in devices.split(",") if part.strip()])
    if devices in (None, "auto", -1, "-1"):
        if accelerator == "cpu":
            return 1
        import torch

        return max(1, torch.cuda.device_count())
    return int(devices)


def per_rank_batch(data: Any, world_size: int) -> int:
    """The profiles of a step on one rank, as ProfileDataModule splits them."""
    per_step = getattr(data, "profiles_per_step", None)
    if per_step is None:
        return int(getattr(data, "batch_size", 1) or 1)
    return profiles_per_rank(int(per_step), world_size)
