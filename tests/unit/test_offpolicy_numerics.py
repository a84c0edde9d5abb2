"""Off-policy numerics that guard themselves: the engine-vs-trainer weight in every schedule, the
mismatch logged beside its maximum, the largest advantage logged (a max over ranks), and a
discounted estimator refused with a reward that is exact only undiscounted (issue 42)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rlver.modeling.batch import token_logprobs
from rlver.rl.losses import truncated_importance_weights
from rlver.train.ppo_update import PPOSettings, ppo_update
from rlver.train.run_log import merge_rank_metrics
from rlver.train.scoring import logprob_metrics
from tests.conftest import small_llama
from tests.unit.test_ppo_update import _batch


def _one_sgd_step(model, batch, old_logprobs, advantages, settings):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ppo_update(
        batch, old_logprobs, None, advantages, None, None,
        policy_model=model, actor_optimizer=optimizer, settings=settings, step=0,
    )  # fmt: skip
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("on_policy", [True, False])
def test_the_engine_weight_scales_each_tokens_advantage_by_min_of_the_ratio_and_the_cap(on_policy):
    """One SGD step with the cap equals one without it on advantages pre-multiplied by
    min(pi_trainer / pi_engine, cap): in the on-policy schedule (the update's own log-probs) and
    with scored old log-probs (several epochs or minibatches)."""
    model = small_llama()
    ids = torch.randint(0, 512, (3, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[:, :3] = 0
    with torch.no_grad():
        trainer = token_logprobs(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ids) * mask
    # the engine's log-probs: some tokens far below the trainer's (weights above the cap of 2),
    # some above (weights below 1)
    offsets = torch.linspace(-1.5, 1.0, ids.numel()).reshape(ids.shape)
    batch = _batch(ids, mask)
    batch.engine_logprobs = (trainer + offsets) * mask
    advantages = torch.tensor([1.0, -0.5, 0.8])[:, None].expand_as(mask) * mask
    old = None if on_policy else trainer
    weighted = _one_sgd_step(
        copy.deepcopy(model), batch, old, advantages, PPOSettings(entropy_coef=0.0, engine_importance_cap=2.0)
    )
    expected_weights = torch.exp(-offsets).clamp(max=2.0)
    assert truncated_importance_weights(trainer, batch.engine_logprobs, mask, 2.0)[mask.bool()].tolist() == (
        pytest.approx(expected_weights[mask.bool()].tolist(), rel=1e-5)
    )
    off = PPOSettings(entropy_coef=0.0, engine_importance_cap=0.0)
    by_hand = _one_sgd_step(copy.deepcopy(model), batch, old, advantages * expected_weights, off)
    unweighted = _one_sgd_step(copy.deepcopy(model), batch, old, advantages, off)
    torch.testing.assert_close(weighted, by_hand, rtol=1e-4, atol=1e-6)
    assert (weighted - unweighted).abs().max() > 1e-4  # the cap is not a no-op here


def test_the_engine_weight_is_on_by_default_and_checked():
    # On by default (issue 53): a bf16 engine's samples are corrected towards the trainer's policy.
    assert PPOSettings().engine_importance_cap == 2.0
    assert PPOSettings(engine_importance_cap=0.0).engine_importance_cap == 0.0
    with pytest.raises(
        ValueError, match=r"--model.ppo.engine_importance_cap \(0.5\) must be 0 \(off\) or >= 1"
    ):
        PPOSettings(engine_importance_cap=0.5)


def test_the_overlapped_schedule_takes_the_engine_weight_as_zero():
    from rlver.train.components import overlap_settings

    settings, ppo = overlap_settings({"max_staleness": 1}, PPOSettings())
    assert settings.max_staleness == 1
    assert ppo.engine_importance_cap == 0.0  # its own weight covers the engine: not twice
    settings, ppo = overlap_settings(None, PPOSettings())
    assert settings is None and ppo.engine_importance_cap == 2.0


def test_the_mismatch_is_logged_as_max_mean_and_k3():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    engine = torch.tensor([[-1.2, -1.5, -0.5, 9.0]])  # the last position is padding
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    metrics = {}
    logprob_metrics(trainer, engine, None, mask, "k3", metrics, engine_importance_cap=1.1)
    gaps = [0.2, 0.5, 0.0]
    assert metrics["rollout/logprob_gap"] == pytest.approx(0.5)
    assert metrics["rollout/logprob_gap_mean"] == pytest.approx(sum(gaps) / 3)
    # KL(engine || trainer) from the engine's samples: r - 1 - log r, r = pi_trainer / pi_engine
    ratios = [math.exp(-1.0 + 1.2), math.exp(-2.0 + 1.5), 1.0]
    assert metrics["rollout/logprob_k3"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 3)
    assert metrics["rollout/engine_weight_truncated_fraction"] == pytest.approx(1 / 3)  # exp(0.2) > 1.1
    quiet = {}
    logprob_metrics(trainer, engine, None, mask, "k3", quiet)
    assert "rollout/engine_weight_truncated_fraction" not in quiet


def test_maxima_are_merged_over_ranks_as_the_largest():
    merged = merge_rank_metrics(
        [
            {"advantage/max_abs": 1.5, "rollout/logprob_gap": 0.1, "advantage/abs_mean": 0.2},
            {"advantage/max_abs": 40.0, "rollout/logprob_gap": 0.5, "advantage/abs_mean": 0.4},
        ]
    )
    assert merged["advantage/max_abs"] == 40.0 and merged["rollout/logprob_gap"] == 0.5
    assert merged["advantage/abs_mean"] == pytest.approx(0.3)


def test_token_advantages_logs_the_largest_advantage():
    from rlver.core.interfaces import AdvantageResult
    from rlver.train.scoring import token_advantages

    batch = _batch(torch.ones(2, 3, dtype=torch.long), torch.tensor([[0, 1, 1], [0, 1, 0]]))
    # dialogue i's one timeline position is token 1 of sequence i
    batch.timeline_seq, batch.timeline_pos = torch.arange(2)[:, None], torch.ones(2, 1, dtype=torch.long)
    data = type("Data", (), {})()
    data.batch, data.turn_rewards = batch, torch.tensor([[1.0], [0.0]])
    data.group_ids, data.valid = torch.tensor([0, 0]), torch.tensor([True, True])
    per_timeline = torch.tensor([[-7.0], [3.0]])  # one timeline position per sequence
    settings = PPOSettings()
    metrics = {}
    token_advantages(
        lambda _: AdvantageResult(advantages=per_timeline), data, None, None, None, settings,
        lambda x: x, metrics,
    )  # fmt: skip
    assert metrics["advantage/max_abs"] == 7.0


@pytest.mark.parametrize(
    ("advantage", "refused"),
    [
        ({"name": "gae", "gamma": 0.99}, True),
        ({"name": "turn_gae", "gamma": 0.9}, True),
        ({"name": "gae", "gamma": 1.0}, False),
        ({"name": "turn_credit"}, False),
    ],
)
def test_emotion_change_is_refused_with_a_discount(advantage, refused):
    from rlver.train.module import RLVERModule

    def build():
        return RLVERModule(
            advantage=advantage,
            rewards=["emotion_change"],
            critic=None if advantage["name"] == "turn_credit" else "tiny",
            group_size=4 if advantage["name"] == "turn_credit" else 1,
            simulator={"name": "embedded", "judge": "rubric"},
        )

    if refused:
        with pytest.raises(
            ValueError, match=r"emotion_change is potential-based only at gamma = 1.*gamma 0\.9"
        ):
            build()
    else:
        build()
    # final_emotion is one reward at the end: any discount is a plain discount
    RLVERModule(
        advantage={"name": "gae", "gamma": 0.9}, rewards=["final_emotion"], critic="tiny",
        simulator={"name": "embedded", "judge": "rubric"},
    )  # fmt: skip
