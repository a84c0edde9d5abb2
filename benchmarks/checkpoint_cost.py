"""What a checkpoint costs: size and write time of the quickstart's training state.

Builds the state `rlver fit` checkpoints for the embedded SmolLM2-135M-Instruct under GRPO
with full fine-tuning (float32 weights + AdamW's two moments, after one optimizer step), or
with `--lora` the adapters alone, and writes it `--repeat` times with rlver's atomic writer
(temp file + fsync + rename) and with Lightning's default writer, into `--dir` (put it on the
disk the runs use). The overhead of checkpointing every N steps is the write time over N steps.

    .venv/bin/python benchmarks/checkpoint_cost.py [--dir runs/bench] [--step-seconds 11.6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from rlver.checkpoint.io import atomic_torch_save
from rlver.modeling.lora import LoraSettings, add_adapter
from rlver.modeling.models import load_policy


def training_state(lora: bool) -> dict:
    policy = load_policy("smollm2-135m-instruct", dtype="float32")
    model = add_adapter(policy.model, LoraSettings()) if lora else policy.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    for parameter in trainable:
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()  # creates the moments
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"policy_model.{names[id(p)]}": p.detach() for p in trainable}
    if not lora:
        state = {f"policy_model.{k}": v for k, v in model.state_dict().items()}
    return {"state_dict": state, "optimizer_states": [optimizer.state_dict()], "global_step": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="runs/checkpoint-bench")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--lora", action="store_true", help="the LoRA quickstart's state (adapters only)")
    parser.add_argument("--step-seconds", type=float, default=11.6, help="the quickstart's step time here")
    args = parser.parse_args()

    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint = training_state(args.lora)
    writers = {
        "rlver atomic (fsync + rename)": lambda path: atomic_torch_save(checkpoint, path),
        "Lightning default": lambda path: TorchCheckpointIO().save_checkpoint(checkpoint, path),
    }
    for name, write in writers.items():
        seconds = []
        for index in range(args.repeat):
            path = folder / f"bench{index}.ckpt"
            started = time.perf_counter()
            write(path)
            seconds.append(time.perf_counter() - started)
        size = os.path.getsize(folder / "bench0.ckpt")
        median = statistics.median(seconds)
        every = ", ".join(f"every {n}: {100 * median / (n * args.step_seconds):.1f}%" for n in (1, 2, 4, 14))
        print(f"{name}: {size / 1e9:.2f} GB, {median:.2f} s a write (median of {args.repeat})")
        print(f"  overhead against a {args.step_seconds} s step: {every}")
        for index in range(args.repeat):
            (folder / f"bench{index}.ckpt").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
