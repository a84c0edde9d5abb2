"""The RL maths against hand-computed numbers."""

import math

import pytest
import torch

from rlver.rl.advantages import gae, group_normalized, terminal_rewards
from rlver.rl.losses import (
    aggregate,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    explained_variance,
    kl_estimate,
    loss_weight,
)

T = torch.tensor


def test_terminal_reward_sits_on_the_last_policy_token():
    mask = T([[1, 1, 1], [1, 1, 0]])
    assert torch.allclose(terminal_rewards(T([0.7, 0.2]), mask), T([[0, 0, 0.7], [0, 0.2, 0]]))
    with pytest.raises(ValueError, match="at least one policy token"):
        terminal_rewards(T([1.0]), T([[0, 0]]))


def test_gae_gamma_lambda_one_is_return_minus_value():
    advantages, returns = gae(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), T([[1, 1, 1]]))
    assert advantages.tolist()[0] == pytest.approx([0.5, 0.4, 0.3])
    assert returns.tolist()[0] == pytest.approx([1.0, 1.0, 1.0])


def test_gae_by_hand_with_discount_and_padding():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = T([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])  # 9.0 is padding and must not leak
    mask = T([[1, 1, 1], [1, 1, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert advantages[0].tolist() == pytest.approx([0.21712, 0.246, 0.3])
    assert advantages[1].tolist() == pytest.approx([0.592, 0.6, 0.0])
    assert returns[1].tolist() == pytest.approx([0.792, 1.0, 0.0])


def test_grpo_group_baseline_by_hand():
    scores = T([1.0, 2.0, 3.0, 5.0, 5.0, 4.0])
    groups = T([0, 0, 0, 1, 1, 2])
    advantages, degenerate = group_normalized(scores, groups)
    assert advantages.tolist() == pytest.approx([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 0.0, 0.0, 0.0])
    assert degenerate.tolist() == [False, False, False, True, True, True]
    centred, _ = group_normalized(T([0.2, 0.6]), T([3, 3]), scale_by_std=False)
    assert centred.tolist() == pytest.approx([-0.2, 0.2])


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "clipped"),
    [
        (1.5, 1.0, -1.2, 1.0),  # beyond the clip, positive advantage: gain capped
        (1.5, -1.0, 1.5, 0.0),  # negative advantage: the pessimistic unclipped term
        (0.5, 1.0, -0.5, 0.0),
        (0.5, -1.0, 0.8, 1.0),  # below 1 - eps, negative advantage: clipped
        (1.2, 1.0, -1.2, 0.0),  # exactly at the clip: both terms equal, nothing counts as clipped
        (1.0, 2.0, -2.0, 0.0),
    ],
)
def test_clipped_policy_loss_at_and_beyond_the_clip(ratio, advantage, loss, clipped):
    old = T([[-1.0]])
    new = old + math.log(ratio)
    value, stats = clipped_policy_loss(new, old, T([[advantage]]), T([[1]]), clip_ratio=0.2)
    assert value.item() == pytest.approx(loss, abs=1e-6)
    assert stats["clip_fraction"].item() == clipped


def test_policy_loss_ignores_masked_tokens():
    old = T([[-1.0, -1.0]])
    new = T([[-1.0, 5.0]])  # a huge ratio on a user token must not matter
    value, _ = clipped_policy_loss(new, old, T([[1.0, 100.0]]), T([[1, 0]]))
    assert value.item() == pytest.approx(-1.0)


def test_value_loss_clipping_by_hand():
    values = T([[1.0, 0.0, 1.5]])
    old = T([[0.2, 0.2, 0.2]])
    returns = T([[0.0, 1.0, 1.5]])
    loss, stats = clipped_value_loss(values, old, returns, T([[1, 1, 1]]), clip_range=0.5)
    assert loss.item() == pytest.approx((0.5 + 0.5 + 0.32) / 3)
    assert stats["value_clip_fraction"].item() == pytest.approx(1 / 3)


def test_kl_estimators_by_hand():
    logp, ref = T([-1.0, -3.0]), T([-2.0, -3.0])
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([1.0, 0.0])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(-1), 0.0])
    assert (kl_estimate(T([-2.0]), T([-1.0]), "k3") >= 0).all()
    with pytest.raises(ValueError, match="KL estimator 'k2'"):
        kl_estimate(logp, ref, "k2")


def test_aggregation_modes_by_hand():
    losses = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    assert aggregate(losses, mask, "token-mean").item() == pytest.approx(2.5)
    assert aggregate(losses, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    assert aggregate(losses, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="loss aggregation 'mean'"):
        aggregate(losses, mask, "mean")


def test_entropy_and_explained_variance():
    uniform = torch.zeros(1, 1, 4)
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(4))
    targets = T([[1.0, 2.0, 3.0]])
    mask = T([[1, 1, 1]])
    assert explained_variance(targets, targets, mask).item() == pytest.approx(1.0)
    assert explained_variance(T([[2.0, 2.0, 2.0]]), targets, mask).item() == pytest.approx(0.0)


def test_k3_kl_is_zero_where_the_mask_is_off_even_for_huge_gaps():
    """Untrained positions hold no real log-prob (0 on one side): exp of the gap would be inf."""
    logprobs = T([[-2000.0, -0.5]], requires_grad=True)
    ref = T([[0.0, -0.7]])
    mask = T([[0, 1]])
    assert not torch.isfinite(kl_estimate(logprobs, ref, "k3")[0, 0])  # unmasked: inf
    kl = kl_estimate(logprobs, ref, "k3", mask)
    assert kl[0, 0].item() == 0 and kl[0, 1].item() == pytest.approx(math.exp(-0.2) - 1 + 0.2)
    (kl * mask).sum().backward()
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 0].item() == 0


def test_entropy_is_that_of_the_tempered_distribution():
    logits = T([[2.0, 0.0]])
    p = torch.softmax(logits / 0.5, dim=-1)
    expected = float(-(p * p.log()).sum())
    assert entropy_from_logits(logits, temperature=0.5).item() == pytest.approx(expected)
    assert entropy_from_logits(logits).item() != pytest.approx(expected)


def test_loss_weight_counts_tokens_or_sequences_that_have_any():
    mask = T([[1, 1, 0], [0, 0, 0], [0, 1, 0]])
    assert loss_weight(mask, "token-mean") == 3.0
    assert loss_weight(mask, "seq-mean-token-mean") == 2.0  # the empty sequence is in no seq-mean
    assert loss_weight(mask, "seq-mean-token-sum") == 2.0


def test_step_statistics_are_weighted_as_the_loss_weighs_micro_batches():
    from rlver.rl.metrics import WeightedMeans

    rank0, rank1 = WeightedMeans(["policy_loss"]), WeightedMeans(["policy_loss"])
    rank0.add({"policy_loss": 1.0}, weight=1)  # 1 token
    rank0.add({"policy_loss": 2.0}, weight=3)  # 3 tokens
    assert rank0.means() == {"policy_loss": 1.75}  # the token-mean; a mean of means says 1.5
    rank1.add({"policy_loss": 4.0}, weight=4)
    others = torch.tensor([4.0 * 4, 4.0], dtype=torch.float64)
    assert rank0.means(lambda local: local + others) == {"policy_loss": pytest.approx(23 / 8)}
    assert WeightedMeans(["policy_loss"]).means() == {}  # a rank with nothing to learn, alone
    with pytest.raises(KeyError, match="not a declared statistic"):
        rank0.add({"entropy": 1.0}, weight=1)
