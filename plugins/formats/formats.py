"""The thinking and non-thinking prompt formats.

Only the visible reply (the text after the last `</think>`) reaches the user and
the next turn's history; the thinking stays in the trajectory for training. A
completion with an unclosed `<think>` (typically cut off at max_new_tokens while
thinking) has an empty visible reply: none of its text is known to be meant for
the user.
"""

from __future__ import annotations

from rlver.core.interfaces import ParsedReply, PromptFormat
from rlver.core.types import Profile

# The Sentient benchmark's system prompt for the model under test, and ours in Chinese.
BASE_PROMPTS = {
    "en": (
        "You are an intelligent chat partner who chats with users with high EQ, "
        "making them feel comfortable, happy or helped."
    ),
    "zh": "你是一个高情商的智能聊天伙伴，与用户聊天时让对方感到舒适、开心或得到帮助。",
}

THINK_INSTRUCTIONS = {
    "en": (
        " Before every reply, think inside <think>...</think>: what the user feels, what they may need "
        "but have not said, and which high-EQ strategy fits. Then, after </think>, write only your reply "
        "to the user. The user sees nothing inside the think tags."
    ),
    "zh": (
        "每次回复前，先在<think>...</think>中思考：用户的感受是什么，他们可能有什么没说出口的需求，"
        "以及哪种高情商的回应策略最合适。然后在</think>之后只写给用户的回复。用户看不到思考标签里的内容。"
    ),
}

LANGUAGES = ("en", "zh", "auto")

_OPEN = "<think>"
_CLOSE = "</think>"


def _check_language(language: str) -> str:
    if language not in LANGUAGES:
        raise ValueError(f"language ({language!r}) must be one of {', '.join(LANGUAGES)}")
    return language


class _BaseFormat(PromptFormat):
    def __init__(self, language: str = "auto", system_prompt: str | None = None) -> None:
        self.language = _check_language(language)
        self.custom_prompt = system_prompt

    def _language_for(self, profile: Profile) -> str:
        return profile.language if self.language == "auto" else self.language


class NoThinkFormat(_BaseFormat):
    """The reply goes to the user as it is.

    Args:
        language: System prompt language: "en", "zh" or "auto" (the profile's language).
        system_prompt: Replace the built-in system prompt with this text.
    """

    def system_prompt(self, profile: Profile) -> str:
        if self.custom_prompt is not None:
            return self.custom_prompt
        return BASE_PROMPTS[self._language_for(profile)]

    def parse(self, completion: str) -> ParsedReply:
        return ParsedReply(visible=completion.strip())


class ThinkFormat(_BaseFormat):
    """`<think>reasoning</think>` then the visible reply.

    A completion is well-formed when it starts with one `<think>`, closes it once
    with `</think>`, both parts are non-empty, and no other tag appears. A
    malformed one is still parsed as well as possible and flagged, but text that
    may be thinking is never made visible: an unclosed `<think>` gives an empty reply.

    Args:
        language: System prompt language: "en", "zh" or "auto" (the profile's language).
        system_prompt: Replace the built-in system prompt with this text.
    """

    thinking = True

    def system_prompt(self, profile: Profile) -> str:
        if self.custom_prompt is not None:
            return self.custom_prompt
        language = self._language_for(profile)
        return BASE_PROMPTS[language] + THINK_INSTRUCTIONS[language]

    def adapt_system_prompt(self, prompt: str, profile: Profile) -> str:
        if _OPEN in prompt:  # it already asks for <think> (the RLVER reference's think prompt)
            return prompt
        return prompt + THINK_INSTRUCTIONS[self._language_for(profile)]

    def parse(self, completion: str) -> ParsedReply:
        text = completion.strip()
        close_at = text.rfind(_CLOSE)
        open_at = text.rfind(_OPEN)
        if open_at > close_at:
            # A <think> never closed: the completion ended while thinking (usually cut off at
            # max_new_tokens). Rather than risk showing the thought, the user gets an empty reply.
            return ParsedReply(
                visible="",
                thinking=text[open_at + len(_OPEN) :].strip() or None,
                format_ok=False,
                format_error="unclosed <think>: the completion ended while thinking, so the reply is empty",
            )
        if close_at < 0:
            # No tag at all: the model did not think, the whole text is its reply.
            return ParsedReply(visible=text, format_ok=False, format_error="missing <think>...</think>")
        visible = text[close_at + len(_CLOSE) :].strip()
        head = text[:close_at]
        thinking = head[head.find(_OPEN) + len(_OPEN) :].strip() if _OPEN in head else head.strip()
        error = None
        if not text.startswith(_OPEN):
            error = "text before <think>" if _OPEN in head else "missing <think>"
        elif text.count(_OPEN) != 1 or text.count(_CLOSE) != 1:
            error = "more than one think block"
        elif not thinking:
            error = "empty thinking"
        elif not visible:
            error = "empty reply after </think>"
        return ParsedReply(
            visible=visible, thinking=thinking or None, format_ok=error is None, format_error=error
        )
