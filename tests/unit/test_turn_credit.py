"""Turn-level credit: per-turn rewards from the user to the tokens, and the estimators that use
them, with hand-computed numbers and an exact check of the critic-free baseline's unbiasedness."""

from __future__ import annotations

import itertools

import pytest
import torch
from rlver_plugins.advantages import GAEEstimator, TurnCreditEstimator, TurnGAEEstimator
from rlver_plugins.rewards import EmotionChangeReward, FinalEmotionReward

from rlver.core.interfaces import AdvantageBatch, ParsedReply
from rlver.core.types import Profile, UserTurn
from rlver.modeling.batch import build_batch
from rlver.rl.advantages import turn_end_rewards
from rlver.rl.metrics import turn_metrics
from rlver.rollout.runner import PolicyTurn, Trajectory
from rlver.train.scoring import score_dialogues

PROFILE = Profile("p", "player", "scene", "passive", ("a",), "You want deep empathy.")
T = torch.tensor


def close(tensor, expected):
    torch.testing.assert_close(tensor, torch.tensor(expected, dtype=tensor.dtype), rtol=0, atol=1e-6)


def dialogue(emotions, reply_tokens=None, termination="max_turns"):
    """A dialogue whose user reported `emotions` (opening first); reply t has reply_tokens[t] tokens."""
    turns = len(emotions) - 1
    reply_tokens = reply_tokens or [2] * turns
    t = Trajectory(PROFILE, 0, "system", termination=termination)
    t.user_turns = [UserTurn("u", e) for e in emotions]
    prompt = [1]
    for count in reply_tokens:
        response = list(range(10, 10 + count))
        t.policy_turns.append(
            PolicyTurn(list(prompt), response, [-0.1] * count, "stop", "r", ParsedReply("r"))
        )
        prompt = prompt + response + [5]  # the user's answer joins the history
    return t


# --------------------------------------------------------------------------- rewards to tokens
def test_each_turns_reward_sits_on_its_last_token():
    batch = build_batch([dialogue([40, 45, 40], [2, 3]), dialogue([40, 50], [1])], pad_id=0)
    assert batch.timeline_turn.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]]
    rewards = turn_end_rewards(T([[0.05, -0.05], [0.1, 0.0]]), batch.timeline_turn, batch.timeline_mask)
    close(rewards, [[0, 0.05, 0, 0, -0.05], [0.1, 0, 0, 0, 0]])


def test_a_turn_without_tokens_hands_its_reward_back_without_losing_it():
    mask, turn_ids = T([[1, 1, 1]]), T([[0, 0, 2]])  # turn 1 has no tokens
    rewards = turn_end_rewards(T([[0.1, 0.2, 0.3]]), turn_ids, mask)
    close(rewards, [[0, 0.3, 0.3]])  # turn 1's 0.2 on turn 0's last token


def test_emotion_change_pays_each_turn_what_it_moved_and_sums_to_the_final_emotion():
    trajectories = [
        dialogue([40, 50, 45, 100]),  # success: the last change as the simulator applied it
        dialogue([30, 10, -5]),  # failure below 0: the potential floors at 0, as final_emotion
        dialogue([40, 48]),
    ]
    trajectories[2].policy_turns.append(trajectories[2].policy_turns[0])  # a reply the user never answered
    changes = EmotionChangeReward()(trajectories)
    assert changes == [
        pytest.approx([0.1, -0.05, 0.55]),
        pytest.approx([-0.2, -0.1]),
        pytest.approx([0.08, 0.0]),
    ]
    finals = FinalEmotionReward()(trajectories)
    for change, final, trajectory in zip(changes, finals, trajectories, strict=True):
        assert sum(change) == pytest.approx(final - max(trajectory.start_emotion / 100, 0))


def test_dialogue_and_turn_rewards_mix_and_a_wrong_length_names_the_plugin():
    trajectories = [dialogue([40, 50, 45]), dialogue([40, 60])]
    functions = [("final_emotion", 1.0, FinalEmotionReward()), ("emotion_change", 0.5, EmotionChangeReward())]
    metrics = {}
    table = score_dialogues(functions, trajectories, metrics)
    close(table, [[0.05, 0.45 - 0.025], [0.6 + 0.1, 0.0]])
    assert metrics["reward/total"] == pytest.approx((0.475 + 0.7) / 2)
    assert metrics["reward/emotion_change"] == pytest.approx((0.05 + 0.2) / 2)
    with pytest.raises(
        ValueError, match=r"reward 'bad' returned 1 per-turn scores for dialogue 0 \(p\), which has 2"
    ):
        score_dialogues([("bad", 1.0, lambda ts: [[0.1] for _ in ts])], trajectories, {})


