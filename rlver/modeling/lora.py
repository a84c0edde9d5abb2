"""LoRA through peft: the policy trains low-rank adapters; engines and exports see merged weights.

A model with an adapter keeps its base weights frozen; only the adapter's A and B matrices
train (so the optimizer holds only them). Rollout engines with their own copy of the weights
(vLLM) get W + (alpha / rank) * B @ A under the base model's Hugging Face names, computed from
the state dict (so it works on gathered FSDP weights too) without touching the training model.
With the adapter switched off the same network is the base model: the KL reference for free.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rlver.parallel.full_weights import full_state_dict, iter_full_weights

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PEFT_PREFIX = "base_model.model."
_ADAPTER = "default"


@dataclass(frozen=True)
class LoraSettings:
    """Low-rank adapters on the policy.

    Args:
        rank: The adapters' rank r.
        alpha: Scaling numerator: the update is (alpha / r) * B @ A.
        dropout: Dropout on the adapters' input while training.
        target_modules: Names of the linear layers that get an adapter (Llama/Qwen names by default).
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = field(default=DEFAULT_TARGETS)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora.rank ({self.rank}) must be >= 1")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha ({self.alpha}) must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout ({self.dropout}) must be within [0, 1)")
        if not self.target_modules:
            raise ValueError("lora.target_modules must name at least one layer")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))  # a YAML list, hashable

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def add_adapter(model: nn.Module, settings: LoraSettings, task_type: str = "CAUSAL_LM") -> nn.Module:
    """`model` wrapped by peft with a fresh adapter (B = 0: the outputs are unchanged at first).

    task_type: CAUSAL_LM for a policy, FEATURE_EXTRACTION for a critic's backbone.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # peft annotates int; a float scales alike
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type=task_type,
    )
    try:
        return get_peft_model(model, config)
    except ValueError as error:  # e.g. no module matches target_modules
        raise ValueError(f"--model.lora: {error}") from None


def is_adapted(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


@contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: the same network with its adapter switched off."""
    with model.disable_adapter():  # type: ignore[operator]
        yield


def merged_state_dict(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A peft model's state dict as the base model's: W + scaling * B @ A, base names, no adapters.

    Works on any full state dict of the peft model (a plain one, or one gathered from FSDP shards);
    the training model is not modified.
    """
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        plain = name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else name
        if ".base_layer." in plain:
            stem = name[: name.index(".base_layer.")]
            down = state[f"{stem}.lora_A.{_ADAPTER}.weight"]
            up = state[f"{stem}.lora_B.{_ADAPTER}.weight"]
            if plain.endswith(".base_layer.weight"):
                delta = (up.float() @ down.float()) * scaling
                tensor = (tensor.float() + delta).to(tensor.dtype)
            plain = plain.replace(".base_layer.", ".")
        merged[plain] = tensor.detach()
    return merged


def inference_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full weights under the base model's names, adapters merged in (a collective under FSDP)."""

    state = full_state_dict(model)
    inner: Any = getattr(model, "module", model)  # DDP
    if not is_adapted(inner):
        return state
    config = inner.peft_config[_ADAPTER]
    return merged_state_dict(state, config.lora_alpha / config.r)


def inference_weights(model: nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Full weights under the base model's names, adapters merged, as `dtype` copies, streamed.

    One FSDP unit (a decoder layer) is gathered at a time, so an engine sync needs one layer's
    memory, not the whole model's (rlver.parallel.full_weights.iter_full_weights). A collective: every rank
    must consume the whole iterator. Each tensor is a copy the caller may keep (vLLM's layer-wise
    loader holds them until a layer is complete).
    """

    inner: Any = getattr(model, "module", model)  # DDP
    scaling = None
    if is_adapted(inner):
        config = inner.peft_config[_ADAPTER]
        scaling = config.lora_alpha / config.r
    for chunk in iter_full_weights(model):
        # A unit holds a layer's base weights and its adapters together, so each merges alone. An
        # unsharded model is one chunk: it merges layer by layer too, or every targeted weight's
        # merged copy would be alive at once (about 12 GiB for a 7B model on one GPU).
        for part in by_layer(chunk) if scaling is not None else (chunk,):
            weights = merged_state_dict(part, scaling) if scaling is not None else part
            for name, tensor in weights.items():
                yield name, tensor.to(dtype=dtype, copy=True)


_LAYER = re.compile(r"^(.*?\.\d+)\.")  # `...layers.<n>.`: the first numbered module on the path


def by_layer(chunk: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """`chunk` split by decoder layer (the first numbered module in a name; the rest together),
    in the chunk's order. A layer's base weights and its adapters stay in one part."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in chunk.items():
        found = _LAYER.match(name)
        parts.setdefault(found.group(1) if found else "", {})[name] = tensor
    yield from parts.values()


def trainable_names(model: nn.Module) -> set[str]:
    return {name for name, parameter in model.named_parameters() if parameter.requires_grad}
