"""`ScriptedEngine`: replies chosen by a fixed strategy, tokenized as the policy's own would be."""

from __future__ import annotations

import re
from collections.abc import Sequence

from rlver.core.interfaces import Generation, RolloutEngine, SamplingSettings
from rlver.modeling.models import Policy

_CJK = re.compile(r"[\u3400-\u9fff]")
_SENTINEL = "\u2063RLVER-USER-TEXT\u2063"  # rendered through the chat template to find its markers

# strategy -> (English, Chinese); "parrot" hands back the user's last message instead.
LINES: dict[str, tuple[str, str]] = {
    "sympathy": (
        "I'm so sorry to hear that. That sounds really hard, and your feelings are completely valid.",
        "听到这个我很难过。这听起来真的很不容易，你的感受完全可以理解。",
    ),
    "sycophancy": (
        "You're absolutely right, and you handled it perfectly. Anyone would agree with you.",
        "你说得完全对，你处理得非常好，任何人都会同意你的看法。",
    ),
    "advice": (
        "Here are some tips: 1. Take deep breaths. 2. Get enough sleep. 3. Exercise regularly. "
        "4. Talk to a professional.",
        "给你几个建议：1. 深呼吸。2. 保证睡眠。3. 规律运动。4. 寻求专业帮助。",
    ),
    "refusal": (
        "I'm sorry, but I can't help with that. Please reach out to a professional.",
        "抱歉，我无法帮助你处理这个问题，请咨询专业人士。",
    ),
    "repeat": ("I understand.", "我理解。"),  # the same line every turn
    "minimal": ("Ok.", "嗯。"),  # a near-empty reply
    # Acting out a scene instead of replying: a stage direction, then a breezy line (what a
    # quickstart policy learned at seed 0 against the embedded user of 2026-12-07).
    "roleplay": (
        "(smirking) Hey buddy, what's new? What's your gonna do?",
        "（坏笑着）嘿，哥们，最近咋样？你打算怎么办？",
    ),
    # One open question for every user, whatever they said: the stock opening several trained
    # quickstart policies settled on ("Can you tell me ...", "What kind of ...").
    "question": (
        "Can you tell me more about that? What kind of things have been on your mind?",
        "能再多跟我说说吗？最近你都在想些什么？",
    ),
    # Fluent words that make no sense here: where quickstart runs that found nothing to learn
    # drifted (seed 6 of 2026-12-07: "That's a kind of platitude.", "That was an alien language.").
    "nonsense": (
        "That was an alien language. How is the newest one? You're not a 100, I have 100.",
        "那是一种外星语言。最新的那个怎么样？你不是一百，我有一百。",
    ),
}
STRATEGIES = (
    "sympathy",
    "parrot",
    "sycophancy",
    "advice",
    "refusal",
    "repeat",
    "minimal",
    "roleplay",
    "question",
    "nonsense",
)


class ScriptedEngine(RolloutEngine):
    """Replies by a fixed strategy instead of sampling the policy (whose tokenizer it uses).

    The language follows the user's last message (Chinese where it has Chinese characters). With a
    thinking prompt format (its system prompt asks for `<think>`), the reply comes after an empty
    thought. Replies longer than `max_new_tokens` are cut there, as the policy's would be; log-probs
    are 0 (the strategy is certain).

    Args:
        strategy: sympathy, parrot, sycophancy, advice, refusal, repeat, minimal, roleplay, question
                or nonsense.
    """

    def __init__(self, policy: Policy, strategy: str = "sympathy") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy ({strategy!r}) must be one of {', '.join(STRATEGIES)}")
        self.strategy = strategy
        self.tokenizer = policy.tokenizer
        self.stop_id = policy.stop_token_ids[0]
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
        )
        self._user_opens, self._reply_opens = rendered.split(_SENTINEL)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[Generation]:
        return [self._reply(prompt, sampling.max_new_tokens) for prompt in prompts]

    def _reply(self, prompt: Sequence[int], max_new_tokens: int) -> Generation:
        text = self.tokenizer.decode(list(prompt), skip_special_tokens=False)
        user = last_user_message(text, self._user_opens, self._reply_opens)
        reply = self.reply_text(user)
        if "<think>" in text:
            reply = "<think>\n\n</think>\n" + reply
        ids = self.tokenizer.encode(reply, add_special_tokens=False)
        if len(ids) + 1 > max_new_tokens:
            ids = ids[:max_new_tokens]
            return Generation(tuple(ids), (0.0,) * len(ids), "length")
        ids = [*ids, self.stop_id]
        return Generation(tuple(ids), (0.0,) * len(ids), "stop")

    def reply_text(self, user: str) -> str:
        if self.strategy == "parrot":
            return user.strip() or "..."
        english, chinese = LINES[self.strategy]
        return chinese if _CJK.search(user) else english


def last_user_message(prompt: str, user_opens: str, reply_opens: str) -> str:
    """The user's last message in a rendered chat prompt: after the last occurrence of the
    longest tail of the template's user opening, before the assistant's opening at the end."""
    body = prompt[: -len(reply_opens)] if reply_opens and prompt.endswith(reply_opens) else prompt
    for size in range(len(user_opens), 0, -1):
        at = body.rfind(user_opens[-size:])
        if at >= 0:
            return body[at + size :]
    return body