# --------------------------------------------------------------------------- the estimators
def timeline(turn_rewards, turn_lengths):
    """(mask, turn_ids, token_rewards) for dialogues given per-turn rewards and turn lengths."""
    width = max(sum(lengths) for lengths in turn_lengths)
    mask = torch.zeros(len(turn_lengths), width, dtype=torch.long)
    turn_ids = torch.zeros_like(mask)
    table = torch.zeros(len(turn_rewards), max(map(len, turn_rewards)))
    for row, (rewards, lengths) in enumerate(zip(turn_rewards, turn_lengths, strict=True)):
        ids = [turn for turn, length in enumerate(lengths) for _ in range(length)]
        mask[row, : len(ids)] = 1
        turn_ids[row, : len(ids)] = T(ids)
        table[row, : len(rewards)] = T(rewards)
    return mask, turn_ids, turn_end_rewards(table, turn_ids, mask)


def test_token_gae_carries_rewards_from_inside_the_timeline():
    mask, turn_ids, rewards = timeline([[0.2, 0.5]], [[2, 1]])  # rewards at tokens 1 and 2
    values = T([[0.1, 0.3, 0.4]])
    result = GAEEstimator(whiten=False)(AdvantageBatch(rewards, values, mask, T([0]), turn_ids=turn_ids))
    # gamma = lam = 1: A_t = rewards still to come - V_t
    assert result.advantages.tolist() == [pytest.approx([0.7 - 0.1, 0.7 - 0.3, 0.5 - 0.4])]
    assert result.returns.tolist() == [pytest.approx([0.7, 0.7, 0.5])]
    half = GAEEstimator(gamma=0.5, lam=1.0, whiten=False)(
        AdvantageBatch(rewards, values, mask, T([0]), turn_ids=turn_ids)
    )
    assert half.advantages.tolist() == [pytest.approx([0.5 * (0.2 + 0.5 * 0.5) - 0.1, 0.2 + 0.25 - 0.3, 0.1])]


def test_turn_gae_takes_the_turn_as_the_time_step():
    mask, turn_ids, rewards = timeline([[0.1, 0.2, 0.3], [0.5, -0.5]], [[2, 2, 1], [1, 2]])
    values = T([[1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 2.0, 3.0, 0.0, 0.0]])  # turn values: 1, 3, 5 and 1, 2
    batch = AdvantageBatch(rewards, values, mask, T([0, 1]), turn_ids=turn_ids)
    result = TurnGAEEstimator(whiten=False)(batch)
    # dialogue 0: A_2 = 0.3 - 5; A_1 = 0.2 + 5 - 3 + A_2; A_0 = 0.1 + 3 - 1 + A_1
    assert result.advantages.tolist() == [
        pytest.approx([-0.4, -0.4, -2.5, -2.5, -4.7]),
        pytest.approx([-1.0, -2.5, -2.5, 0.0, 0.0]),
    ]
    assert result.returns.tolist() == [
        pytest.approx([0.6, 0.6, 0.5, 0.5, 0.3]),
        pytest.approx([0.0, -0.5, -0.5, 0, 0]),
    ]
    discounted = TurnGAEEstimator(gamma=0.5, lam=0.5, whiten=False)(batch)
    a2 = 0.3 - 5
    a1 = 0.2 + 0.5 * 5 - 3 + 0.25 * a2
    a0 = 0.1 + 0.5 * 3 - 1 + 0.25 * a1
    assert discounted.advantages[0].tolist() == pytest.approx([a0, a0, a1, a1, a2])
    with pytest.raises(ValueError, match="needs critic values"):
        TurnGAEEstimator()(AdvantageBatch(rewards, None, mask, T([0, 1]), turn_ids=turn_ids))


