"""The networks a training run holds (policy, critic, frozen reference, LoRA adapters), their optimizers,
the weights an engine generates from, and the numerics they may be trained in.

It builds and checks networks; it never runs a rollout or an update."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlver.core.interfaces import RolloutEngine
from rlver.modeling.critic import ValueModel
from rlver.modeling.lora import LoraSettings, add_adapter
from rlver.modeling.models import DTYPES, load_tokenizer, resolve_model_path
from rlver.modeling.precision import install_float32_head
from rlver.parallel.full_weights import gathered_for_generation


@dataclass
class Networks:
    tokenizer: Any
    policy: torch.nn.Module
    value: ValueModel | None
    reference: torch.nn.Module | None  # frozen, in eval mode; None with LoRA (the adapter off) or no KL


def load_networks(
    policy: str,
    critic: str | None,
    dtype: str,
    *,
    with_critic: bool,
    with_reference: bool,
    lora: LoraSettings | None,
    gradient_checkpointing: bool,
) -> Networks:
    """Load the policy (and the critic, the reference) in `dtype`, in train mode, adapters added.

    With LoRA the reference is the policy with its adapter switched off, so none is loaded; the
    critic gets its own adapter on its own frozen copy of the base, plus the full value head.
    """
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(policy)
    weight_dtype = DTYPES[dtype]
    tokenizer = load_tokenizer(path)
    policy_model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=weight_dtype)  # peft may wrap it
    install_float32_head(policy_model)  # float32 logits under bf16 (no change in float32 runs)
    value_model = None
    if with_critic:
        value_model = ValueModel(
            resolve_model_path(critic) if critic else path,
            dtype=weight_dtype,
            head_dtype=torch.float32 if lora is not None else weight_dtype,
        )
    reference = None
    if with_reference and lora is None:
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=weight_dtype).eval()
        reference.requires_grad_(False)
        install_float32_head(reference)
    if lora is not None:
        policy_model = add_adapter(policy_model, lora)
        if gradient_checkpointing:  # frozen embeddings: checkpointed blocks still need an input grad
            policy_model.enable_input_require_grads()
        if value_model is not None:
            # A shared base would save the copy but switch adapters in every forward; separate
            # adapters keep the critic's gradients out of the policy.
            value_model.backbone = add_adapter(value_model.backbone, lora, task_type="FEATURE_EXTRACTION")
            if gradient_checkpointing:
                value_model.backbone.enable_input_require_grads()
    policy_model.train()  # HF loads in eval mode; Lightning expects train mode while fitting
    if value_model is not None:
        value_model.train()
    if gradient_checkpointing:
        policy_model.gradient_checkpointing_enable()
        if value_model is not None:
            value_model.gradient_checkpointing_enable()
    return Networks(tokenizer, policy_model, value_model, reference)


def check_training_precision(precision: str, dtype: str, lora: bool, low_precision_weights: bool) -> None:
    """Refuse numerics under which training silently learns nothing or clips wrongly.

    Args:
        precision: The trainer's precision ("32-true", "bf16-mixed", ...).
        dtype: The weights' dtype (`--model.dtype`).
        lora: Whether only LoRA adapters train (the full weights stay frozen).
        low_precision_weights: `--model.low_precision_weights`: train 16-bit full weights anyway.
    """
    if precision == "16-mixed":
        # Gradients are clipped (and their norm logged) before Lightning's GradScaler unscales
        # them in its optimizer step: the clip would act on scaled gradients.
        raise ValueError(
            "--trainer.precision 16-mixed is not supported (rlver clips gradients before the fp16 "
            "loss scale is removed); use bf16-mixed, or 32-true where bf16 is not native"
        )
    if lora or low_precision_weights:
        return
    if dtype != "float32":
        raise ValueError(
            f"--model.dtype {dtype}: full fine-tuning would keep the trained weights in {dtype}, "
            "where an update at lr 1e-6 is below half a unit in the last place for most weights and "
            "rounds away; use dtype float32 (mixed precision still computes in bf16: "
            "--trainer.precision bf16-mixed), or set --model.low_precision_weights true to train "
            "them anyway"
        )
    if precision in ("bf16-true", "16-true"):
        raise ValueError(
            f"--trainer.precision {precision}: full fine-tuning would keep the trained weights "
            "in 16 bits, where an update at lr 1e-6 rounds away; use bf16-mixed with "
            "--model.dtype float32, or set --model.low_precision_weights true"
        )


@dataclass(frozen=True)
class OptimizerSettings:
    """The AdamW settings of both networks and their learning-rate schedule (the module's flat
    `--model.actor_lr`, ... options, checked here with those names)."""

    actor_lr: float = 1e-6
    critic_lr: float = 5e-6
    weight_decay: float = 0.01
    actor_warmup_ratio: float = 0.02
    critic_warmup_ratio: float = 0.05
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        for name in ("actor_warmup_ratio", "critic_warmup_ratio"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"--model.{name} ({value}) must be within [0, 1)")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"--model.lr_schedule ({self.lr_schedule!r}) must be one of {', '.join(LR_SCHEDULES)}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"--model.min_lr_ratio ({self.min_lr_ratio}) must be within [0, 1]")


def optimizers_and_schedulers(
    policy: torch.nn.Module, critic: torch.nn.Module | None, settings: OptimizerSettings, total_steps: int
) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """AdamW over each network's trained parameters (all, or the adapters); linear warmup over its
    share of `total_steps`, then the schedule (see `lr_factor`) over the rest."""
    networks = [(policy, settings.actor_lr, settings.actor_warmup_ratio)]
    if critic is not None:
        networks.append((critic, settings.critic_lr, settings.critic_warmup_ratio))
    optimizers: list[torch.optim.Optimizer] = []
    schedulers: list[Any] = []
    for network, lr, warmup_ratio in networks:
        trained = [p for p in network.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=settings.weight_decay)
        optimizers.append(optimizer)
        factor = functools.partial(
            lr_factor,
            schedule=settings.lr_schedule,
            warmup_steps=round(warmup_ratio * total_steps),
            total_steps=total_steps,
            min_ratio=settings.min_lr_ratio,
        )
        schedulers.append(torch.optim.lr_scheduler.LambdaLR(optimizer, factor))
    return optimizers, schedulers


LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """The learning rate's multiplier for the update of training step `step + 1` (`LambdaLR` counts from 0).

    Linear warmup to 1 over `warmup_steps`; then `constant` stays at 1, while `linear` and
    `cosine` fall towards `min_ratio`, reached at `total_steps` (after the last update, which so
    still learns): the last updates are small, so the final policy is not the one a single noisy
    step happened to leave.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


@contextlib.contextmanager
def weights_for_generation(engine: RolloutEngine | None, policy: torch.nn.Module | None) -> Iterator[None]:
    """An engine that samples from the training module itself (hf) needs its full weights.

    Under FSDP they are gathered for the whole rollout (a collective on entry and exit;
    none per forward, so ranks may generate different lengths). Engines holding their own
    copy (vllm) got the weights at the last sync and need nothing.
    """
    own_copy = engine is not None and type(engine).sync_weights is not RolloutEngine.sync_weights
    if own_copy:
        # Lightning runs training_step under the precision's autocast; an in-process engine
        # (vLLM) would inherit it and compute its own float32 parts (sampler, log-probs) in bf16.
        with autocast_off():
            yield
    elif policy is None:
        yield
    else:
        with gathered_for_generation(policy):
            yield


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """No autocast on any device type inside (whatever the caller's context enabled)."""
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield
