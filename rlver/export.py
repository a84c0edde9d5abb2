"""Export a training checkpoint's policy as a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

import torch

from rlver.models import resolve_model_path


def export_checkpoint(checkpoint_path: str | Path, out: str | Path) -> Path:
    """Write policy weights + tokenizer from an `rlver fit` checkpoint into `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint_path = Path(checkpoint_path)
    if not checkpoint_path.is_file():
        raise ValueError(f"--ckpt: {checkpoint_path} not found")
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
    hyperparameters = checkpoint.get("hyper_parameters", {})
    if "policy" not in hyperparameters:
        raise ValueError(f"--ckpt: {checkpoint_path} is not an rlver checkpoint (no policy hyperparameter)")
    source = resolve_model_path(hyperparameters["policy"])
    prefix = "policy_model."
    state = {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    if not state:
        raise ValueError(f"--ckpt: {checkpoint_path} holds no policy weights")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=next(iter(state.values())).dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied embeddings may be stored once; anything else missing means a mismatched checkpoint.
    missing = [k for k in missing if k not in {"lm_head.weight"}]
    if missing or unexpected:
        raise ValueError(
            f"--ckpt: weights do not match {source}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out
