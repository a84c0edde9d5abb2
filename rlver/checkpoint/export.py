"""Reading a training checkpoint's policy: into a live model, or out as a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rlver.checkpoint.io import is_sharded_checkpoint, read_checkpoint_state
from rlver.modeling.lora import LoraSettings, add_adapter, merged_state_dict
from rlver.modeling.models import resolve_model_path
from rlver.parallel.sharding import clean_name

_POLICY_PREFIX = "policy_model."


def read_lora_settings(checkpoint_path: str | Path) -> Any:
    """The LoraSettings a checkpoint was trained with, or None (full fine-tuning)."""

    lora = read_checkpoint_state(Path(checkpoint_path)).get("hyper_parameters", {}).get("lora")
    if lora is None or isinstance(lora, LoraSettings):
        return lora
    return LoraSettings(**dict(lora))


def read_policy_state(checkpoint_path: str | Path) -> tuple[str, dict[str, torch.Tensor]]:
    """(policy name from the hyperparameters, policy state dict) of an `rlver fit` checkpoint.

    A LoRA run's checkpoint holds only the adapter (peft names); see `merged_policy_state`.
    """

    checkpoint_path = Path(checkpoint_path)
    if not (checkpoint_path.is_file() or is_sharded_checkpoint(checkpoint_path)):
        raise ValueError(f"--ckpt: {checkpoint_path} not found (a checkpoint file or an FSDP sharded folder)")
    # A file, or the folder of a sharded (FSDP) checkpoint, consolidated here in one process.
    checkpoint = read_checkpoint_state(checkpoint_path)
    hyperparameters = checkpoint.get("hyper_parameters", {})
    if "policy" not in hyperparameters:
        raise ValueError(f"--ckpt: {checkpoint_path} is not an rlver checkpoint (no policy hyperparameter)")
    state = {
        clean_name(key[len(_POLICY_PREFIX) :]): value
        for key, value in checkpoint["state_dict"].items()
        if key.startswith(_POLICY_PREFIX)
    }
    if not state:
        raise ValueError(f"--ckpt: {checkpoint_path} holds no policy weights")
    return hyperparameters["policy"], state


def load_policy_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str | Path) -> None:
    """Load a policy state dict into a model of the same architecture, strictly but for tied weights."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied embeddings may be stored once; anything else missing means a mismatched checkpoint.
    missing = [key for key in missing if key != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(
            f"--ckpt: {source} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def merged_policy_state(
    base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scaling: float
) -> dict[str, torch.Tensor]:
    """The base model's weights with a LoRA checkpoint's adapter merged in (base names)."""

    full: dict[str, torch.Tensor] = {}
    stems = {key.split(".lora_", 1)[0] for key in adapter if ".lora_" in key}
    for name, tensor in base.items():
        stem = "base_model.model." + name.rsplit(".", 1)[0]
        leaf = name.rsplit(".", 1)[1]
        full[f"{stem}.base_layer.{leaf}" if stem in stems else "base_model.model." + name] = tensor
    full.update(adapter)
    return merged_state_dict(full, scaling)


def load_policy_weights(model: torch.nn.Module, checkpoint_path: str | Path) -> None:
    """Load a checkpoint's policy weights into `model` (a LoRA checkpoint's adapter merged in)."""
    _, state = read_policy_state(checkpoint_path)
    lora = read_lora_settings(checkpoint_path)
    if lora is not None:
        state = merged_policy_state(model.state_dict(), state, lora.scaling)
    load_policy_state(model, state, checkpoint_path)


def export_checkpoint(checkpoint_path: str | Path, out: str | Path, adapter: bool = False) -> Path:
    """Write the policy + tokenizer of an `rlver fit` checkpoint into `out` as a Hugging Face folder.

    A LoRA run writes merged weights by default, or with `adapter` only the adapter in peft's
    format (adapter_config.json + adapter_model.safetensors, for `PeftModel.from_pretrained`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy, state = read_policy_state(checkpoint_path)
    lora = read_lora_settings(checkpoint_path)
    if adapter and lora is None:
        raise ValueError(f"--adapter: {checkpoint_path} is not from a LoRA run (it has full weights)")
    source = resolve_model_path(policy)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=next(iter(state.values())).dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if adapter:
        from peft import set_peft_model_state_dict

        peft_model = add_adapter(model, lora)
        set_peft_model_state_dict(peft_model, {k.replace(".default.", "."): v for k, v in state.items()})
        peft_model.save_pretrained(out)
    else:
        if lora is not None:
            state = merged_policy_state(model.state_dict(), state, lora.scaling)
        load_policy_state(model, state, checkpoint_path)
        model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out