def test_turn_credit_compares_each_turns_return_with_the_other_members():
    mask, turn_ids, rewards = timeline(
        [[0.1, 0.2, 0.3], [0.5, -0.5], [0.0, 0.4, 0.0], [9.0]], [[1, 1, 1], [1, 2], [2, 1, 1], [1]]
    )
    batch = AdvantageBatch(
        rewards, None, mask, T([0, 0, 0, 1]), valid=T([True, True, True, False]), turn_ids=turn_ids
    )
    result = TurnCreditEstimator(scale_by_std=False)(batch)
    # returns-to-go: d0 [0.6, 0.5, 0.3], d1 [0.0, -0.5], d2 [0.4, 0.4, 0.0]; d3 is invalid
    expected = [
        [0.6 - (0.0 + 0.4) / 2, 0.5 - (-0.5 + 0.4) / 2, 0.3 - 0.0],
        [0.0 - (0.6 + 0.4) / 2, -0.5 - (0.5 + 0.4) / 2],
        [0.4 - (0.6 + 0.0) / 2, 0.4 - (0.5 - 0.5) / 2, 0.0 - 0.3],
    ]
    per_token = [
        [expected[0][0], expected[0][1], expected[0][2]],
        [expected[1][0], expected[1][1], expected[1][1]],
        [expected[2][0], expected[2][0], expected[2][1], expected[2][2]],
        [0.0],
    ]
    for row, values in enumerate(per_token):
        assert result.advantages[row, : len(values)].tolist() == pytest.approx(values)
    assert result.metrics["advantage/turns_without_baseline"] == 0
    scaled = TurnCreditEstimator()(batch)  # divided by the std of the other members' returns
    assert scaled.advantages[0, 0].item() == pytest.approx(expected[0][0] / T([0.0, 0.4]).std().item())
    alone = TurnCreditEstimator()(AdvantageBatch(rewards[:1], None, mask[:1], T([0]), turn_ids=turn_ids[:1]))
    assert alone.metrics["advantage/turns_without_baseline"] == 3  # a group of one: no baseline anywhere


# --------------------------------------------------------------------------- unbiasedness, exactly
# A one-decision dialogue: at turn 1 the policy either "resolves" (A: +0.1 and the user leaves
# content) or "explores" (B: nothing yet, then +0.5 at turn 2). B is better (0.5 > 0.1), and
# P(A) = sigmoid(theta), so dJ/dtheta = p (1 - p) (0.1 - 0.5) < 0: the gradient must lower theta.
RESOLVE, EXPLORE = ([0.1], [1]), ([0.0, 0.5], [1, 1])


def expected_gradient(estimate, p, group_size=4):
    """E[sum over a group of A_{i,1} * dlog pi(a_i)/dtheta], by enumerating every group."""
    total = 0.0
    for choices in itertools.product([True, False], repeat=group_size):
        rewards, lengths = zip(*(RESOLVE if resolved else EXPLORE for resolved in choices), strict=True)
        mask, turn_ids, token_rewards = timeline(list(rewards), list(lengths))
        advantages = estimate(
            AdvantageBatch(token_rewards, None, mask, torch.zeros(group_size), turn_ids=turn_ids)
        )
        probability = torch.tensor([p if resolved else 1 - p for resolved in choices]).prod().item()
        scores = [(1 - p) if resolved else -p for resolved in choices]  # dlog pi(a)/dtheta, sigmoid policy
        total += probability * sum(advantages[row, 0].item() * score for row, score in enumerate(scores))
    return total


def per_turn_index_normalised(batch):
    """The biased alternative: each turn's own reward, normalised among the dialogues at that index."""
    from rlver.rl.advantages import broadcast_turns, turn_presence, turn_table

    table = turn_table(batch.token_rewards, batch.turn_ids, batch.mask, "sum")
    present = turn_presence(batch.turn_ids, batch.mask, table.shape[1])
    normalised = torch.zeros_like(table)
    for turn in range(table.shape[1]):
        here = present[:, turn]
        values = table[here, turn]
        if values.numel() > 1:
            normalised[here, turn] = (values - values.mean()) / (values.std() + 1e-6)
    return broadcast_turns(normalised, batch.turn_ids, batch.mask)


