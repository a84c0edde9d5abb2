"""The update without a Trainer: `ppo_update` on a tiny model, one process, plain optimizers."""

from __future__ import annotations

import torch

from rlver.batch import RolloutBatch, token_logprobs
from rlver.ppo_update import Lockstep, PPOSettings, ppo_update
from tests.conftest import small_llama


def _tiny_llama():
    return small_llama()


def _batch(ids: torch.Tensor, mask: torch.Tensor) -> RolloutBatch:
    count, width = ids.shape
    return RolloutBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=mask,
        engine_logprobs=torch.zeros(count, width),
        sequence_dialogue=torch.arange(count),
        timeline_seq=torch.zeros(count, 1, dtype=torch.long),
        timeline_pos=torch.zeros(count, 1, dtype=torch.long),
        timeline_mask=torch.ones(count, 1),
    )


def test_one_update_without_a_trainer_moves_log_probs_with_the_advantages():
    model = _tiny_llama()
    ids = torch.randint(0, 512, (4, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[:, :4] = 0  # the prompt: context, not actions
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
    advantages = sign.expand_as(mask) * mask
    with torch.no_grad():
        before = token_logprobs(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ids) * mask
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    steps = []

    def optimizer_step(optimizer, counts_as_global_step):
        steps.append(counts_as_global_step)
        optimizer.step()

    settings = PPOSettings(minibatch_size=2, micro_batch_size=1, entropy_coef=0.0, grad_clip=1.0)
    metrics = ppo_update(
        _batch(ids, mask),
        before,
        None,
        advantages,
        None,
        None,
        policy_model=model,
        actor_optimizer=optimizer,
        settings=settings,
        step=0,
        lockstep=Lockstep(optimizer_step=optimizer_step),
    )
    with torch.no_grad():
        after = token_logprobs(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ids) * mask
    change = ((after - before) * mask).sum(dim=1) / mask.sum(dim=1)
    assert (change[sign[:, 0] > 0] > 0).all() and (change[sign[:, 0] < 0] < 0).all(), change
    assert steps == [False, True]  # two minibatches; only the iteration's last counts as a global step
    assert metrics["ppo/minibatches"] == 2.0
    assert metrics["ppo/clip_fraction"] == 0.0  # one small step: no ratio leaves the clip range
    assert metrics["ppo/grad_norm"] > 0 and metrics["ppo/actor_lr"] == 1e-3
    assert {"ppo/policy_loss", "ppo/entropy", "ppo/approx_kl"} <= metrics.keys()
    assert "ppo/value_loss" not in metrics  # no critic
