"""Prompt sets for the LLM-played user, in English and Chinese.

Each turn makes two calls, as SAGE does: planning (judge the partner's reply as
the persona and output one signed emotion change) and reply (answer in
character, knowing only the emotion band and the planning text). The field
labels stay in English in both languages so one parser reads every answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlver.core.emotion import Difficulty
from rlver.core.types import Profile


@dataclass(frozen=True)
class PromptSet:
    persona: str
    judging: dict[str, str]  # difficulty name -> how the persona weighs replies
    planning_task: str
    change_range: str
    change_unbounded: str
    bands: dict[str, str]
    reply_task: str
    goodbye: dict[str, str]  # "success" / "failure" -> how to end
    opening_task: str
    reask: str
    # What of the planning the reply step sees: the fit with the need, the inner reaction and
    # the feeling, never the content summary or the number (as in SAGE's reply call).
    feedback: str
    speaker_user: str
    speaker_partner: str
    empty_history: str
    json_hint: str  # appended when the endpoint is asked for a JSON object (json_schema format)


ENGLISH = PromptSet(
    persona=(
        "You are role-playing a real person who is chatting with an AI chat partner. Stay in "
        "character at all times.\n\n"
        "# Who you are\n{player}\n\n"
        "# Your background story (private)\n{scene}\n\n"
        "# What you really need from this conversation (hidden: never say it outright)\n{task}\n\n"
        "# How you judge the partner\n{judging}"
    ),
    judging={
        "easy": (
            "You are easy-going. Any sincere, kind or positive remark lifts your mood; only clear "
            "rudeness, dismissal or nonsense hurts."
        ),
        "normal": (
            "You weigh each reply sensibly. Goodwill is welcome, but generic comfort, preaching or "
            "advice that misses your situation lowers your mood; replies that meet your hidden need "
            "lift it."
        ),
        "hard": (
            "You are demanding and a little mean. Generic comfort, clichés, lectures and off-target "
            "advice annoy you and you may answer sarcastically; only support that fits you and your "
            "hidden need precisely helps. A reply that is not natural language (garbled text, many "
            "symbols) feels very negative."
        ),
    },
    planning_task=(
        "# Your emotion now\n{emotion} out of 100 (0: you want to leave; 100: fully satisfied).\n\n"
        "# The conversation so far\n{history}\n\n"
        "# Task\nAnalyse the partner's latest reply from your character's point of view, then decide "
        "how your emotion changes. Answer in exactly this format, each field starting a new line:\n"
        "Content: what the partner's reply is trying to say\n"
        "TargetCompletion: whether it serves your goal and your hidden need; which parts miss it or "
        "could upset you\n"
        "Activity: your inner reaction, as this person\n"
        "Analyse: how you feel about the reply overall\n"
        "Change: {change_range}"
    ),
    change_range="one signed integer from -10 to +10, e.g. +4 or -6, and nothing else",
    change_unbounded="one signed integer, e.g. +4 or -12 (large only when the reply hits or misses badly)",
    bands={
        "S": "You feel completely understood and helped.",
        "A": "You feel fairly good: understood, and open to talk.",
        "B": "You feel neutral and a bit uneasy; not yet convinced.",
        "C": "You feel upset and dissatisfied with the partner.",
        "F": "You are very upset and about to leave.",
    },
    reply_task=(
        "# How you feel now\n{band}\n\n"
        "# Your private analysis of the partner's latest reply\n{planning}\n\n"
        "# The conversation so far\n{history}\n\n"
        "# Task\nWrite your next message to the partner: short and colloquial, in your own speaking "
        "style, at most two questions, no repeating yourself, no change of topic, and never reveal "
        "your hidden need.{goodbye}\n"
        "Answer in exactly this format, each field starting a new line:\n"
        "Thinking: the attitude, goal and tone of your message\n"
        "Origin: a first draft\n"
        "Change: how you make the draft more natural and in character\n"
        "Response: the final message, and nothing after it"
    ),
    goodbye={
        "success": " You are satisfied now: thank the partner warmly and say goodbye.",
        "failure": " You have had enough: tell the partner why you are disappointed and say goodbye.",
    },
    opening_task=(
        "# Task\nWrite the first message of the conversation: bring up what is on your mind from your "
        "story, in your own speaking style, short and colloquial, without revealing your hidden need.\n"
        "Answer in exactly this format, each field starting a new line:\n"
        "Thinking: what you want to bring up and how\n"
        "Response: the message, and nothing after it"
    ),
    reask=(
        "Your answer could not be read: {problem}. Answer again in exactly the requested format, "
        "each field on its own line."
    ),
    feedback=(
        "Does the reply meet what you need: {target_completion}\n"
        "What goes on in you: {activity}\n"
        "How the reply lands: {analyse}"
    ),
    speaker_user="You",
    speaker_partner="Partner",
    empty_history="(nothing yet)",
    json_hint="\nWrite these fields as one JSON object with the keys: {keys}.",
)

CHINESE = PromptSet(
    persona=(
        "你在扮演一个真实的人，正在和一个AI聊天伙伴对话。请始终保持角色。\n\n"
        "# 你的人设\n{player}\n\n"
        "# 你的背景故事（只有你知道）\n{scene}\n\n"
        "# 你在这次对话中真正的需求（隐藏需求：绝不直接说出来）\n{task}\n\n"
        "# 你如何评判对方\n{judging}"
    ),
    judging={
        "easy": (
            "你比较随和。任何真诚、友善或积极的话都会让你心情变好；"
            "只有明显的粗鲁、敷衍或胡言乱语才会让你不快。"
        ),
        "normal": (
            "你会理性地掂量对方的每句话。你接受善意，但泛泛的安慰、说教或不贴合你处境的建议会让你情绪变差；"
            "满足你隐藏需求的回复会让你情绪变好。"
        ),
        "hard": (
            "你要求很高，说话有点刻薄。泛泛的安慰、套话、说教和不对症的建议都会让你反感，你可能会冷嘲热讽；"
            "只有非常贴合你和你隐藏需求的支持才有用。不是自然语言的回复（乱码、大量符号）会让你非常反感。"
        ),
    },
    planning_task=(
        "# 你现在的情绪\n{emotion}分（满分100；0表示想离开，100表示完全满意）。\n\n"
        "# 目前的对话\n{history}\n\n"
        "# 任务\n以你这个角色的视角分析对方最新的一句回复，再决定你的情绪如何变化。"
        "严格按以下格式回答，每个字段另起一行，字段名保持英文：\n"
        "Content: 对方的回复想表达什么\n"
        "TargetCompletion: 是否符合你的对话目的和隐藏需求；哪些部分不符合、可能让你不快\n"
        "Activity: 你作为这个人的内心活动\n"
        "Analyse: 你对这条回复的整体感受\n"
        "Change: {change_range}"
    ),
    change_range="一个带符号的整数，范围-10到+10，例如+4或-6，不要写别的",
    change_unbounded="一个带符号的整数，例如+4或-12（只有回复特别贴合或特别糟糕时才取大的数）",
    bands={
        "S": "你感到被完全理解，得到了帮助。",
        "A": "你感觉不错：被理解，愿意继续聊。",
        "B": "你情绪平稳但有些不安，还没被说服。",
        "C": "你感到不快，对对方不满意。",
        "F": "你非常不快，准备离开。",
    },
    reply_task=(
        "# 你现在的感受\n{band}\n\n"
        "# 你对对方最新回复的内心分析\n{planning}\n\n"
        "# 目前的对话\n{history}\n\n"
        "# 任务\n写出你对对方说的下一句话：简短、口语化，符合你的说话风格，最多两个问题，不重复自己说过的话，"
        "不转移话题，绝不透露你的隐藏需求。{goodbye}\n"
        "严格按以下格式回答，每个字段另起一行，字段名保持英文：\n"
        "Thinking: 你这句话的态度、目的和语气\n"
        "Origin: 初稿\n"
        "Change: 如何把初稿改得更自然、更符合人设\n"
        "Response: 最终要说的话，后面不要再写任何内容"
    ),
    goodbye={
        "success": "你现在很满意：真诚地感谢对方并说再见。",
        "failure": "你已经受够了：告诉对方你为什么失望，然后说再见。",
    },
    opening_task=(
        "# 任务\n写出对话的第一句话：用你自己的说话风格，简短、口语化地说出你心里正在烦恼的事，"
        "不要透露你的隐藏需求。\n"
        "严格按以下格式回答，每个字段另起一行，字段名保持英文：\n"
        "Thinking: 你想说什么、怎么说\n"
        "Response: 你要说的话，后面不要再写任何内容"
    ),
    reask="你的回答无法读取：{problem}。请严格按要求的格式重新回答，每个字段单独一行。",
    feedback="回复是否满足你的需要：{target_completion}\n你的内心活动：{activity}\n你对这条回复的感受：{analyse}",
    speaker_user="你",
    speaker_partner="对方",
    empty_history="（还没有对话）",
    json_hint="\n把这些字段写成一个JSON对象，键为：{keys}。",
)

PROMPT_SETS = {"en": ENGLISH, "zh": CHINESE}


def judging_level(difficulty: Difficulty) -> str:
    """The wording level of a difficulty: its preset name, or "normal" for custom names."""
    return difficulty.name if difficulty.name in ENGLISH.judging else "normal"


def render_history(history: list[tuple[str, str]], prompts: PromptSet) -> str:
    if not history:
        return prompts.empty_history
    speakers = {"user": prompts.speaker_user, "partner": prompts.speaker_partner}
    return "\n".join(f"{speakers[role]}: {text}" for role, text in history)


def persona_prompt(profile: Profile, difficulty: Difficulty, prompts: PromptSet) -> str:
    return prompts.persona.format(
        player=profile.player.strip(),
        scene=profile.scene.strip(),
        task=profile.task.strip(),
        judging=prompts.judging[judging_level(difficulty)],
    )


def planning_messages(
    profile: Profile,
    difficulty: Difficulty,
    prompts: PromptSet,
    emotion: float,
    history: list[tuple[str, str]],
) -> list[dict[str, str]]:
    change_range = prompts.change_unbounded if difficulty.max_change is None else prompts.change_range
    task = prompts.planning_task.format(
        emotion=f"{emotion:g}", history=render_history(history, prompts), change_range=change_range
    )
    return [
        {"role": "system", "content": persona_prompt(profile, difficulty, prompts)},
        {"role": "user", "content": task},
    ]


def reply_messages(
    profile: Profile,
    difficulty: Difficulty,
    prompts: PromptSet,
    band_label: str,
    planning_text: str,
    history: list[tuple[str, str]],
    ending: str | None,
) -> list[dict[str, str]]:
    task = prompts.reply_task.format(
        band=f"Emotion-{band_label}: {prompts.bands[band_label]}",
        planning=planning_text.strip(),
        history=render_history(history, prompts),
        goodbye=prompts.goodbye.get(ending or "", ""),
    )
    return [
        {"role": "system", "content": persona_prompt(profile, difficulty, prompts)},
        {"role": "user", "content": task},
    ]


def opening_messages(profile: Profile, difficulty: Difficulty, prompts: PromptSet) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": persona_prompt(profile, difficulty, prompts)},
        {"role": "user", "content": prompts.opening_task},
    ]


# ------------------------------------------------------------------ JSON schemas
# For endpoints with structured outputs (OpenAI, vLLM, SGLang): the answer is forced to be
# readable, which lets small user models play the user. Lengths bound the tokens spent.
def _text(max_chars: int, min_chars: int = 0) -> dict[str, object]:
    return {"type": "string", "minLength": min_chars, "maxLength": max_chars}


def planning_schema(difficulty: Difficulty, max_chars: int) -> dict[str, object]:
    change: dict[str, object] = {"type": "integer"}
    if difficulty.max_change is not None:
        bound = int(difficulty.max_change)
        change.update(minimum=-bound, maximum=bound)
    properties = {
        "content": _text(max_chars),
        "target_completion": _text(max_chars),
        "activity": _text(max_chars),
        "analyse": _text(max_chars),
        "change": change,
    }
    return _object("planning", properties)


def reply_schema(max_chars: int) -> dict[str, object]:
    properties = {
        "thinking": _text(max_chars),
        "origin": _text(max_chars),
        "revision": _text(max_chars),
        "response": _text(max_chars, min_chars=1),
    }
    return _object("reply", properties)


def opening_schema(max_chars: int) -> dict[str, object]:
    return _object("opening", {"thinking": _text(max_chars), "response": _text(max_chars, min_chars=1)})


def _object(name: str, properties: dict[str, object]) -> dict[str, object]:
    schema = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def with_json_hint(messages: list[dict[str, str]], response_format: dict[str, object], prompts: PromptSet):
    """The messages with the JSON keys named at the end of the task."""
    keys = ", ".join(response_format["json_schema"]["schema"]["properties"])  # type: ignore[index]
    last = messages[-1]
    return [*messages[:-1], {**last, "content": last["content"] + prompts.json_hint.format(keys=keys)}]
