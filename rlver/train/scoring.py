"""From finished dialogues to the update's inputs: rewards, old log-probs and values, advantages.

The algorithm's steps 3 to 5: each dialogue scored by the reward plugins; the sampled tokens
scored by the policy as it sampled them (eval mode: dropout off), by the frozen reference and
by the critic; advantages estimated on per-dialogue timelines and scattered back to sequences.
Scoring never changes a weight or an optimizer: every forward pass here runs without gradients.
When the update is one optimizer step from the sampling policy (`on_policy_update`), the policy's
own scoring pass is left out: the update's forward gives the same log-probs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlver.core.interfaces import AdvantageBatch
from rlver.core.trajectory import Trajectory
from rlver.modeling.batch import RolloutBatch, build_batch, micro_batches, placeholder_batch
from rlver.modeling.lora import adapter_disabled
from rlver.modeling.loss_positions import policy_logprobs
from rlver.rl.advantages import turn_end_rewards
from rlver.rl.losses import explained_variance, kl_estimate, masked_mean
from rlver.rl.metrics import turn_metrics

RewardFunctions = Sequence[tuple[str, float, Callable[[Sequence[Trajectory]], Any]]]


def score_dialogues(
    reward_functions: RewardFunctions, trajectories: Sequence[Trajectory], metrics: dict[str, float]
) -> torch.Tensor:
    """(D, K) weighted sum of the reward plugins' scores per policy turn, K the most turns a
    dialogue has; a dialogue-level score counts at the dialogue's last turn. Each plugin's mean
    per dialogue goes into `metrics`."""
    width = max((max(t.num_turns, 1) for t in trajectories), default=1)
    total = torch.zeros(len(trajectories), width)
    for name, weight, function in reward_functions:
        scores = _turn_scores(name, function(trajectories), trajectories, width)
        metrics[f"reward/{name}"] = scores.sum(dim=1).mean().item()
        total += weight * scores
    metrics["reward/total"] = total.sum(dim=1).mean().item()
    return total


def _turn_scores(name: str, entries: Any, trajectories: Sequence[Trajectory], width: int) -> torch.Tensor:
    """A reward plugin's answer as (D, K): each entry a float, or one float per policy turn."""
    entries = list(entries)
    if len(entries) != len(trajectories):
        raise ValueError(f"reward {name!r} returned {len(entries)} scores for {len(trajectories)} dialogues")
    scores = torch.zeros(len(trajectories), width)
    for row, (entry, trajectory) in enumerate(zip(entries, trajectories, strict=True)):
        if isinstance(entry, Sequence | torch.Tensor) and not (
            isinstance(entry, torch.Tensor) and entry.dim() == 0
        ):
            values = [float(value) for value in entry]
            if len(values) != trajectory.num_turns:
                raise ValueError(
                    f"reward {name!r} returned {len(values)} per-turn scores for dialogue {row} "
                    f"({trajectory.profile.id}), which has {trajectory.num_turns} policy turns"
                )
            scores[row, : len(values)] = torch.tensor(values)
        else:
            scores[row, max(trajectory.num_turns, 1) - 1] = float(entry)
    if not torch.isfinite(scores).all():
        raise ValueError(f"reward {name!r} returned a score that is not finite: {entries}")
    return scores


@dataclass
class TrainingBatch:
    """A rank's dialogues as tensors; `valid` marks the dialogues the simulator did not fail on."""

    batch: RolloutBatch
    turn_rewards: torch.Tensor  # (D, K) each policy turn's reward (rlver.train.scoring.score_dialogues)
    valid: torch.Tensor  # (D,) bool
    group_ids: torch.Tensor  # (D,)


