"""The built-in reward and advantage plugins (rlver_register_rewards, rlver_register_advantages)."""

import pytest
import torch
from rlver_plugins.advantages import GAEEstimator, GRPOEstimator
from rlver_plugins.rewards import EmotionGainReward, FinalEmotionReward, FormatReward, SharedPhrasingCost

from rlver.core.interfaces import AdvantageBatch, ParsedReply
from rlver.core.plugins import get_registry
from rlver.core.types import Profile, UserTurn
from rlver.rollout.runner import PolicyTurn, Trajectory

PROFILE = Profile("p", "player", "scene", "passive", ("a",), "You want deep empathy.")


def trajectory(emotions, malformed=0):
    t = Trajectory(PROFILE, 0, "system")
    t.user_turns = [UserTurn("u", e) for e in emotions]
    for index in range(len(emotions) - 1):
        parsed = ParsedReply(
            "r", format_ok=index >= malformed, format_error=None if index >= malformed else "missing"
        )
        t.policy_turns.append(PolicyTurn([1], [2], [-0.1], "stop", "r", parsed))
    return t


def test_builtins_register_through_the_hooks():
    registry = get_registry()
    assert registry.names("rewards") == [
        "emotion_change",
        "emotion_gain",
        "final_emotion",
        "format",
        "shared_phrasing",
    ]
    assert registry.names("advantages") == ["gae", "grpo", "turn_credit", "turn_gae"]
    assert registry.get("rewards", "format").plugin == "rewards"  # via rlver_register_rewards
    assert registry.get("advantages", "gae").plugin == "advantages"  # via rlver_register_advantages


def test_final_emotion_reward_is_final_over_100_floored_at_0():
    assert FinalEmotionReward()([trajectory([40, 50, 100]), trajectory([40, 0]), trajectory([40, 63])]) == [
        1.0,
        0.0,
        0.63,
    ]


def test_format_reward_penalises_the_malformed_fraction():
    rewards = FormatReward(penalty=1.0, bonus=0.2)(
        [trajectory([40, 50, 60, 70, 80], malformed=1), trajectory([40, 50])]
    )
    assert rewards == pytest.approx([-0.25, 0.2])
    with pytest.raises(ValueError):
        FormatReward(penalty=-1)


def test_emotion_gain_is_relative_to_the_difficulty_start():
    reward = EmotionGainReward()
    # hard starts at 30, easy at 50: reaching 100 scores 1 either way; halfway scores 0.5
    assert reward(
        [trajectory([30, 100]), trajectory([50, 100]), trajectory([30, 65]), trajectory([40, 20])]
    ) == (pytest.approx([1.0, 1.0, 0.5, -0.5]))


def spoken(user, *replies, story="I lost my job"):
    """A dialogue with `user` (a profile id), who opens with `story`, and whose policy said `replies`."""
    t = Trajectory(Profile(user, "player", "scene", "passive", ("a",), "You want deep empathy."), 0, "system")
    t.user_turns = [UserTurn(story, 40.0)] + [UserTurn("and then?", 40.0) for _ in replies]
    for reply in replies:
        t.policy_turns.append(PolicyTurn([1], [2], [-0.1], "stop", reply, ParsedReply(reply)))
    return t


def test_shared_phrasing_charges_a_template_whatever_user_words_fill_it():
    cost = SharedPhrasingCost()(
        [
            spoken("ann", "I'm here, Ann. I'm here, Ann.", story="I am Ann and my cat Tom ran off"),
            spoken("ann", "Oh, Tom! Where did he go?", story="I am Ann and my cat Tom ran off"),
            spoken("bob", "I'm here, Bob. I'm here, Bob.", story="I am Bob and I lost my job"),
            spoken("cy", "I'm here, Cy... I'M HERE, CY!", story="I am Cy and my car broke"),
        ]
    )
    # With each user's own name taken out, the three "I'm here" replies are one skeleton,
    # "i m here _ i m here _", whose four phrases are in every "I'm here" reply: both replies to
    # Ann's others (Bob's, Cy's), 2 of the 3 to Bob's others (Ann's question is not).
    assert cost[0] == pytest.approx([-1.0])
    assert cost[1] == pytest.approx([0.0])  # words of its own: free
    assert cost[2] == pytest.approx([-2 / 3])
    assert cost[3] == pytest.approx([-2 / 3])


def test_shared_phrasing_charges_the_shared_part_of_a_reply_and_reads_chinese_by_characters():
    cost = SharedPhrasingCost()(
        [
            spoken("ann", "I'm so sorry to hear that, it sounds hard."),
            spoken("bob", "I'm so sorry to hear that your dog died."),
            spoken("li", "我在这里陪着你，小李。", story="我是小李，我失业了"),
            spoken("wang", "我在这里陪着你，老王。", story="我是老王，我的狗丢了"),
        ]
    )
    # Ann's reply has 8 phrases; "i m so", "m so sorry", "so sorry to", "sorry to hear", "to hear
    # that" (5) are in Bob's reply, one of the 3 other replies: 5 / 8 / 3.
    assert cost[0] == pytest.approx([-5 / 8 / 3])
    assert cost[1] == pytest.approx([-5 / 8 / 3])  # Bob's has 8 phrases too, the same 5 shared
    # "我在这里陪着你_" (小李's own 小 and 李 each a slot; 我, 是 and 失 ... are not only hers):
    # its 6 four-character phrases all in 老王's reply, 1 of the 3 others; 7 in all with the slots.
    assert cost[2][0] < 0 and cost[2] == pytest.approx(cost[3])


