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


def plan_minibatches(count: int, most: int, settings: PPOSettings, step: int) -> list[list[int]]:
    """The update's minibatches, as row indices into this rank's `count` sequences.

    Every rank runs the same number of minibatches (`most`: the sequences on the fullest rank,
    so the gradient all-reduces pair up): `ppo_epochs` fresh shuffles seeded by `step`, each cut
    into ceil(most / minibatch_size) minibatches; a rank with fewer sequences has shorter (or
    empty) ones. `minibatch_size` 0: one minibatch of every sequence per epoch.
    """
    size = settings.minibatch_size or most
    slots = -(-most // size) if most else 0  # minibatches per epoch, the same on every rank
    generator = torch.Generator().manual_seed(step)
    minibatches = []
    for _ in range(settings.ppo_epochs):
        order = torch.randperm(count, generator=generator).tolist()
        minibatches.extend(order[start * size : (start + 1) * size] for start in range(slots))
    return minibatches


def plan_micro_batches(
    rows: list[int], micro_batch_size: int, micro_steps: int, sort_key: Callable[[int], Any] | None = None
) -> list[list[int]]:
    """A minibatch's rows cut into `micro_steps` micro-batches of at most `micro_batch_size`; the
    missing ones empty (a rank with fewer rows still joins every backward's collective). With
    `sort_key` the rows are sorted first (sequences sharing a prompt share micro-batches)."""
    if sort_key is not None:
        rows = sorted(rows, key=sort_key)
    micro = list(micro_batches(rows, micro_batch_size))
    return micro + [[] for _ in range(micro_steps - len(micro))]


@dataclass
class UpdateInputs:
    """The step's tensors, (S, L) over its sequences; those a setting leaves out are None."""

    batch: RolloutBatch
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    old_values: torch.Tensor | None
    returns: torch.Tensor | None


class UpdateMetrics:
    """The update's one metric accumulator.

    Per-micro-batch statistics (losses, clip fractions) are weighted by the micro-batch's share
    of the loss, so they are the step's token-mean (sequence-mean) over every rank, not a mean of
    means; per-minibatch values (gradient norms) are averaged over the minibatches.
    """

    def __init__(self, statistics: Sequence[str]) -> None:
        self.weighted = WeightedMeans(statistics)
        self.norms: dict[str, list[float]] = {}

    def add_micro_batch(self, statistics: dict[str, float], weight: float) -> None:
        self.weighted.add(statistics, weight)

    def add_gradient_norm(self, name: str, value: float) -> None:
        self.norms.setdefault(name, []).append(value)

    def result(self, ranks: Lockstep) -> dict[str, float]:
        """The `ppo/` metrics; a collective (the same names on every rank: one all-reduce)."""
        metrics = {name: sum(values) / len(values) for name, values in self.norms.items()}
        metrics.update(
            {f"ppo/{k}": v for k, v in self.weighted.means(ranks.reduce_sum, ranks.device).items()}
        )
        return metrics


def micro_batch_loss(
    inputs: UpdateInputs,
    rows: list[int],
    policy_model: torch.nn.Module,
    value_model: torch.nn.Module | None,
    settings: PPOSettings,
    temperature: float,
    logprobs_out: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The unweighted loss of one micro-batch (the policy's, plus the critic's when it trains) and
    its statistics. `logprobs_out`, if given, receives the rows' detached log-probs."""
    batch = inputs.batch
    ids, attention, mask = batch.input_ids[rows], batch.attention_mask[rows], batch.loss_mask[rows]
    loss, stats = actor_loss(
        policy_model, ids, attention, mask,
        None if inputs.old_logprobs is None else inputs.old_logprobs[rows],
        inputs.advantages[rows],
        None if inputs.ref_logprobs is None else inputs.ref_logprobs[rows],
        settings, temperature,
        keep_logprobs=None if logprobs_out is None else _writer(logprobs_out, rows),
        engine_logprobs=batch.engine_logprobs[rows] if settings.engine_importance_cap else None,
    )  # fmt: skip
    if value_model is not None and inputs.returns is not None and inputs.old_values is not None:
        values = value_model(ids, attention)
        value_loss, value_stats = clipped_value_loss(
            values, inputs.old_values[rows], inputs.returns[rows], mask, settings.value_clip,
            settings.loss_aggregation,
        )  # fmt: skip
        loss = loss + value_loss  # one backward for both networks: one gradient sync per micro-batch
        stats["value_loss"] = value_loss.item()
        stats["value_clip_fraction"] = value_stats["value_clip_fraction"].item()
    return loss, stats


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
    steps and of backward passes, padding with empty micro-batches (`plan_minibatches`,
    `plan_micro_batches`). Each micro-batch's loss is weighted by its share of the tokens (or
    sequences) of the whole step's minibatch, so the synchronised gradient equals that of one
    process holding every rank's dialogues. The minibatch order is a shuffle seeded by `step`,
    fresh each epoch; within a minibatch the sequences are sorted by their tokens, so the ones
    sharing a prompt share micro-batches.

    `old_logprobs` None: the update is one optimizer step from the policy that sampled (see
    `scoring.on_policy_update`), so the old log-probs are the training pass's own, detached: the
    ratio is exactly 1 and its gradient that of the log-probs, with no separate scoring pass.
    `logprobs_out`, if given, receives the policy's detached log-probs as the update computed them
    (0 off the loss mask) for the metrics that scoring would have logged.

    Raises:
        StopRequested: in one process, a stop asked for before the first optimizer step.
    """
    ranks = lockstep or Lockstep()
    inputs = UpdateInputs(batch, old_logprobs, ref_logprobs, advantages, old_values, returns)
    statistics = _ACTOR_STATS + (_CRITIC_STATS if value_model is not None else ())
    if settings.kl_coef > 0 and settings.kl_mode == "in-loss":
        statistics += ("kl_loss",)
    metrics = UpdateMetrics(statistics)

    def loss_size(mask: torch.Tensor) -> float:
        return loss_weight(mask, settings.loss_aggregation)

    most = int(ranks.reduce_max(batch.num_sequences))  # sequences on the fullest rank
    minibatches = plan_minibatches(batch.num_sequences, most, settings, step)
    if old_logprobs is None and len(minibatches) != 1:
        raise ValueError(
            f"old log-probs are needed: {len(minibatches)} optimizer steps (ppo_epochs "
            f"{settings.ppo_epochs}, minibatch_size {settings.minibatch_size}) leave the sampling "
            "policy behind"
        )
    sort_key = (lambda row: batch.input_ids[row].tolist()) if settings.share_prompt_prefix else None
    for number, rows in enumerate(minibatches):
        # The whole step's minibatch size, and the micro-batch count every rank runs.
        local_size = loss_size(batch.loss_mask[rows])
        global_size = max(float(ranks.reduce_sum(torch.tensor(local_size, device=ranks.device))), 1.0)
        micro_steps = int(ranks.reduce_max(-(-len(rows) // settings.micro_batch_size)))
        micro = plan_micro_batches(rows, settings.micro_batch_size, micro_steps, sort_key)
        actor_optimizer.zero_grad()
        if critic_optimizer is not None:
            critic_optimizer.zero_grad()
        for index, rows_here in enumerate(micro):
            if number == 0 and ranks.world == 1 and ranks.stop_requested():
                raise StopRequested("stopped before the first optimizer step")
            empty = not rows_here
            rows_here = rows_here or [0]  # an empty slot runs sequence 0 with weight 0 for the collectives
            local = loss_size(batch.loss_mask[rows_here])
            loss, stats = micro_batch_loss(
                inputs, rows_here, policy_model, value_model, settings, temperature,
                None if empty else logprobs_out,
            )  # fmt: skip
            if not empty and batch.loss_mask[rows_here].any():
                metrics.add_micro_batch(stats, local)
            # DDP averages gradients over ranks; the world factor turns that into a sum.
            weight = 0.0 if empty else local / global_size * ranks.world
            with ranks.gradient_sync(index == len(micro) - 1):
                ranks.backward(loss * weight)
        metrics.add_gradient_norm("ppo/grad_norm", _clip(policy_model, settings))
        ranks.optimizer_step(actor_optimizer, number == len(minibatches) - 1)
        if critic_optimizer is not None and value_model is not None:
            metrics.add_gradient_norm("ppo/critic_grad_norm", _clip(value_model, settings))
            ranks.optimizer_step(critic_optimizer, False)
    if logprobs_out is not None:
        logprobs_out.mul_(batch.loss_mask)
    # The rates this step's updates used, before the schedule moves on to the next step's.
    rates = {"ppo/actor_lr": actor_optimizer.param_groups[0]["lr"]}
    if critic_optimizer is not None:
        rates["ppo/critic_lr"] = critic_optimizer.param_groups[0]["lr"]
    for scheduler in schedulers:
        scheduler.step()
    return {**metrics.result(ranks), **rates, "ppo/minibatches": float(len(minibatches))}


def _clip(module: torch.nn.Module, settings: PPOSettings) -> float:
    """Clip to the global gradient norm (over every shard under FSDP); returns it, pre-clip."""
    return clip_grad_norm(module, settings.grad_clip if settings.grad_clip > 0 else float("inf"))


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
