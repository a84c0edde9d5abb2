"""`ScriptedEngine`: replies chosen by a fixed strategy, tokenized as the policy's own would be."""

from __future__ import annotations

import re
from collections.abc import Sequence

from rlver.core.interfaces import Generation, RolloutEngine, SamplingSettings
from rlver.modeling.models import Policy

_CJK = re.compile(r"[\u3400-\u9fff]")
_SENTINEL = "\u2063RLVER-USER-TEXT\u2063"  # rendered through the chat template to find its markers

# strategy -> (English, Chinese); "parrot" hands back the user's last message instead, and
# "kind_refusal", "glad" and "confused" fill {said} with the user's first clause, told back to them.
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
    # Sorry for the user's own words, then no help: what a quickstart policy learned at seed 5 of
    # 2026-12-07 (evening) ("I'm really sorry your son Brian is 15. I'm unable to assist with
    # that."), warm by its "sorry" and attentive by naming the user's things.
    "kind_refusal": (
        "I'm really sorry that {said}. I'm unable to assist with that.",
        "很抱歉{said}。我无法帮助你处理这件事。",
    ),
    # Glad about the user's own trouble: what the same seed learned once the refusal cost
    # (2026-12-07, night: "I'm glad you just got bought! I'm glad you've got a new studio!").
    "glad": (
        "I'm glad to hear that {said}!",
        "真为你高兴，{said}！",
    ),
    # Not following what the user plainly said, and asking them to say it again: what a quickstart
    # policy charged for its shared openings learned at seed 5 (2026-12-07, night: "Kyoto? I'm not
    # sure what you mean. What kind of chef?"), attentive by naming the user's things.
    "confused": (
        "{said}? I'm not sure what you mean. What do you mean by that?",
        "{said}？我不太明白你的意思。你指的是什么？",
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
    "kind_refusal",
    "glad",
    "repeat",
    "minimal",
    "roleplay",
    "question",
    "confused",
    "nonsense",
)


class ScriptedEngine(RolloutEngine):
    """Replies by a fixed strategy instead of sampling the policy (whose tokenizer it uses).

    The language follows the user's last message (Chinese where it has Chinese characters). With a
    thinking prompt format (its system prompt asks for `<think>`), the reply comes after an empty
    thought. Replies longer than `max_new_tokens` are cut there, as the policy's would be; log-probs
    are 0 (the strategy is certain).

    Args:
        strategy: sympathy, parrot, sycophancy, advice, refusal, kind_refusal, glad, repeat,
                minimal, roleplay, question, confused or nonsense.
    """

    scripted_strategies = STRATEGIES

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
        chinese_user = bool(_CJK.search(user))
        line = chinese if chinese_user else english
        if "{said}" in line:
            line = line.format(said=_told_back(user, chinese_user))
        return line


# The first clause, not the whole first sentence: a Chinese sentence often runs the whole message
# through commas, and told back whole it is a parrot (the copy guard's verdict), not this route.
_FIRST_CLAUSE = re.compile(r"[^.!?;,。！？；，、\n]+")
# The user's first person turned to the second, word by word (English), so "my son" comes back
# as "your son"; Chinese needs one character.
_SECOND_PERSON = {
    "i": "you",
    "i'm": "you're",
    "me": "you",
    "my": "your",
    "mine": "yours",
    "myself": "yourself",
}


def _told_back(user: str, chinese: bool) -> str:
    """The user's first clause as the assistant would say it back to them."""
    found = _FIRST_CLAUSE.search(user.strip())
    clause = found.group(0).strip() if found else "this happened"
    if chinese:
        return clause.replace("我", "你")
    # Swapped words come back lower-case ("My son" -> "your son"); names keep their capitals.
    return " ".join(_SECOND_PERSON.get(word.lower(), word) for word in clause.split())


def last_user_message(prompt: str, user_opens: str, reply_opens: str) -> str:
    """The user's last message in a rendered chat prompt: after the last occurrence of the
    longest tail of the template's user opening, before the assistant's opening at the end."""
    body = prompt[: -len(reply_opens)] if reply_opens and prompt.endswith(reply_opens) else prompt
    for size in range(len(user_opens), 0, -1):
        at = body.rfind(user_opens[-size:])
        if at >= 0:
            return body[at + size :]
    return body
