"""Reading a training checkpoint's policy: into a live model, or out as a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

import torch

from rlver.models import resolve_model_path

_POLICY_PREFIX = "policy_model."


def read_policy_state(checkpoint_path: str | Path) -> tuple[str, dict[str, torch.Tensor]]:
    """(policy name from the hyperparameters, policy state dict) of an `rlver fit` checkpoint."""
    from rlver.distributed import clean_name, is_sharded_checkpoint, read_checkpoint_state

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


def load_policy_weights(model: torch.nn.Module, checkpoint_path: str | Path) -> None:
    """Load a checkpoint's policy weights into `model`."""
    _, state = read_policy_state(checkpoint_path)
    load_policy_state(model, state, checkpoint_path)


def export_checkpoint(checkpoint_path: str | Path, out: str | Path) -> Path:
    """Write policy weights + tokenizer from an `rlver fit` checkpoint into `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy, state = read_policy_state(checkpoint_path)
    source = resolve_model_path(policy)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=next(iter(state.values())).dtype)
    load_policy_state(model, state, checkpoint_path)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out