def training_batch(
    trajectories: Sequence[Trajectory],
    group_ids: torch.Tensor,
    score: Callable[[Sequence[Trajectory], dict[str, float]], torch.Tensor],
    pad_id: int,
    metrics: dict[str, float],
) -> TrainingBatch:
    """The dialogues with turns, scored by `score`, as tensors (a placeholder if there are none).

    A dialogue the simulator failed on stays in the batch but is invalid: out of the loss, of
    GRPO's baselines and of any whitening statistics. A rank left with nothing trains on a
    placeholder, so every rank runs the step's collectives the same way.
    """
    with_turns = [i for i, t in enumerate(trajectories) if t.num_turns > 0]
    kept = [trajectories[i] for i in with_turns]
    if kept:
        valid = torch.tensor([t.termination != "simulator_error" for t in kept], dtype=torch.bool)
        result = TrainingBatch(
            build_batch(kept, pad_id=pad_id), score(kept, metrics), valid, group_ids[with_turns]
        )
    else:
        result = TrainingBatch(
            placeholder_batch(pad_id),
            torch.zeros(1, 1),
            torch.zeros(1, dtype=torch.bool),
            torch.zeros(1, dtype=torch.long),
        )
    batch = result.batch
    batch.loss_mask[~result.valid[batch.sequence_dialogue]] = 0
    trained = batch.sequence_dialogue[batch.loss_mask.sum(dim=1) > 0]
    metrics["rollout/trained_dialogues"] = float(trained.unique().numel())  # summed over ranks
    return result


@contextlib.contextmanager
def eval_mode(*modules: torch.nn.Module | None) -> Iterator[None]:
    """Dropout (a LoRA adapter's, say) off inside, each module's own mode restored after."""
    present = [m for m in modules if m is not None]
    modes = [m.training for m in present]
    for module in present:
        module.eval()
    try:
        yield
    finally:
        for module, mode in zip(present, modes, strict=True):
            module.train(mode)


