"""The update's cost per trained token: the paths rlver took before against today's, side by side.

"before": a scoring pass over every sequence for the old log-probs, then the training pass, the
language-model head at every position in both, its float32 log-softmax in one pass. "head-only":
one optimizer step from the sampling policy takes the training pass's own log-probs (no scoring
pass), the head runs only at the positions the loss reads, and the float32 maths over the
vocabulary runs 1,024 rows at a time, recomputed in the backward (rlver.modeling.batch.in_vocab_chunks).
"today": that, and the prompt a micro-batch's sequences share (a GRPO group's opening) runs once
(rlver.modeling.shared_prefix). Each runs `score_tokens` + `ppo_update` (GRPO, one epoch, one minibatch,
micro-batches of 4 as the recipes) on the same synthetic batch, each path in its own process so
its peak RSS is its own:

    .venv/bin/python benchmarks/update_cost.py                 # both shapes, every path, a table

Shapes: `quickstart` (the embedded SmolLM2-135M, 2 groups of 4 sequences of 300 tokens whose
first 100 are the group's prompt, a third as in the quickstart's dialogues (61 of 179 tokens on
average), 50 trained tokens each in two replies after it, bf16 autocast where native as
`precision: auto`) and `long` (a scaled paper shape that fits a CPU: 1 tiny layer, Qwen2.5's
152,064-word vocabulary, 2 sequences of 4,096 tokens with 500 trained tokens each, one a
micro-batch, so nothing to share). Printed per shape and path: seconds per update (median of
`--repeats` after one warm-up), microseconds per trained token, the largest logits tensor the
head produced (MB) and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from rlver.modeling.batch import RolloutBatch
from rlver.modeling.precision import resolve_precision
from rlver.train.ppo_update import PPOSettings, ppo_update
from rlver.train.scoring import score_tokens

SHAPES = {
    "quickstart": {"sequences": 8, "length": 300, "trained": 50, "micro": 4, "group": 4, "prompt": 100},
    "long": {"sequences": 2, "length": 4096, "trained": 500, "micro": 1, "group": 1, "prompt": 0},
}
PATHS = ("before", "head-only", "today")


def build_model(shape: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape == "quickstart":
        from rlver.modeling.models import load_policy

        return load_policy("smollm2-135m-instruct").model
    config = LlamaConfig(
        vocab_size=152_064, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=False,
        max_position_embeddings=8192,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def build_batch(shape: str, vocab: int) -> RolloutBatch:
    spec = SHAPES[shape]
    count, length, trained = spec["sequences"], spec["length"], spec["trained"]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (count, length), generator=generator)
    prompt, group = spec["prompt"], spec["group"]
    for row in range(count):  # each group's rows open with its first row's prompt
        ids[row, :prompt] = ids[row - row % group, :prompt]
    mask = torch.zeros_like(ids)
    half = trained // 2
    for row in range(count):  # two replies, at different places in different rows
        first = max(length // 3, prompt) + 7 * row
        mask[row, first : first + half] = 1
        mask[row, length - trained + half - 3 * row : length - 3 * row] = 1
    return RolloutBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=mask,
        engine_logprobs=torch.zeros(count, length),
        sequence_dialogue=torch.arange(count),
        timeline_seq=torch.zeros(count, 1, dtype=torch.long),
        timeline_pos=torch.zeros(count, 1, dtype=torch.long),
        timeline_mask=torch.ones(count, 1),
        timeline_turn=torch.zeros(count, 1, dtype=torch.long),
    )


def run_one(shape: str, path: str, repeats: int) -> dict:
    model = build_model(shape)
    vocab = model.config.vocab_size
    batch = build_batch(shape, vocab)
    before = path == "before"
    if before:  # the vocabulary maths in one float32 pass over every kept position, as it was
        import rlver.modeling.batch
        import rlver.modeling.loss_positions

        def one_pass(fn, logits, *aligned, dim, **options):
            return fn(logits, *aligned, **options)

        rlver.modeling.batch.in_vocab_chunks = rlver.modeling.loss_positions.in_vocab_chunks = one_pass
    settings = PPOSettings(
        micro_batch_size=SHAPES[shape]["micro"], head_at_loss_positions=not before,
        share_prompt_prefix=path == "today",
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    advantages = (
        torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1)) * batch.loss_mask
    )
    largest_logits = [0]

    def measure(module, args, output):
        largest_logits[0] = max(largest_logits[0], output.numel() * output.element_size())

    model.lm_head.register_forward_hook(measure)
    precision, _ = resolve_precision("auto", "cpu")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    seconds = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        with autocast:
            old, _, _ = score_tokens(
                batch, model, micro_batch_size=settings.micro_batch_size, with_policy=before,
                head_at_loss_positions=not before, share_prefix=settings.share_prompt_prefix,
            )  # fmt: skip
            ppo_update(
                batch, old, None, advantages, None, None, policy_model=model, actor_optimizer=optimizer,
                settings=settings, step=0,
                logprobs_out=None if before else torch.zeros(batch.loss_mask.shape),
            )  # fmt: skip
        seconds.append(time.perf_counter() - started)
    median = statistics.median(seconds[1:])
    trained = int(batch.loss_mask.sum())
    return {
        "shape": shape,
        "path": path,
        "precision": precision,
        "seconds": median,
        "us_per_token": median / trained * 1e6,
        "logits_mb": largest_logits[0] / 2**20,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES))
    parser.add_argument("--path", choices=PATHS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.shape and args.path:
        print(json.dumps(run_one(args.shape, args.path, args.repeats)))
        return
    rows = []
    for shape in [args.shape] if args.shape else list(SHAPES):
        for path in PATHS:
            out = subprocess.run(
                [sys.executable, __file__, "--shape", shape, "--path", path, "--repeats", str(args.repeats)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        "| shape | path | precision | s / update | us / trained token | largest logits (MB) | peak RSS (GB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['shape']} | {row['path']} | {row['precision']} | {row['seconds']:.2f} | "
            f"{row['us_per_token']:.0f} | {row['logits_mb']:.0f} | {row['peak_rss_gb']:.1f} |"
        )
    for shape in dict.fromkeys(row["shape"] for row in rows):
        before, head_only, today = (
            next(r for r in rows if r["shape"] == shape and r["path"] == p) for p in PATHS
        )
        print(
            f"{shape}: today {before['seconds'] / today['seconds']:.2f}x faster per trained token than "
            f"before ({head_only['seconds'] / today['seconds']:.2f}x than head-only), "
            f"{before['logits_mb'] / max(today['logits_mb'], 1e-9):.1f}x smaller largest logits"
        )


if __name__ == "__main__":
    main()
