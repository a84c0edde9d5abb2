"""PPO losses and diagnostics as pure functions of (B, T) tensors with a loss mask."""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k3")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate(losses: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Reduce per-token losses to a scalar.

    token-mean: every token weighs the same across the batch.
    seq-mean-token-mean: mean over each sequence's tokens, then over sequences.
    seq-mean-token-sum: sum over each sequence's tokens, then mean over sequences.
    """
    mask = mask.to(losses.dtype)
    if mode == "token-mean":
        return masked_mean(losses, mask)
    per_sequence_tokens = mask.sum(dim=1)
    has_tokens = per_sequence_tokens > 0
    sums = (losses * mask).sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_sequence = sums[has_tokens] / per_sequence_tokens[has_tokens]
    elif mode == "seq-mean-token-sum":
        per_sequence = sums[has_tokens]
    else:
        raise ValueError(f"loss aggregation {mode!r} must be one of {', '.join(AGGREGATIONS)}")
    return per_sequence.mean() if per_sequence.numel() else losses.sum() * 0.0


def loss_weight(mask: torch.Tensor, aggregation: str = "token-mean") -> float:
    """What a micro-batch weighs in a minibatch's loss: its trained tokens (token-mean), else its
    sequences that have any (a sequence with nothing to train is in no seq-mean)."""
    if aggregation == "token-mean":
        return float(mask.sum())
    return float((mask.sum(dim=1) > 0).sum())


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float = 0.2,
    aggregation: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate: -min(ratio * A, clip(ratio, 1-e, 1+e) * A).

    Returns the loss and diagnostics: clip fraction and approx-KL (k3 of old vs new).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    per_token = torch.maximum(unclipped, clipped)
    loss = aggregate(per_token, mask, aggregation)
    with torch.no_grad():
        clip_fraction = masked_mean((clipped > unclipped).to(logprobs.dtype), mask)
        approx_kl = masked_mean(kl_estimate(old_logprobs, logprobs, "k3", mask), mask)
    return loss, {"clip_fraction": clip_fraction, "approx_kl": approx_kl}


def truncated_importance_weights(
    target_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Detached min(pi_target / pi_behaviour, cap) per token, 1 off the mask (truncated
    importance sampling: the sampler's tokens reweighted towards the policy being trained)."""
    with torch.no_grad():
        log_ratio = torch.where(
            mask.bool(), target_logprobs - behaviour_logprobs, torch.zeros_like(target_logprobs)
        )
        return torch.exp(log_ratio.clamp(max=20.0)).clamp(max=cap)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float = 0.5,
    aggregation: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2), as in PPO's critic."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    loss = aggregate(per_token, mask, aggregation)
    with torch.no_grad():
        clip_fraction = masked_mean((clipped_loss > unclipped_loss).to(values.dtype), mask)
    return loss, {"value_clip_fraction": clip_fraction}


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k3",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi.

    k1: log pi - log ref (unbiased, can be negative).
    k3: (ref / pi) - 1 - log(ref / pi) (unbiased, always >= 0, lower variance).
    mask: positions to estimate at; elsewhere the estimate is 0. Needed where one side holds no
        real log-prob there (k3's exp of a large gap is inf, and inf x 0 is NaN).
    """
    log_ratio = logprobs - ref_logprobs
    if mask is not None:
        log_ratio = torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"KL estimator {estimator!r} must be one of {', '.join(KL_ESTIMATORS)}")


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-position entropy of softmax(logits / temperature), the distribution sampled from."""
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def explained_variance(predictions: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(targets - predictions) / Var(targets) over masked positions (nan if targets are constant)."""
    target_mean = masked_mean(targets, mask)
    target_var = masked_mean((targets - target_mean) ** 2, mask)
    residual = targets - predictions
    residual_var = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    return 1.0 - residual_var / target_var if target_var > 0 else torch.tensor(float("nan"))