def test_shared_phrasing_is_free_for_one_user_and_sums_as_per_turn_rewards():
    from rlver.train.scoring import score_dialogues

    alone = [spoken("ann", "I'm here.", "I'm here."), spoken("ann", "I'm here.", "I'm here.")]
    assert SharedPhrasingCost()(alone) == [[0.0, 0.0], [0.0, 0.0]]
    batch = [spoken("ann", "I'm here.", "Go on."), spoken("bob", "I'm here.", "Yes."), spoken("cy", "", "")]
    metrics: dict[str, float] = {}
    total = score_dialogues([("shared_phrasing", 0.03, SharedPhrasingCost())], batch, metrics)
    # "i m here" is 1 of the 4 replies to Ann's others (Bob's 2, Cy's 2 empty ones): -1/4 x 0.03.
    assert total.flatten().tolist() == pytest.approx([-0.0075, 0.0, -0.0075, 0.0, 0.0, 0.0])
    assert metrics["reward/shared_phrasing"] == pytest.approx(-1 / 6)


def test_gae_estimator_matches_the_maths_and_whitens():
    batch = AdvantageBatch(
        token_rewards=torch.tensor([[0.0, 0.0, 1.0]]),
        values=torch.tensor([[0.5, 0.6, 0.7]]),
        mask=torch.tensor([[1, 1, 1]]),
        group_ids=torch.tensor([0]),
    )
    raw = GAEEstimator(whiten=False)(batch)
    assert raw.advantages.tolist()[0] == pytest.approx([0.5, 0.4, 0.3])
    assert raw.returns.tolist()[0] == pytest.approx([1.0, 1.0, 1.0])
    whitened = GAEEstimator()(batch).advantages
    assert whitened.mean().item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="needs critic values"):
        GAEEstimator()(AdvantageBatch(batch.token_rewards, None, batch.mask, batch.group_ids))
    assert GAEEstimator.requires_critic and not GRPOEstimator.requires_critic


def test_grpo_estimator_broadcasts_group_advantages_and_counts_degenerate_groups():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    rewards = torch.tensor([[0, 0.2, 0], [0.6, 0, 0], [0, 0, 0.5], [0, 0, 0.5]])
    result = GRPOEstimator()(AdvantageBatch(rewards, None, mask, torch.tensor([0, 0, 1, 1])))
    expected = 0.2 / (0.2828427 + 1e-6)  # (0.2 - 0.4) / sample std of [0.2, 0.6]
    assert result.advantages[0].tolist() == pytest.approx([-expected, -expected, 0.0], rel=1e-5)
    assert result.advantages[1].tolist() == pytest.approx([expected, 0.0, 0.0], rel=1e-5)
    assert result.advantages[2:].abs().sum().item() == 0.0
    assert result.metrics == {"advantage/degenerate_groups": 1.0, "advantage/degenerate_group_fraction": 0.5}


def test_gae_whitening_leaves_invalid_dialogues_out_of_the_statistics():
    """A dialogue ended by a simulator error must not shift or scale the others' advantages."""
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.2], [0.0, 50.0]])
    values = torch.tensor([[0.3, 0.4], [0.5, 0.1], [-20.0, 9.0]])
    mask = torch.ones(3, 2, dtype=torch.long)
    alone = GAEEstimator()(AdvantageBatch(rewards[:2], values[:2], mask[:2], torch.tensor([0, 1])))
    together = GAEEstimator()(
        AdvantageBatch(
            rewards, values, mask, torch.tensor([0, 1, 2]), valid=torch.tensor([True, True, False])
        )
    )
    assert torch.allclose(together.advantages[:2], alone.advantages, atol=1e-6)
    assert together.advantages[2].abs().sum() == 0


def test_gae_whitening_uses_the_step_wide_statistics_it_is_given():
    """With reduce_sum the statistics are those of every rank: one dialogue keeps its reward's sign."""
    values = torch.tensor([[0.2, 0.2]])
    mask = torch.ones(1, 2, dtype=torch.long)
    other_rank = torch.tensor([2.0, 0.0, 0.0])  # two tokens of advantage 0 on the other rank

    def reduce_sum(local):
        return local + other_rank

    good = AdvantageBatch(torch.tensor([[0.0, 1.0]]), values, mask, torch.tensor([0]), reduce_sum=reduce_sum)
    bad = AdvantageBatch(torch.tensor([[0.0, 0.0]]), values, mask, torch.tensor([0]), reduce_sum=reduce_sum)
    assert (GAEEstimator()(good).advantages > 0).all() and (GAEEstimator()(bad).advantages < 0).all()
    # Whitened over this rank alone the reward would cancel: both dialogues would get the same.
    assert not torch.equal(GAEEstimator()(good).advantages, GAEEstimator()(bad).advantages)


def test_grpo_leaves_invalid_dialogues_out_of_their_groups_baseline():
    mask = torch.ones(3, 1, dtype=torch.long)
    rewards = torch.tensor([[0.2], [0.6], [5.0]])
    result = GRPOEstimator()(
        AdvantageBatch(rewards, None, mask, torch.tensor([0, 0, 0]), valid=torch.tensor([True, True, False]))
    )
    expected = 0.2 / (0.2828427 + 1e-6)
    assert result.advantages[:, 0].tolist() == pytest.approx([-expected, expected, 0.0], rel=1e-5)
