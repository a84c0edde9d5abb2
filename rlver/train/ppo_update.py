"""The PPO / GRPO update: epochs over shuffled minibatches, every rank in lockstep.

`ppo_update` takes the step's tensors, the networks and their optimizers, and returns the
`ppo/` metrics; it needs no Trainer. How it reaches the other ranks and the trainer (sums and
maxima over ranks, backward, the optimizer step that counts as a global step, DDP's gradient
sync) comes in a `Lockstep`, whose defaults are one process without a trainer. The update never
talks to the engine, the simulator or the logger: it only changes the networks and returns numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlver.core.interfaces import StopRequested
from rlver.modeling.batch import RolloutBatch, micro_batches
from rlver.modeling.loss_positions import policy_logprobs
from rlver.parallel.grad_clip import clip_grad_norm
from rlver.rl.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    clipped_policy_loss,
    clipped_value_loss,
    kl_estimate,
    loss_weight,
    masked_mean,
    truncated_importance_weights,
)
from rlver.rl.metrics import WeightedMeans
from rlver.train.ranks import Lockstep


@dataclass(frozen=True)
class PPOSettings:
    """The update: PPO epochs, minibatches, clipping, entropy and KL.

    Args:
        ppo_epochs: Passes over one iteration's rollouts.
        minibatch_size: Sequences per optimizer step (0: all of them, one step per epoch).
        micro_batch_size: Sequences per forward/backward (gradient accumulation within a minibatch).
        clip_ratio: PPO policy ratio clip epsilon.
        value_clip: Critic value clip range.
        entropy_coef: Entropy bonus weight (negative: a penalty on the entropy, for a sharper policy).
        loss_aggregation: token-mean, seq-mean-token-mean or seq-mean-token-sum.
        grad_clip: Max gradient norm (0: no clipping).
        kl_coef: Weight of the KL to the frozen reference policy (0: no reference model).
        kl_estimator: k1 or k3.
        kl_mode: in-loss (a loss term) or in-reward (subtracted from token rewards).
        head_at_loss_positions: Evaluate the language-model head only at the positions the loss
            reads (False: at every position, as rlver did before; kept for comparison).
        share_prompt_prefix: Run the prompt that a micro-batch's sequences share (a GRPO group's
            opening) once, not once per sequence (rlver.modeling.shared_prefix; False: as before).
        engine_importance_cap: Multiply each token's advantage by min(pi_trainer / pi_engine,
            cap), pi_trainer the trainer's log-prob of the sampled token before the update and
            pi_engine the engine's (truncated importance sampling: the engine's kernels and dtype,
            vLLM's bf16 on GPUs, sample from a distribution a little off the one the update
            assumes, and without the weight the update follows the engine's rounding; docs/
            performance.md, "bf16 and what the update learns"). 2 by default, on for every
            recipe: where engine and trainer agree (float32 on both) every weight is 1 within
            rounding and nothing changes. 0: off. `rollout/logprob_gap_mean`, `rollout/logprob_k3`
            and `rollout/engine_weight_truncated_fraction` show how far they are apart. The
            overlapped mode corrects with its own weight (`--model.overlap.max_importance_weight`)
            and takes this one as 0.
    """

    ppo_epochs: int = 1
    minibatch_size: int = 0
    micro_batch_size: int = 4
    clip_ratio: float = 0.2
    value_clip: float = 0.5
    entropy_coef: float = 0.001
    loss_aggregation: str = "token-mean"
    grad_clip: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_mode: str = "in-loss"
    head_at_loss_positions: bool = True
    share_prompt_prefix: bool = True
    engine_importance_cap: float = 2.0

    def __post_init__(self) -> None:
        checks = [
            (
                self.engine_importance_cap == 0 or self.engine_importance_cap >= 1,
                f"--model.ppo.engine_importance_cap ({self.engine_importance_cap}) must be 0 (off) or >= 1",
            ),
            (self.ppo_epochs >= 1, f"--model.ppo.ppo_epochs ({self.ppo_epochs}) must be >= 1"),
            (self.minibatch_size >= 0, f"--model.ppo.minibatch_size ({self.minibatch_size}) must be >= 0"),
            (
                self.micro_batch_size >= 1,
                f"--model.ppo.micro_batch_size ({self.micro_batch_size}) must be >= 1",
            ),
            (self.clip_ratio > 0, f"--model.ppo.clip_ratio ({self.clip_ratio}) must be > 0"),
            (self.value_clip > 0, f"--model.ppo.value_clip ({self.value_clip}) must be > 0"),
            (self.kl_coef >= 0, f"--model.ppo.kl_coef ({self.kl_coef}) must be >= 0"),
            (self.grad_clip >= 0, f"--model.ppo.grad_clip ({self.grad_clip}) must be >= 0"),
            (
                self.loss_aggregation in AGGREGATIONS,
                f"--model.ppo.loss_aggregation ({self.loss_aggregation!r}) "
                f"must be one of {', '.join(AGGREGATIONS)}",
            ),
            (
                self.kl_estimator in KL_ESTIMATORS,
                f"--model.ppo.kl_estimator ({self.kl_estimator!r}) must be one of {', '.join(KL_ESTIMATORS)}",
            ),
            (
                self.kl_mode in ("in-loss", "in-reward"),
                f"--model.ppo.kl_mode ({self.kl_mode!r}) must be in-loss or in-reward",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def ppo_update(
    batch: RolloutBatch,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    old_values: torch.Tensor | None,
    returns: torch.Tensor | None,
    *,
    policy_model: torch.nn.Module,
    actor_optimizer: Any,
    settings: PPOSettings,
    step: int,
    value_model: torch.nn.Module | None = None,
    critic_optimizer: Any = None,
    schedulers: Sequence[Any] = (),
    temperature: float = 1.0,
    lockstep: Lockstep | None = None,
    logprobs_out: torch.Tensor | None = None,
) -> dict[str, float]:
    """PPO epochs over minibatches, every rank in lockstep; returns the `ppo/` metrics.

    Tensors are (S, L) over the batch's sequences (`ref_logprobs`, `old_values` and `returns`
    may be None). Ranks hold different numbers of sequences (dialogues end at different turns),
    but gradient all-reduces are collectives: every rank runs the same number of optimizer
    steps and of backward passes, padding with empty micro-batches. Each micro-batch's loss is
    weighted by its share of the tokens (or sequences) of the whole step's minibatch, so the
    synchronised gradient equals that of one process holding every rank's dialogues. The
    minibatch order is a shuffle seeded by `step`, fresh each epoch; within a minibatch the
    sequences are sorted by their tokens, so the ones sharing a prompt share micro-batches.

    `old_logprobs` None: the update is one optimizer step from the policy that sampled (see
    `scoring.on_policy_update`), so the old log-probs are the training pass's own, detached: the
    ratio is exactly 1 and its gradient that of the log-probs, with no separate scoring pass.
    `logprobs_out`, if given, receives the policy's detached log-probs as the update computed them
    (0 off the loss mask) for the metrics that scoring would have logged.

    Raises:
        StopRequested: in one process, a stop asked for before the first optimizer step.
    """
    ranks = lockstep or Lockstep()
    world = ranks.world
    # Per-minibatch values (gradient norms) are averaged over minibatches; per-micro-batch
    # values (losses, clip fractions) are weighted by the micro-batch's share of the loss, so
    # they are the step's token-mean (sequence-mean) over every rank, not a mean of means.
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    names = _ACTOR_STATS + (_CRITIC_STATS if value_model is not None else ())
    if settings.kl_coef > 0 and settings.kl_mode == "in-loss":
        names += ("kl_loss",)
    weighted = WeightedMeans(names)

    def record(name: str, value: float) -> None:
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1

    def clip(module: torch.nn.Module) -> float:
        """Clip to the global gradient norm (over every shard under FSDP); returns it, pre-clip."""
        return clip_grad_norm(module, settings.grad_clip if settings.grad_clip > 0 else float("inf"))

    def loss_size(mask: torch.Tensor) -> float:
        return loss_weight(mask, settings.loss_aggregation)

    count = batch.num_sequences
    most = int(ranks.reduce_max(count))  # sequences on the fullest rank
    minibatch = settings.minibatch_size or most
    slots = -(-most // minibatch)  # minibatches per epoch, the same on every rank
    generator = torch.Generator().manual_seed(step)
    minibatches = []
    for _ in range(settings.ppo_epochs):  # a fresh shuffle per epoch, cut into minibatches
        order = torch.randperm(count, generator=generator).tolist()
        minibatches.extend(order[start * minibatch : (start + 1) * minibatch] for start in range(slots))
    if old_logprobs is None and len(minibatches) != 1:
        raise ValueError(
            f"old log-probs are needed: {len(minibatches)} optimizer steps (ppo_epochs "
            f"{settings.ppo_epochs}, minibatch_size {settings.minibatch_size}) leave the sampling "
            "policy behind"
        )

    for number, rows in enumerate(minibatches):
        last = number == len(minibatches) - 1
        local_size = loss_size(batch.loss_mask[rows])
        # The whole step's minibatch size, and the micro-batch count every rank runs.
        global_size = max(float(ranks.reduce_sum(torch.tensor(local_size, device=ranks.device))), 1.0)
        micro_steps = int(ranks.reduce_max(-(-len(rows) // settings.micro_batch_size)))
        actor_optimizer.zero_grad()
        if critic_optimizer is not None:
            critic_optimizer.zero_grad()
        if settings.share_prompt_prefix:  # sequences with a common prompt side by side
            rows = sorted(rows, key=lambda row: batch.input_ids[row].tolist())
        micro = list(micro_batches(rows, settings.micro_batch_size))
        micro += [[]] * (micro_steps - len(micro))
        for index, rows_here in enumerate(micro):
            if number == 0 and world == 1 and ranks.stop_requested():
                raise StopRequested("stopped before the first optimizer step")
            empty = not rows_here
            rows_here = rows_here or [0]  # an empty slot runs sequence 0 with weight 0 for the collectives
            ids, attention, mask = (
                batch.input_ids[rows_here],
                batch.attention_mask[rows_here],
                batch.loss_mask[rows_here],
            )
            local = loss_size(mask)
            # DDP averages gradients over ranks; the world factor turns that into a sum.
            weight = 0.0 if empty else local / global_size * world
            loss, stats = actor_loss(
                policy_model,
                ids,
                attention,
                mask,
                None if old_logprobs is None else old_logprobs[rows_here],
                advantages[rows_here],
                None if ref_logprobs is None else ref_logprobs[rows_here],
                settings,
                temperature,
                keep_logprobs=None if logprobs_out is None or empty else _writer(logprobs_out, rows_here),
                engine_logprobs=batch.engine_logprobs[rows_here] if settings.engine_importance_cap else None,
            )
            loss = loss * weight
            if value_model is not None and returns is not None and old_values is not None:
                values = value_model(ids, attention)
                value_loss, value_stats = clipped_value_loss(
                    values,
                    old_values[rows_here],
                    returns[rows_here],
                    mask,
                    settings.value_clip,
                    settings.loss_aggregation,
                )
                # One backward for both networks: one gradient synchronisation per micro-batch.
                loss = loss + value_loss * weight
                stats["value_loss"] = value_loss.item()
                stats["value_clip_fraction"] = value_stats["value_clip_fraction"].item()
            if not empty and mask.any():
                weighted.add(stats, local)
            with ranks.gradient_sync(index == len(micro) - 1):
                ranks.backward(loss)
        record("ppo/grad_norm", clip(policy_model))
        ranks.optimizer_step(actor_optimizer, last)
        if critic_optimizer is not None and value_model is not None:
            record("ppo/critic_grad_norm", clip(value_model))
            ranks.optimizer_step(critic_optimizer, False)
    if logprobs_out is not None:
        logprobs_out.mul_(batch.loss_mask)
    # The rates this step's updates used, before the schedule moves on to the next step's.
    rates = {"ppo/actor_lr": actor_optimizer.param_groups[0]["lr"]}
    if critic_optimizer is not None:
        rates["ppo/critic_lr"] = critic_optimizer.param_groups[0]["lr"]
    for scheduler in schedulers:
        scheduler.step()
    metrics = {name: sums[name] / counts[name] for name in sums}
    # The same names on every rank (a rank with nothing to learn adds zeros): one all-reduce.
    metrics.update({f"ppo/{k}": v for k, v in weighted.means(ranks.reduce_sum, ranks.device).items()})
    metrics.update(rates)
    metrics["ppo/minibatches"] = float(len(minibatches))
    return metrics


def _writer(out: torch.Tensor, rows: list[int]) -> Callable[[torch.Tensor], None]:
    def write(values: torch.Tensor) -> None:
        out[rows] = values.to(out.dtype)

    return write


_ACTOR_STATS = ("policy_loss", "entropy", "clip_fraction", "approx_kl")
_CRITIC_STATS = ("value_loss", "value_clip_fraction")


def actor_loss(
    policy_model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    settings: PPOSettings,
    temperature: float = 1.0,
    keep_logprobs: Callable[[torch.Tensor], None] | None = None,
    engine_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy's loss on one micro-batch: clipped surrogate - entropy bonus (+ KL in the loss).

    `old_logprobs` None: on-policy, the log-probs computed here, detached (ratio exactly 1).
    `keep_logprobs` is called with the detached log-probs. `engine_logprobs` given (with
    `settings.engine_importance_cap`): each advantage times min(pi_old / pi_engine, cap).
    """
    logprobs, entropy = policy_logprobs(
        policy_model, input_ids, attention_mask, mask, temperature, with_entropy=True,
        head_at_loss_positions=settings.head_at_loss_positions, share_prefix=settings.share_prompt_prefix,
    )  # fmt: skip
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    if keep_logprobs is not None:
        keep_logprobs(logprobs.detach())
    if engine_logprobs is not None and settings.engine_importance_cap:
        # The weight is positive and detached: scaling the advantage scales the surrogate.
        advantages = advantages * truncated_importance_weights(
            old_logprobs, engine_logprobs, mask, settings.engine_importance_cap
        )
    policy_loss, stats = clipped_policy_loss(
        logprobs, old_logprobs, advantages, mask, settings.clip_ratio, settings.loss_aggregation
    )
    loss = policy_loss - settings.entropy_coef * entropy
    metrics = {
        "policy_loss": policy_loss.item(),
        "entropy": entropy.item(),
        "clip_fraction": stats["clip_fraction"].item(),
        "approx_kl": stats["approx_kl"].item(),
    }
    if ref_logprobs is not None and settings.kl_mode == "in-loss":
        kl = masked_mean(kl_estimate(logprobs, ref_logprobs, settings.kl_estimator, mask), mask)
        loss = loss + settings.kl_coef * kl
        metrics["kl_loss"] = kl.item()
    return loss, metrics
