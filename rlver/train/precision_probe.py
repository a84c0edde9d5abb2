"""One update on a fixed batch under a precision, against float32: what bf16 does to the step.

The same sampled batch (a GRPO group or several of real replies) goes through the shipped loss
(`rlver.train.ppo_update.actor_loss`) in float32 and under the precision asked for; the two
gradients are compared as a whole and as AdamW's first step would apply them. AdamW moves every
weight by lr x g / (|g| + eps) at its first step: each coordinate by its gradient's sign, the
small ones as far as the large. A GRPO gradient is a difference of the group's per-reply
gradients (the advantages sum to zero), so a coordinate where they nearly cancel is small, and
bf16's rounding of each term (2^-9 of the term, not of the difference) decides its sign: the
gradient's cosine with float32's stays near 1 while the step's falls (docs/performance.md).

Used by tools/bf16_gradient.py and tests/unit/test_bf16_update.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from rlver.core.interfaces import RolloutEngine, SamplingSettings
from rlver.core.trajectory import TokenSequence
from rlver.modeling.batch import RolloutBatch, build_batch
from rlver.modeling.loss_positions import policy_logprobs
from rlver.modeling.precision import float32_head
from rlver.train.ppo_update import PPOSettings, actor_loss

ADAM_EPS = 1e-8  # torch.optim.AdamW's default


def sampled_batch(
    tokenizer: Any,
    engine: RolloutEngine,
    prompts: Sequence[list[dict[str, str]]],
    *,
    replies: int = 4,
    max_new_tokens: int = 24,
    temperature: float = 0.7,
    seed: int = 0,
) -> tuple[RolloutBatch, torch.Tensor]:
    """`replies` sampled replies to each chat in `prompts` (one GRPO group each), and (S, L)
    group-normalised advantages from a fixed draw of rewards in [20, 80)."""
    ids = [
        list(
            tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        for chat in prompts
        for _ in range(replies)
    ]
    generations = engine.generate(ids, SamplingSettings(max_new_tokens, temperature, seed=seed))
    dialogues = []
    for prompt, generation in zip(ids, generations, strict=True):
        sampled = list(generation.token_ids)
        sequence = TokenSequence(
            input_ids=prompt + sampled,
            loss_mask=[0] * len(prompt) + [1] * len(sampled),
            old_logprobs=[0.0] * len(prompt) + list(generation.logprobs),
            turn_spans=[(0, len(prompt), len(prompt) + len(sampled))],
        )
        dialogues.append(SimpleNamespace(sequences=[sequence], profile=None))
    batch = build_batch(dialogues, tokenizer.pad_token_id)
    rewards = torch.rand(len(ids), generator=torch.Generator().manual_seed(seed)) * 60 + 20
    groups = rewards.view(-1, replies)
    normalised = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)
    return batch, normalised.view(-1)[:, None] * batch.loss_mask.float()


@contextlib.contextmanager
def computing_in(model: torch.nn.Module, precision: str, head_in_float32: bool) -> Iterator[None]:
    """Lightning's CPU `precision` ("32-true" or "bf16-mixed": torch.autocast over the forward),
    the head in float32 or as the model's own Linear."""
    if precision not in ("32-true", "bf16-mixed"):
        raise ValueError(f"precision {precision!r}: 32-true or bf16-mixed")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    with autocast, float32_head(model, enabled=head_in_float32):
        yield


def update_gradient(
    model: torch.nn.Module,
    batch: RolloutBatch,
    advantages: torch.Tensor,
    *,
    precision: str = "32-true",
    head_in_float32: bool = True,
    micro_batch_size: int = 4,
    temperature: float = 0.7,
) -> dict[str, torch.Tensor]:
    """The policy gradient of one on-policy GRPO update (token-mean over the batch), per weight."""
    settings = PPOSettings(micro_batch_size=micro_batch_size, entropy_coef=0.0)
    model.zero_grad(set_to_none=True)
    total = float(batch.loss_mask.sum())
    for start in range(0, batch.num_sequences, micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        mask = batch.loss_mask[rows]
        with computing_in(model, precision, head_in_float32):
            loss, _ = actor_loss(
                model, batch.input_ids[rows], batch.attention_mask[rows], mask, None, advantages[rows],
                None, settings, temperature,
            )  # fmt: skip
        (loss * float(mask.sum()) / total).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def compare_gradients(
    grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], only: str | None = None
) -> dict[str, float]:
    """Cosine and relative error |g - g_ref| / |g_ref| of the gradients, and the cosine of the
    AdamW first steps they would take (g / (|g| + eps)); over the weights whose name contains
    `only` (None: all)."""
    names = [name for name in reference if only is None or only in name]
    flat = torch.cat([grads[name].flatten() for name in names]).double()
    ref = torch.cat([reference[name].flatten() for name in names]).double()
    step, ref_step = flat / (flat.abs() + ADAM_EPS), ref / (ref.abs() + ADAM_EPS)
    return {
        "cosine": float(torch.nn.functional.cosine_similarity(flat, ref, dim=0)),
        "relative_error": float((flat - ref).norm() / ref.norm()),
        "adam_step_cosine": float(torch.nn.functional.cosine_similarity(step, ref_step, dim=0)),
    }


def sampled_logprobs(
    model: torch.nn.Module,
    batch: RolloutBatch,
    *,
    precision: str = "32-true",
    head_in_float32: bool = True,
    temperature: float = 0.7,
) -> torch.Tensor:
    """(S, L) float32 log-probs of the batch's tokens as the trainer computes them under `precision`."""
    with torch.no_grad(), computing_in(model, precision, head_in_float32):
        logprobs, _ = policy_logprobs(
            model, batch.input_ids, batch.attention_mask, batch.loss_mask, temperature
        )
    return logprobs.float()


def engine_logprobs(
    model: torch.nn.Module, batch: RolloutBatch, dtype: torch.dtype, temperature: float = 0.7
):
    """The log-probs an engine holding the whole model in `dtype` (vLLM's bf16) reports, without
    the float32 head (an engine's head computes in its own dtype); the model is put back after."""
    original = next(model.parameters()).dtype
    try:
        model.to(dtype)
        return sampled_logprobs(model, batch, head_in_float32=False, temperature=temperature)
    finally:
        model.to(original)