@pytest.mark.parametrize("p", [0.3, 0.5, 0.8])
def test_the_turn_credit_baseline_is_unbiased_where_per_turn_index_normalisation_is_fooled(p):
    true_gradient = p * (1 - p) * (0.1 - 0.5)
    ours = expected_gradient(lambda batch: TurnCreditEstimator(scale_by_std=False)(batch).advantages, p)
    assert ours == pytest.approx(4 * true_gradient, abs=1e-6)  # exactly: a group of 4 samples
    scaled = expected_gradient(lambda batch: TurnCreditEstimator()(batch).advantages, p)
    assert scaled < 0  # the std only weights the groups: still towards B
    fooled = expected_gradient(per_turn_index_normalised, p)
    assert fooled > 0  # turn 1 alone ranks A's +0.1 above B's 0: the wrong way


# --------------------------------------------------------------------------- metrics
def test_turn_metrics_are_step_wide_and_skip_turns_nobody_reached():
    mask, turn_ids, _ = timeline([[0.1, 0.2], [0.3]], [[1, 2], [2]])
    table, advantages = T([[0.1, 0.2], [0.3, 0.0]]), T([[1.0, 2.0, 4.0], [0.5, 0.5, 0.0]])
    metrics = turn_metrics(
        table, advantages, turn_ids, mask, T([True, True]), 4, lambda x: x * 2
    )  # 2 "ranks"
    assert metrics == pytest.approx(
        {
            "turn/reward_mean_1": 0.2, "turn/advantage_mean_1": (1.0 + 0.5 + 0.5) / 3, "turn/dialogues_1": 4.0,
            "turn/reward_mean_2": 0.2, "turn/advantage_mean_2": 3.0, "turn/dialogues_2": 2.0,
        }
    )  # fmt: skip
    invalid = turn_metrics(table, advantages, turn_ids, mask, T([True, False]), 4, lambda x: x)
    assert invalid["turn/reward_mean_1"] == pytest.approx(0.1) and invalid["turn/dialogues_1"] == 1.0


# --------------------------------------------------------------------------- the second decision
# Two decisions: at turn 1 "resolve" (A: +0.1, the user leaves) with P = sigmoid(theta_1), else
# explore; at turn 2, after exploring, "deepen" (C: +0.5) with P = sigmoid(theta_2), else "drift"
# (D: -0.2). dJ/dtheta_2 = (1 - p) q (1 - q) (0.5 - (-0.2)): the estimator's expectation over
# every group of 4 must be 4 times that (turn 1's log-prob does not depend on theta_2).
TWO_DECISIONS = {"A": ([0.1], [1]), "C": ([0.0, 0.5], [1, 1]), "D": ([0.0, -0.2], [1, 1])}


def expected_second_gradient(estimate, p, q, group_size=4):
    probabilities = {"A": p, "C": (1 - p) * q, "D": (1 - p) * (1 - q)}
    scores = {"A": 0.0, "C": 1 - q, "D": -q}  # dlog pi(a_2)/dtheta_2; A never makes a second choice
    total = 0.0
    for choices in itertools.product("ACD", repeat=group_size):
        rewards, lengths = zip(*(TWO_DECISIONS[choice] for choice in choices), strict=True)
        mask, turn_ids, token_rewards = timeline(list(rewards), list(lengths))
        advantages = estimate(
            AdvantageBatch(token_rewards, None, mask, torch.zeros(group_size), turn_ids=turn_ids)
        )
        probability = torch.tensor([probabilities[choice] for choice in choices]).prod().item()
        # the second turn's advantage sits on timeline position 1 of the dialogues that explored
        total += probability * sum(
            advantages[row, 1].item() * scores[choice] for row, choice in enumerate(choices) if choice != "A"
        )
    return total


@pytest.mark.parametrize(("p", "q"), [(0.3, 0.5), (0.6, 0.2), (0.5, 0.9)])
def test_the_turn_credit_baseline_is_unbiased_at_the_second_decision(p, q):
    true_gradient = (1 - p) * q * (1 - q) * (0.5 - (-0.2))
    ours = expected_second_gradient(
        lambda batch: TurnCreditEstimator(scale_by_std=False)(batch).advantages, p, q
    )
    assert ours == pytest.approx(4 * true_gradient, abs=1e-6)
    scaled = expected_second_gradient(lambda batch: TurnCreditEstimator()(batch).advantages, p, q)
    assert scaled > 0  # the std (and its floors) only weight the groups: still towards C


