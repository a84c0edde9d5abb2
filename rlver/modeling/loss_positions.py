"""The policy's log-probs with the language-model head evaluated only where the loss reads them.

A causal LM's head turns every position's hidden state into a vocabulary-sized row of logits,
but the loss reads only the rows that predict a policy-sampled token: about 50 of 300 positions
in a quickstart dialogue, about 1,000 of 8,192 in a paper one, where a full (L, 152k) row block
in float32 is 5 GB per sequence before its temporaries. Hugging Face causal LMs take
`logits_to_keep`, the sequence positions whose logits to compute; passing it keeps the call
inside the model's own forward, so FSDP's hooks and peft's wrappers run as always.
This module computes numbers only; it never steps an optimizer or touches a batch's rows.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from rlver.modeling.batch import in_vocab_chunks, target_logprobs, tempered
from rlver.modeling.shared_prefix import causal_lm_logits


def loss_positions(mask: torch.Tensor) -> torch.Tensor:
    """Sorted positions t - 1 whose next token t is in the loss of any row (never empty).

    With no token in the loss (a placeholder batch) the last position stands in, so the head
    stays in the graph and every rank's backward reaches the same parameters.
    """
    positions = mask[:, 1:].any(dim=0).nonzero().squeeze(1)
    if positions.numel() == 0:
        positions = torch.tensor([mask.shape[1] - 2], device=mask.device)
    return positions


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model under its wrappers (FSDP1, DDP, peft) has a `logits_to_keep` argument."""
    inner: Any = model
    for _ in range(8):
        if hasattr(inner, "get_base_model"):  # peft
            inner = inner.get_base_model()
        elif isinstance(getattr(inner, "module", None), torch.nn.Module):  # FSDP1, DDP
            inner = inner.module
        else:
            break
    try:
        return "logits_to_keep" in inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return False


def policy_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    head_at_loss_positions: bool = True,
    share_prefix: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(S, L) log-probs of each token given the ones before (exact where `mask` is 1; 0 at
    positions no row's loss reads), and with `with_entropy` the mean entropy over the loss's
    tokens (None otherwise). Uses logits / temperature, as the engines report.

    `head_at_loss_positions` False (or a model without `logits_to_keep`): every position's logits.
    `share_prefix`: the rows' common prompt runs once (`rlver.modeling.shared_prefix`), where that is exact.
    """
    rows, width = input_ids.shape
    if not head_at_loss_positions or not accepts_logits_to_keep(model):
        positions = torch.arange(width - 1, device=input_ids.device)
        logits = causal_lm_logits(model, input_ids, attention_mask, None)[:, :-1]
    else:
        positions = loss_positions(mask)
        logits = causal_lm_logits(model, input_ids, attention_mask, positions, share_prefix)
    targets = input_ids[:, positions + 1]
    if with_entropy:  # both from one pass over each chunk: one gradient of the logits, not two
        both = in_vocab_chunks(_logprobs_and_entropy, logits, targets, dim=1, temperature=temperature)
        picked, entropy = both.unbind(-1)
    else:
        picked, entropy = target_logprobs(logits, targets, temperature), None
    logprobs = torch.zeros(rows, width, dtype=picked.dtype, device=picked.device)
    logprobs = logprobs.index_copy(1, positions + 1, picked)
    if entropy is None:
        return logprobs, None
    acting = mask[:, positions + 1].bool()  # entropy only where the policy acted
    return logprobs, entropy[acting].mean() if acting.any() else logits.sum() * 0


def _logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """(S, K, 2): the targets' log-probs and each position's entropy under softmax(logits / temperature)."""
    log_probs = torch.log_softmax(tempered(logits, temperature), dim=-1)
    picked = log_probs.gather(2, targets[..., None]).squeeze(2)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return torch.stack((picked, entropy), dim=-1)