@torch.no_grad()
def score_tokens(
    batch: RolloutBatch,
    policy_model: torch.nn.Module,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
    value_model: torch.nn.Module | None = None,
    reference: torch.nn.Module | None = None,
    adapter_off_reference: bool = False,
    reduce_max: Callable[[float], float] = lambda value: value,
    with_policy: bool = True,
    head_at_loss_positions: bool = True,
    share_prefix: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(S, L) old log-probs (the policy now), reference log-probs and old values, 0 off the loss mask.

    `with_policy` False leaves the policy's own pass out (old log-probs None): the update is
    on-policy and computes them itself.

    In micro-batches, with dropout off, a micro-batch's common prompt run once (`share_prefix`).
    The reference is `reference`, or with `adapter_off_reference` the policy with its LoRA adapter
    switched off (None: neither).
    Under FSDP every forward is a collective: ranks run as many as the fullest rank
    (`reduce_max`), padding with a repeat of sequence 0 whose outputs are dropped.
    """
    old, ref, values = [], [], []
    with eval_mode(policy_model, value_model):  # the policy that sampled
        rows = list(micro_batches(range(batch.num_sequences), micro_batch_size))
        padding = int(reduce_max(len(rows))) - len(rows)
        for index, micro in enumerate(rows + [[0]] * padding):
            ids, attention, loss = batch.input_ids[micro], batch.attention_mask[micro], batch.loss_mask[micro]
            if index >= len(rows):
                if with_policy or adapter_off_reference:
                    policy_model(input_ids=ids, attention_mask=attention)
                if value_model is not None:
                    value_model(ids, attention)
                continue
            scored = (ids, attention, loss, temperature, False, head_at_loss_positions, share_prefix)
            if with_policy:
                old.append(policy_logprobs(policy_model, *scored)[0])
            if reference is not None:
                ref.append(policy_logprobs(reference, *scored)[0])
            elif adapter_off_reference:
                with adapter_disabled(policy_model):
                    ref.append(policy_logprobs(policy_model, *scored)[0])
            if value_model is not None:
                values.append(value_model(ids, attention))
    mask = batch.loss_mask.float()
    return (
        torch.cat(old) * mask if old else None,
        torch.cat(ref) * mask if ref else None,
        torch.cat(values) * mask if values else None,
    )


def on_policy_update(
    settings: Any, num_sequences: int, policy_model: torch.nn.Module, reduce_max: Callable
) -> bool:
    """Whether the update starts from exactly the policy that sampled and takes one optimizer step.

    Then the old log-probs equal the update's own (detached) and the scoring pass is redundant:
    one epoch, one minibatch on every rank (`reduce_max`: a collective, called only when the
    minibatch size could split the batch), no KL in the reward (it needs them before the
    advantages), and no active dropout (scoring runs in eval mode, the update in train mode).
    """
    if settings.ppo_epochs != 1 or (settings.kl_coef > 0 and settings.kl_mode == "in-reward"):
        return False
    if settings.minibatch_size and settings.minibatch_size < reduce_max(num_sequences):
        return False
    return not has_active_dropout(policy_model)


def has_active_dropout(model: torch.nn.Module) -> bool:
    """Dropout modules with p > 0, or a Hugging Face config's dropout rates above 0."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    rates = ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop", "dropout")
    return any(isinstance(getattr(config, name, 0), float) and getattr(config, name) > 0 for name in rates)


def logprob_metrics(
    policy_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    kl_estimator: str,
    metrics: dict[str, float],
    engine_importance_cap: float = 0.0,
) -> None:
    """How far the engine's log-probs are from the trainer's, from the sampling policy's log-probs
    (scoring's, or the on-policy update's): the largest gap (`rollout/logprob_gap`, a max over
    ranks), the mean gap (`rollout/logprob_gap_mean`) and the k3 estimate of KL(engine ||
    trainer) (`rollout/logprob_k3`); with `engine_importance_cap`, the share of tokens whose
    weight it truncated (`rollout/engine_weight_truncated_fraction`). And the KL to the
    reference (`ppo/kl`)."""
    if not mask.any():
        return
    gap = (policy_logprobs - engine_logprobs).abs() * mask
    metrics["rollout/logprob_gap"] = gap.max().item()
    metrics["rollout/logprob_gap_mean"] = masked_mean(gap, mask).item()
    mismatch = kl_estimate(engine_logprobs, policy_logprobs, "k3", mask)  # samples from the engine
    metrics["rollout/logprob_k3"] = masked_mean(mismatch, mask).item()
    if engine_importance_cap:
        above = (policy_logprobs - engine_logprobs > math.log(engine_importance_cap)) & mask.bool()
        metrics["rollout/engine_weight_truncated_fraction"] = masked_mean(above.to(gap.dtype), mask).item()
    if ref_logprobs is not None:
        kl = kl_estimate(policy_logprobs, ref_logprobs, kl_estimator, mask)
        metrics["ppo/kl"] = masked_mean(kl, mask).item()


def token_advantages(
    estimator: Callable[[AdvantageBatch], Any],
    data: TrainingBatch,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    old_values: torch.Tensor | None,
    settings: Any,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor],
    metrics: dict[str, float],
    max_turns: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(S, L) advantages and returns (None without a critic), estimated on per-dialogue timelines.

    Each turn's reward sits on the turn's last token; with a reference and `settings.kl_mode`
    in-reward, the KL is subtracted from the token rewards (`logprob_metrics` logs it).
    Statistics the estimator takes over dialogues (GRPO's groups, whitening) use `reduce_sum`
    to cover every rank, as do the `turn/` metrics (turn indices 1 to `max_turns`).
    """
    batch = data.batch
    mask = batch.loss_mask
    device = mask.device
    timeline_mask = batch.timeline_mask
    token_rewards = turn_end_rewards(data.turn_rewards.to(device), batch.timeline_turn, timeline_mask)
    if ref_logprobs is not None and settings.kl_mode == "in-reward":
        if old_logprobs is None:
            raise ValueError("a KL in the reward needs the old log-probs before the update")
        kl = kl_estimate(old_logprobs, ref_logprobs, settings.kl_estimator, mask)
        token_rewards = token_rewards - settings.kl_coef * batch.to_timeline(kl)
    result = estimator(
        AdvantageBatch(
            token_rewards=token_rewards,
            values=batch.to_timeline(old_values) if old_values is not None else None,
            mask=timeline_mask,
            group_ids=data.group_ids.to(device),
            valid=data.valid.to(device),
            reduce_sum=reduce_sum,
            turn_ids=batch.timeline_turn,
        )
    )
    advantages = batch.to_sequences(result.advantages) * mask
    returns = batch.to_sequences(result.returns) if result.returns is not None else None
    metrics.update(result.metrics)
    metrics.update(
        turn_metrics(
            data.turn_rewards, result.advantages, batch.timeline_turn, timeline_mask, data.valid.to(device),
            max_turns, reduce_sum,
        )
    )  # fmt: skip
    if mask.any():
        metrics["advantage/mean"] = masked_mean(advantages, mask).item()
        metrics["advantage/abs_mean"] = masked_mean(advantages.abs(), mask).item()
        # The largest is what a floor or a whitening gone wrong shows first (merged as a max).
        metrics["advantage/max_abs"] = (advantages.abs() * mask).max().item()
        if returns is not None and old_values is not None:
            metrics["ppo/explained_variance"] = explained_variance(old_values, returns, mask).item()
    return advantages, returns
