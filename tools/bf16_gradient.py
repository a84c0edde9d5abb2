"""What bfloat16 does to one GRPO update, against float32, on a fixed batch (SmolLM2-135M).

    .venv/bin/python tools/bf16_gradient.py [--groups 3] [--json out.json]
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 .venv/bin/python tools/bf16_gradient.py   # AMX off

The batch: the quickstart's first step as it would be sampled: `--groups` training users'
openings (built-in English profiles) x 4 replies of 24 tokens at temperature 0.7, sampled once in
float32 with the hf engine and a fixed seed; GRPO advantages from a fixed draw of rewards. On
that batch the update's policy gradient (the shipped loss, rlver.train.precision_probe) is taken
in float32 and compared with:

- float32 with another micro-batch split (only the summation order differs: rounding's floor);
- bf16-mixed as Lightning runs it on a CPU (torch.autocast over the forward) with the head's
  logits in bf16, as rlver did before;
- bf16-mixed with the head in float32 (rlver.modeling.precision.install_float32_head).

Per way: the gradient's cosine with float32's and relative error, the cosine of AdamW's first
step (g / (|g| + eps): every coordinate by its sign), over all weights and over the tied
embedding / head matrix alone; and the trainer's log-prob error on the sampled tokens (mean and
99th percentile of |log p - log p_float32|). Last, the gap between a bf16 *engine* (the whole
model in bf16, as vLLM runs it) and the float32 trainer. Which kernels ran is printed first:
the figures hold for that kernel path only (AMX, AVX512-BF16, or bf16 emulated on AVX2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from rlver_plugins.formats import NoThinkFormat
from rlver_plugins.hf_engine import HFEngine

from rlver.data.profiles import load_profiles
from rlver.modeling.models import load_policy
from rlver.train.precision_probe import (
    compare_gradients,
    engine_logprobs,
    sampled_batch,
    sampled_logprobs,
    update_gradient,
)

WAYS = {
    "float32, micro-batches of 3": dict(precision="32-true", head_in_float32=True, micro_batch_size=3),
    "bf16-mixed, head in bf16": dict(precision="bf16-mixed", head_in_float32=False, micro_batch_size=4),
    "bf16-mixed, head in float32": dict(precision="bf16-mixed", head_in_float32=True, micro_batch_size=4),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=3, help="users, each with 4 replies")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "all")
    capability = torch.backends.cpu.get_cpu_capability()
    kernels = f"{platform.machine()}: torch kernels {capability}, ONEDNN_MAX_CPU_ISA={isa}"
    print(kernels)
    policy = load_policy("smollm2-135m-instruct")
    model = policy.model.float().train()
    prompt_format = NoThinkFormat(language="en")
    chats = [
        [
            {"role": "system", "content": prompt_format.system_prompt(profile)},
            {"role": "user", "content": profile.first_talk or "Hi."},
        ]
        for profile in load_profiles("builtin:en_train")[: args.groups]
    ]
    batch, advantages = sampled_batch(policy.tokenizer, HFEngine(policy), chats, seed=args.seed)
    print(f"batch: {batch.num_sequences} replies, {int(batch.loss_mask.sum())} sampled tokens")

    results: dict = {"kernels": kernels, "replies": batch.num_sequences}
    reference = update_gradient(model, batch, advantages)
    mask = batch.loss_mask.bool()
    exact = sampled_logprobs(model, batch)
    header = f"{'vs float32':28s} {'cosine':>7s} {'rel.err':>7s} {'Adam cos':>8s} {'head cos':>8s}"
    print(f"{header} {'head Adam':>9s}")
    for label, way in WAYS.items():
        started = time.perf_counter()
        grads = update_gradient(model, batch, advantages, **way)
        seconds = time.perf_counter() - started
        whole, head = (
            compare_gradients(grads, reference),
            compare_gradients(grads, reference, only="embed_tokens"),
        )
        logprobs = sampled_logprobs(
            model, batch, precision=way["precision"], head_in_float32=way["head_in_float32"]
        )
        gap = (logprobs - exact)[mask].abs()
        results[label] = {
            "all": whole, "head": head, "seconds": seconds,
            "logprob_gap_mean": float(gap.mean()), "logprob_gap_p99": float(gap.quantile(0.99)),
        }  # fmt: skip
        print(
            f"{label:28s} {whole['cosine']:7.4f} {whole['relative_error']:7.4f}"
            f" {whole['adam_step_cosine']:8.4f}"
            f" {head['cosine']:8.4f} {head['adam_step_cosine']:9.4f}"
            f"   log-prob error mean {gap.mean():.4f} p99 {gap.quantile(0.99):.4f} ({seconds:.0f} s)"
        )
    engine = engine_logprobs(model, batch, torch.bfloat16)
    gap = (engine - exact)[mask]
    k3 = (torch.exp(-gap) - 1 + gap).mean()  # KL(engine || trainer) from the engine's samples
    results["bf16 engine vs float32 trainer"] = {
        "logprob_gap_mean": float(gap.abs().mean()), "logprob_gap_p99": float(gap.abs().quantile(0.99)),
        "logprob_gap_max": float(gap.abs().max()), "k3": float(k3),
    }  # fmt: skip
    print(
        f"bf16 engine vs float32 trainer, sampled tokens: |gap| mean {gap.abs().mean():.4f}, "
        f"p99 {gap.abs().quantile(0.99):.4f}, max {gap.abs().max():.4f}, k3 KL {k3:.5f}"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
