"""How far a run's steps are from what this CPU's matrix multiplies allow: the floor of a step.

A step's work is almost all the model's linear layers: in generation, each decoded token of every
dialogue in a call and the prompts before them; in the update, every token of every dialogue
through the forward, the backward (twice the forward) and, with gradient checkpointing, the
forward again, the head only at the loss's positions. This script counts those tokens from a
run's transcripts (the chat template as the policy sees it), times the model's own linear shapes
on this CPU at the row counts the run used (a decode step of a call's dialogues, a micro-batch of
the update, a prefill), and prints each phase's floor (the linears alone: no attention, norms,
optimizer or Python) beside the medians the run logged (TensorBoard `perf/`):

    .venv/bin/python benchmarks/step_floor.py runs/quickstart/tensorboard

The floor is a lower bound, not a target: a phase at 1.5x its floor has little left to win
without doing less work; one at 3x does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import yaml


def median_scalars(folder: Path, tags: list[str]) -> dict[str, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    have = set(accumulator.Tags()["scalars"])
    medians = {}
    for tag in tags:
        if tag in have:
            events = accumulator.Scalars(tag)
            medians[tag] = statistics.median(e.value for e in events[1:] or events)  # the first step warms up
    return medians


def step_tokens(transcripts: Path, tokenizer) -> dict[str, float]:
    """Median per step: prompt tokens prefilled (a group's shared first prompt once), tokens
    decoded (the update's loss tokens too), dialogues, and the update's tokens (whole dialogues)."""

    def count(messages: list[dict[str, str]], prompt: bool) -> int:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    steps: dict[int, list[dict]] = {}
    for line in transcripts.read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], []).append(record)
    rows = []
    for records in steps.values():
        prefill = decoded = whole = 0
        first_prompts = set()
        for record in records:
            messages = [{"role": "system", "content": record["system_prompt"]}]
            for index, turn in enumerate(record["turns"]):
                if turn["role"] == "user":
                    messages.append({"role": "user", "content": turn["text"]})
                    continue
                prompt = count(messages, prompt=True)
                opening = (record["profile_id"], prompt)
                if index > 1 or opening not in first_prompts:
                    prefill += prompt
                    first_prompts.add(opening)
                decoded += turn["num_tokens"]
                messages.append({"role": "assistant", "content": turn["text"]})
            whole += count(messages, prompt=False)
        rows.append({"prefill": prefill, "decoded": decoded, "dialogues": len(records), "whole": whole})
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def linear_seconds(shapes: list[tuple[int, int]], rows: int, repeats: int = 5) -> float:
    """Seconds for one pass of `rows` rows through linears of (out, in) `shapes`, float32, each
    weight its own tensor as in the model (a decode step streams them all from memory: one layer's
    weights timed again and again would sit in the cache)."""
    weights = [torch.randn(out, inp) for out, inp in shapes]
    inputs = [torch.randn(rows, inp) for _, inp in shapes]

    def once() -> None:
        for w, x in zip(weights, inputs, strict=True):
            torch.nn.functional.linear(x, w)

    once()
    timings = []
    for _ in range(5):  # the fastest of five rounds: this is a floor, and the CPU's speed drifts
        started = time.perf_counter()
        for _ in range(repeats):
            once()
        timings.append((time.perf_counter() - started) / repeats)
    return min(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log_dir", type=Path, help="a run's TensorBoard folder (config.yaml, rollouts/)")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    from rlver.modeling.models import resolve_model_path

    config = yaml.safe_load((args.log_dir / "config.yaml").read_text())["model"]
    path = resolve_model_path(config["policy"])
    model, tokenizer = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    hidden, inner = model.hidden_size, model.intermediate_size
    kv = hidden // model.num_attention_heads * model.num_key_value_heads
    attention = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]  # q, k, v, o
    layer = [*attention, (inner, hidden), (inner, hidden), (hidden, inner)]  # gate, up, down
    head = [(model.vocab_size, hidden)]
    layers = model.num_hidden_layers

    tokens = step_tokens(args.log_dir / "rollouts" / "train_rank0.jsonl", tokenizer)
    dialogues, turns = int(tokens["dialogues"]), config["rollout"]["max_turns"]
    micro = config["ppo"]["micro_batch_size"]
    micro_rows = int(tokens["whole"] / dialogues * micro)
    body_per_row = lambda rows: linear_seconds(layer * layers, rows) / rows  # noqa: E731
    head_per_row = lambda rows: linear_seconds(head, rows) / rows  # noqa: E731

    decode = tokens["decoded"] / dialogues * linear_seconds(layer * layers + head, dialogues)
    prefill = tokens["prefill"] * body_per_row(256)
    passes = 4 if config.get("gradient_checkpointing") else 3  # forward, backward (2x), recompute
    update = tokens["whole"] * passes * body_per_row(micro_rows) + tokens["decoded"] * 3 * head_per_row(256)
    tags = ["perf/generate_seconds", "perf/update_seconds", "perf/step_seconds"]
    logged = median_scalars(args.log_dir, tags)

    threads = torch.get_num_threads()
    print(f"{config['policy']}, {threads} threads; a median step: {dialogues} dialogues x {turns} turns,")
    print(
        f"{tokens['prefill']:.0f} prompt tokens prefilled, {tokens['decoded']:.0f} decoded, "
        f"{tokens['whole']:.0f} in the update ({passes} passes of the body, micro-batches of {micro})\n"
    )
    print("| phase | floor (linears only) | logged median | over the floor |")
    print("| --- | --- | --- | --- |")
    for name, floor, tag in (
        ("generation", decode + prefill, "perf/generate_seconds"),
        ("  of which decoding", decode, None),
        ("update", update, "perf/update_seconds"),
        ("step", decode + prefill + update, "perf/step_seconds"),
    ):
        seen = logged.get(tag) if tag else None
        cells = (f"{seen:.1f} s", f"{seen / floor:.2f}x") if seen else ("", "")
        print(f"| {name} | {floor:.1f} s | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
