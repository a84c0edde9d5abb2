import pytest
from rlver_plugins.formats import NoThinkFormat, ThinkFormat

from rlver.core.types import Profile

PROFILE_EN = Profile("p", "player", "scene", "passive", ("a", "b", "c"), "You want deep empathy.")
PROFILE_ZH = Profile("q", "玩家", "场景", "被动型", ("内向",), "你希望对方深刻共情你的感受")


def test_think_well_formed():
    parsed = ThinkFormat().parse("<think>She is hurt; listen first.</think>\nThat sounds exhausting.")
    assert parsed.visible == "That sounds exhausting."
    assert parsed.thinking == "She is hurt; listen first."
    assert parsed.format_ok and parsed.format_error is None


@pytest.mark.parametrize(
    ("completion", "visible", "error"),
    [
        ("Just a reply.", "Just a reply.", "missing <think>...</think>"),
        ("<think></think>Hello", "Hello", "empty thinking"),
        ("<think>plan</think>   ", "", "empty reply after </think>"),
        ("Hi <think>plan</think> there", "there", "text before <think>"),
        ("plan</think> reply", "reply", "missing <think>"),
        ("<think>a</think>x<think>b</think> final", "final", "more than one think block"),
    ],
)
def test_think_malformed_is_flagged(completion, visible, error):
    parsed = ThinkFormat().parse(completion)
    assert parsed.visible == visible
    assert not parsed.format_ok
    assert parsed.format_error == error


UNCLOSED = "unclosed <think>: the completion ended while thinking, so the reply is empty"


@pytest.mark.parametrize(
    ("completion", "thinking"),
    [
        ("<think>SECRET reasoning, cut off at max_new_tok", "SECRET reasoning, cut off at max_new_tok"),
        ("Hi <think>SECRET plan", "SECRET plan"),  # nor is the text before the tag trusted as a reply
        ("<think>a</think>Sure. <think>SECRET second thoughts", "SECRET second thoughts"),
        ("<think>", None),
    ],
)
def test_unclosed_think_shows_the_user_nothing(completion, thinking):
    parsed = ThinkFormat().parse(completion)
    assert parsed.visible == ""
    assert parsed.thinking == thinking
    assert not parsed.format_ok and parsed.format_error == UNCLOSED


def test_only_text_after_the_last_close_tag_is_visible():
    parsed = ThinkFormat().parse("<think>a</think>b</think>c")
    assert parsed.visible == "c"
    assert not parsed.format_ok


def test_nothink_passes_the_reply_through():
    parsed = NoThinkFormat().parse("  I hear you. <think>not special here</think> ")
    assert parsed.visible == "I hear you. <think>not special here</think>"
    assert parsed.thinking is None and parsed.format_ok


def test_system_prompts_by_language():
    assert NoThinkFormat().system_prompt(PROFILE_EN).startswith("You are an intelligent chat partner")
    assert "高情商" in NoThinkFormat().system_prompt(PROFILE_ZH)
    assert "<think>" in ThinkFormat(language="en").system_prompt(PROFILE_ZH)
    assert "<think>" in ThinkFormat().system_prompt(PROFILE_ZH) and "思考" in ThinkFormat().system_prompt(
        PROFILE_ZH
    )
    assert ThinkFormat(system_prompt="Be brief.").system_prompt(PROFILE_EN) == "Be brief."


def test_unknown_language_is_rejected():
    with pytest.raises(ValueError, match="language \\('fr'\\) must be one of en, zh, auto"):
        NoThinkFormat(language="fr")


def test_registered_through_rlver_register_formats():
    from rlver.core.plugins import get_registry

    registry = get_registry()
    assert registry.get("formats", "think").factory is ThinkFormat
    assert registry.get("formats", "nothink").factory is NoThinkFormat
    assert isinstance(registry.build("formats", {"name": "think", "language": "zh"}, flag="f"), ThinkFormat)
