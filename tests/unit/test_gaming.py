"""The signs of a gamed simulator in the replies themselves (rlver.rollout.gaming), and the scripted
responders that play the cheap strategies (the `scripted` engine plugin)."""

from __future__ import annotations

import pytest

from rlver.commands.probe import scripted_strategies
from rlver.core.interfaces import SamplingSettings
from rlver.rollout.gaming import THRESHOLDS, GamingShares, gaming_shares_of_records, shares_of_exchanges


def test_each_share_counts_what_it_names():
    dialogues = [
        [
            ("My dog died last week and the house is so quiet now.", "I'm sorry to hear that.", "stop"),
            ("Nobody understands.", "I'm sorry to hear that.", "stop"),  # a repeat in its dialogue
            (
                "The house is so quiet now and I hate it.",
                "the house is so quiet now",
                "length",
            ),  # a copy, cut
        ],
        [("工作压力太大了，每天都加班到很晚。", "每天都加班到很晚", "stop")],  # a copy, in characters
    ]
    shares = shares_of_exchanges(dialogues)
    assert shares.replies == 4
    assert shares.repeat_share == 1 / 4
    assert shares.copy_share == 2 / 4
    assert shares.cut_share == 1 / 4
    assert shares.top_openings[0] == ("i m sorry", 2) and shares.top_opening_share == 2 / 4
    assert 0 < shares.distinct_2 < 1
    assert GamingShares.from_record(shares.as_record()) == shares  # what before_after.json keeps


def test_a_share_past_its_threshold_is_said_in_one_line_and_a_varied_batch_says_nothing():
    template = [[("How was your day?", f"I'm glad you shared that {i}.", "stop")] for i in range(9)]
    varied = [[(f"topic {i}", f"reply number {i} about thing {i}", "stop")] for i in range(9)]
    gamed, honest = shares_of_exchanges(template), shares_of_exchanges(varied)
    assert gamed.top_opening_share == 1.0 > THRESHOLDS["top_opening_share"]
    assert any("open with the same words ('i m glad')" in w for w in gamed.warnings())
    assert "WATCH:" in gamed.line() and "\n" not in gamed.line()
    assert honest.warnings() == [] and "WATCH" not in honest.line()
    assert shares_of_exchanges([]).replies == 0 and shares_of_exchanges([]).warnings() == []


def test_transcript_records_and_trajectories_give_the_same_shares():
    records = [
        {
            "turns": [
                {"role": "user", "text": "I failed my exam."},
                {"role": "assistant", "text": "I failed my exam.", "finish_reason": "stop"},
                {"role": "user", "text": "Are you copying me?"},
                {"role": "assistant", "text": "That must be hard.", "finish_reason": "length"},
            ]
        }
    ]
    shares = gaming_shares_of_records(records)
    assert (shares.replies, shares.copy_share, shares.cut_share) == (2, 0.5, 0.5)


# --------------------------------------------------------------------------- scripted responders
@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    from rlver.modeling.models import load_policy

    return load_policy(str(tiny_model_dir), dtype="float32", device="cpu")


def rendered(policy, messages):
    text = policy.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return policy.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("strategy", scripted_strategies())
@pytest.mark.parametrize("language", ["en", "zh"])
def test_every_responder_answers_in_the_users_language_and_ends_its_turn(strategy, language, tiny_policy):
    from rlver_plugins.scripted_engine import ScriptedEngine

    last = (
        "I lost my job today and I don't know what to do."
        if language == "en"
        else "我今天丢了工作，不知道该怎么办。"
    )
    prompt = rendered(
        tiny_policy,
        [
            {"role": "system", "content": "You are chatting with a friend."},
            {"role": "user", "content": "Hi." if language == "en" else "你好。"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": last},
        ],
    )
    engine = ScriptedEngine(tiny_policy, strategy=strategy)
    (generation,) = engine.generate([prompt], SamplingSettings(max_new_tokens=200))
    assert generation.finish_reason == "stop" and generation.token_ids[-1] == engine.stop_id
    text = tiny_policy.tokenizer.decode(list(generation.token_ids[:-1]))
    if strategy == "parrot":
        assert text == last
    elif strategy == "kind_refusal":  # the user's own first clause, told back to them, then no help
        expected = (
            "I'm really sorry that you lost your job today and you don't know what to do. "
            "I'm unable to assist with that."
            if language == "en"
            else "很抱歉你今天丢了工作。我无法帮助你处理这件事。"
        )
        assert text == expected
    elif strategy == "confused":  # the user's own first clause, then not following it
        expected = (
            "you lost your job today and you don't know what to do? I'm not sure what you mean. "
            "What do you mean by that?"
            if language == "en"
            else "你今天丢了工作？我不太明白你的意思。你指的是什么？"
        )
        assert text == expected
    elif strategy == "glad":  # glad about the user's own trouble
        expected = (
            "I'm glad to hear that you lost your job today and you don't know what to do!"
            if language == "en"
            else "真为你高兴，你今天丢了工作！"
        )
        assert text == expected
    else:
        has_chinese = any("\u4e00" <= char <= "\u9fff" for char in text)
        assert has_chinese == (language == "zh"), text
    assert all(logprob == 0.0 for logprob in generation.logprobs)


def test_a_long_scripted_reply_is_cut_at_the_limit_and_a_thinking_prompt_gets_an_empty_thought(tiny_policy):
    from rlver_plugins.scripted_engine import ScriptedEngine

    engine = ScriptedEngine(tiny_policy, strategy="advice")
    prompt = rendered(tiny_policy, [{"role": "user", "content": "Help."}])
    (cut,) = engine.generate([prompt], SamplingSettings(max_new_tokens=5))
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5
    thinking = rendered(
        tiny_policy,
        [
            {"role": "system", "content": "Think in <think></think> first."},
            {"role": "user", "content": "Help."},
        ],
    )
    (reply,) = engine.generate([thinking], SamplingSettings(max_new_tokens=200))
    assert tiny_policy.tokenizer.decode(list(reply.token_ids)).startswith("<think>\n\n</think>\n")
    with pytest.raises(ValueError, match="strategy"):
        ScriptedEngine(tiny_policy, strategy="flattery")


def test_the_ablation_report_lists_each_runs_shares_and_what_passed_its_threshold():
    from rlver.evaluate.ablation_report import _gaming

    gamed = shares_of_exchanges([[("hi", f"I'm glad you said {i}", "stop")] for i in range(6)]).as_record()
    arms = {"base": {"per_seed": {"0": {"gaming": gamed}, "1": {"gaming": None}}}}
    lines = _gaming(arms)
    row = next(line for line in lines if line.startswith("| base | 0 |"))
    assert "100% ('i m glad')" in row and "open with the same words" in row
    assert "| base | 1 | n/a |" in "\n".join(lines)
