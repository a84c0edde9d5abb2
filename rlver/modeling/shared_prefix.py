"""One forward pass over the prompt that every row of a micro-batch starts with.

A GRPO group's dialogues share their persona's opening: the system prompt and the user's first
message, a third of a quickstart dialogue (61 of 179 tokens on average), more where the system
prompt is long. Scoring and the update ran the model over that prompt once per row. Here the
shared part runs once, as a batch of one, and its keys and values are repeated for every row
before the rows' own tokens run on top of them; autograd sums the rows' gradients through the
repetition, so the result is the same function of the weights as the plain pass (equal within
float rounding: tests/unit/test_ppo_update.py, and under DDP and FSDP: tests/integration/test_distributed.py).

It applies where it is exact and cheap to check: a model whose cache is Hugging Face's plain
`DynamicCache` of full-attention layers (not sliding windows, linear attention or state-space
layers), no gradient checkpointing in a training pass (its layers drop the cache), no FSDP
under autograd (`two_passes_unsafe`), a prefix no needed logit lies in and at least
`MIN_SHARED_TOKENS` long. Anything else runs the plain pass.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

# Below this the second forward call costs more than the tokens it saves.
MIN_SHARED_TOKENS = 32

# Models found to keep another kind of cache: tried once, then always the plain pass.
_unsharable: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def shared_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor, first_needed: int) -> int:
    """How many leading tokens every row has in common (real tokens, not padding), at most
    `first_needed`: positions before it need no logits, so the shared pass computes none."""
    if input_ids.shape[0] < 2:
        return 0
    same = ((input_ids == input_ids[:1]) & attention_mask.bool()).all(dim=0)
    return min(int(same.long().cumprod(0).sum()), first_needed)


def plain_cache(model: torch.nn.Module, cache: object) -> bool:
    """Whether `cache` (the model's, from a forward) is `DynamicCache` of full-attention layers,
    whose rows can be repeated or picked; a model found with another kind is remembered."""
    if isinstance(cache, DynamicCache) and all(type(layer) is DynamicLayer for layer in cache.layers):
        return True
    _unsharable.add(model)
    return False


def sharable(model: torch.nn.Module) -> bool:
    """False once `plain_cache` has found the model's cache of another kind."""
    return model not in _unsharable


def two_passes_unsafe(model: torch.nn.Module) -> bool:
    """Whether the model cannot take the prompt's pass and the rows' pass before one backward:
    checkpointed layers in training drop any cache they are given; FSDP (1 and 2) gathers a
    layer's weights for its backward when the gradient reaches the layer's output, but the rows'
    gradient enters the prompt's pass at its keys and values, inside the layers, where the weights
    are already freed. DDP takes both passes, and without gradients FSDP does too
    (tests/integration/test_distributed.py)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    grads = torch.is_grad_enabled()
    for module in model.modules():
        if model.training and getattr(module, "gradient_checkpointing", False) is True:
            return True
        if grads and isinstance(module, FullyShardedDataParallel | FSDPModule):
            return True
    return False


def causal_lm_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor | None,
    share_prefix: bool = True,
) -> torch.Tensor:
    """The model's logits at `positions` (sorted; None: every position), the rows' common prompt
    run once where that is exact (see the module's docstring)."""
    rows, width = input_ids.shape
    keep = {} if positions is None else {"logits_to_keep": positions}
    first_needed = 0 if positions is None else min(int(positions[0]), width - 1)
    length = shared_prefix_length(input_ids, attention_mask, first_needed) if share_prefix else 0
    if length < MIN_SHARED_TOKENS or not sharable(model) or two_passes_unsafe(model):
        return _whole(model, input_ids, attention_mask, keep)

    nothing = torch.zeros(0, dtype=torch.long, device=input_ids.device)  # no logits from the prompt
    prompt = model(
        input_ids=input_ids[:1, :length], attention_mask=attention_mask[:1, :length],
        use_cache=True, logits_to_keep=nothing,
    )  # fmt: skip
    cache = prompt.past_key_values
    if not plain_cache(model, cache):
        return _whole(model, input_ids, attention_mask, keep)
    cache.batch_repeat_interleave(rows)
    rest = model(
        input_ids=input_ids[:, length:], attention_mask=attention_mask, past_key_values=cache, use_cache=True,
        **({} if positions is None else {"logits_to_keep": positions - length}),
    )  # fmt: skip
    if cache.get_seq_length() != width:  # a layer ignored the cache: its logits lack the prompt
        raise RuntimeError(f"the shared prompt's cache holds {cache.get_seq_length()} of {width} positions")
    return rest.logits


def _whole(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: dict
) -> torch.Tensor:
    """The plain pass. A model that takes `logits_to_keep` is a Hugging Face causal LM: it is told
    to build no cache, which would copy every layer's keys and values for nothing."""
    if not keep:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **keep).logits