# --------------------------------------------------------------------------- the divisor's floor
def test_leave_one_out_std_is_the_std_of_the_others():
    from rlver.rl.advantages import leave_one_out_std

    values = T([0.3, -0.1, 0.8, 0.2, 0.25])
    totals = torch.stack([T(5.0), values.sum(), values.square().sum()])
    expected = [torch.cat([values[:i], values[i + 1 :]]).std().item() for i in range(5)]
    assert leave_one_out_std(values, totals).tolist() == pytest.approx(expected, abs=1e-6)


def lone_outlier_batch(reduce_sum=None):
    """Group 0: three members at 0.2 and one at 0.7; group 1 spread out. One turn each."""
    returns = [[0.2], [0.2], [0.2], [0.7], [0.0], [0.4], [0.9], [0.1]]
    mask, turn_ids, rewards = timeline(returns, [[1]] * 8)
    return AdvantageBatch(rewards, None, mask, T([0] * 4 + [1] * 4), reduce_sum=reduce_sum, turn_ids=turn_ids)


def test_a_lone_outlier_is_divided_by_a_floor_relative_to_the_steps_spread():
    batch = lone_outlier_batch()
    old = TurnCreditEstimator(relative_std_floor=0.0)(batch).advantages
    assert old[3, 0].item() == pytest.approx(0.5 / 0.01)  # the others all scored 0.2: the absolute floor
    new = TurnCreditEstimator()(batch).advantages  # relative_std_floor 0.5
    others = T([0.2, 0.2, 0.2, 0.0, 0.4, 0.9, 0.1])  # every valid dialogue of the step but the outlier
    step = T(
        [0.2, 0.2, 0.2, 0.7, 0.0, 0.4, 0.9, 0.1]
    )  # a first step: its own spread stands in for earlier ones
    floor = 0.5 * max(others.std().item(), step.std().item())
    assert new[3, 0].item() == pytest.approx(0.5 / floor, rel=1e-5)
    assert new.abs().max().item() < 5
    # a member whose group-mates disagree keeps the group's own std where that is larger
    group_std = T([0.2, 0.2, 0.7]).std().item()
    assert group_std > 0.5 * T([0.2, 0.2, 0.7, 0.0, 0.4, 0.9, 0.1]).std().item()
    assert new[0, 0].item() == pytest.approx((0.2 - (0.2 + 0.2 + 0.7) / 3) / group_std, rel=1e-5)
    # the floor is the step's, over every rank: two "ranks" holding the same dialogues
    doubled = TurnCreditEstimator()(lone_outlier_batch(reduce_sum=lambda x: x * 2)).advantages
    every_rank = torch.cat([others, step])
    both_ranks = torch.cat([step, step])
    floor = 0.5 * max(every_rank.std().item(), both_ranks.std().item())
    assert doubled[3, 0].item() == pytest.approx(0.5 / floor, rel=1e-5)
    with pytest.raises(ValueError, match="relative_std_floor"):
        TurnCreditEstimator(relative_std_floor=-1.0)


def tied_but_one_batch():
    """Issue 54: eight dialogues in two groups, seven at 0.3 and one at 0.8 (the saturated case:
    all fail but one). The other dialogues' std is exactly 0 for the one that differs."""
    mask, turn_ids, rewards = timeline([[0.3]] * 7 + [[0.8]], [[1]] * 8)
    return AdvantageBatch(rewards, None, mask, T([0] * 4 + [1] * 4), turn_ids=turn_ids)


def test_a_lone_outlier_among_tied_others_keeps_a_floor_at_every_step():
    estimator = TurnCreditEstimator()
    first = estimator(tied_but_one_batch()).advantages
    step = T([0.3] * 7 + [0.8])
    # the step's others tie (std 0): its own std, outlier included, stands in at the first step
    assert first[7, 0].item() == pytest.approx(0.5 / (0.5 * step.std().item()), rel=1e-5)
    assert first.abs().max().item() < 6  # was 50: (0.8 - 0.3) / std_floor 0.01
    # later steps: the earlier steps' spread, which holds none of this step's returns
    spread = step.std().item()
    second = estimator(tied_but_one_batch()).advantages
    assert second[7, 0].item() == pytest.approx(0.5 / (0.5 * spread), rel=1e-5)
    assert estimator.earlier_spread == pytest.approx(spread, rel=1e-5)  # 0.9 x spread + 0.1 x spread
    with pytest.raises(ValueError, match="scale_memory"):
        TurnCreditEstimator(scale_memory=1.0)
