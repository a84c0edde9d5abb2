"""What rlver adds to a Lightning checkpoint and takes back from it.

Lightning saves the weights, optimizer and scheduler states and the loops' progress (which
batch of which epoch: the data order resumes from it). rlver adds the random generators'
states, so a resumed run samples what the uninterrupted one would have, and with LoRA the
adapter settings; it leaves out the frozen base weights, which the model path has.
It never writes files itself: Lightning's checkpoint IO (`checkpoint_io`) does; the module's
`on_save_checkpoint` / `on_load_checkpoint` call these functions.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from rlver.checkpoint.io import writes_sharded_checkpoints
from rlver.modeling.lora import LoraSettings, trainable_names
from rlver.parallel.sharding import clean_name, is_sharded

RNG_KEY = "rlver_rng"


def rng_state() -> dict[str, Any]:
    """torch's, Python's and numpy's generator states as plain lists and tensors.

    Plain, so the checkpoint loads with torch.load(weights_only=True).
    """
    name, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), int(position), int(has_gauss), float(cached)],
    }


def restore_rng_state(state: Mapping[str, Any] | None) -> None:
    """Put back what `rng_state` saved (nothing for a checkpoint without it)."""
    if not state:
        return
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))


def add_lora_settings(checkpoint: dict[str, Any], lora: LoraSettings) -> None:
    checkpoint.setdefault("hyper_parameters", {})["lora"] = dataclasses.asdict(lora)


def drop_frozen_weights(checkpoint: dict[str, Any], networks: Mapping[str, torch.nn.Module | None]) -> None:
    """Keep only the trained tensors (the adapters, the value head) of `networks` in the state dict.

    `networks` maps the LightningModule attribute (the state dict's key prefix) to its module.
    """
    keep = {
        f"{prefix}.{clean_name(name)}"
        for prefix, network in networks.items()
        if network is not None
        for name in trainable_names(network)
    }
    state = checkpoint["state_dict"]
    for key in [k for k in state if k.split(".", 1)[0] in networks and k not in keep]:
        del state[key]


def keep_trained_weights(
    checkpoint: dict[str, Any],
    lora: LoraSettings | None,
    networks: Mapping[str, torch.nn.Module | None],
    strategy: Any,
) -> None:
    """With LoRA: the adapter settings, and of `networks` only the trained tensors.

    A sharded checkpoint keeps the frozen base: torch's distributed checkpoint loader asks for
    every key the sharded model has (the optimizer state still holds only the adapter's).
    """
    if lora is None:
        return
    add_lora_settings(checkpoint, lora)
    if is_sharded(networks["policy_model"]) and writes_sharded_checkpoints(strategy):
        return
    drop_frozen_weights(checkpoint, networks)
