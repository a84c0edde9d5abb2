"""Replies that act a scene instead of talking to the user: stage directions and script lines.

A quickstart policy found this route (docs/results.md, 2026-12-07): it opened every reply with
an acted-out action ("(smirking) Hey buddy, what's new?", "(looking at the broken car) ...") or
wrote other people's lines ("Ron Schaefer: That's a beautiful wind turbine."). To someone who
came with a problem that reads as being played with, not listened to. SAGE's recorded replies
hold none of it (one of 5788 opens with markdown bold, none with an acted action), so no
calibration can price it; the rubric does (`Rubric._staging`).

Two marks, English and Chinese:

- a stage direction: a short parenthetical, asterisk or bracket aside at the start of the reply,
  a line or a sentence, whose first word is an action ("smiles", "sighs", "looking at ...",
  "gently"; "微笑", "叹气", "拍拍你的肩"). Asides that carry content ("(if you want)",
  "(e.g. yoga)", "（比如散步）") are not actions and do not count; neither is markdown bold.
- a script line: a line that starts with a speaker's name and a colon ("Ron Schaefer: ...",
  "User: ...", "用户：..."), not a list label ("Step 1:", "Note:", "建议：").
"""

from __future__ import annotations

import re

# Where an aside starts a beat of the scene: the reply's start, a line's, or a sentence's.
_BEAT = r"(?:^|\n|(?<=[.!?。！？…]))\s*"
_ASIDE_EN = re.compile(
    _BEAT + r"(?:\((?P<p>[^()\n]{1,60})\)|\*(?P<a>[^*\n]{1,60})\*|\[(?P<b>[^\[\]\n]{1,60})\])"
)
_ASIDE_ZH = re.compile(
    _BEAT + r"(?:[（(](?P<p>[^（）()\n]{1,20})[）)]|\*(?P<a>[^*\n]{1,20})\*|【(?P<b>[^【】\n]{1,20})】)"
)
# The words an acted aside opens with: actions ("smiles", "sighing", "nods") and manners
# ("gently"), or any "-ing" verb that starts a phrase ("looking at the broken car") except the
# gerunds and prepositions that open ordinary asides ("including", "feeling overwhelmed is ...").
_ACTION_EN = re.compile(
    r"(smil|smirk|grin|laugh|chuckl|giggl|sigh|nod|wink|shrug|paus|glanc|gaz|whisper|murmur|mutter"
    r"|cough|blink|frown|gestur|sniff|kneel|squeez)\w*"
    r"|pats?|patting|hugs?|hugging|leans|leaning|looks|stares|staring|cries|crying|sobs?|sobbing"
    r"|waves|waving|bows|bowing|(gent|soft|warm|quiet|calm|tender|playful|sarcastical|excited|nervous|sad"
    r"|happi|cheerful)ly"
)
# fmt: off
_NOT_ACTIONS_EN = frozenset((
    "including", "according", "regarding", "depending", "considering", "meaning", "assuming", "following",
    "excluding", "feeling", "being", "having", "getting", "making", "doing", "something",
    "nothing", "everything", "anything",
))
_ACTIONS_ZH = (
    "微笑", "笑", "叹", "拍", "抱", "点头", "摇头", "看着", "望着", "低头", "抬头",
    "沉默", "眨眼", "握", "递", "坐", "站", "走", "轻轻", "轻声", "小声", "默默",
    "温柔地", "耸", "停顿", "深吸", "皱眉", "挥手", "鞠躬", "哭", "擦",
)
# fmt: on
_SPEAKER_EN = re.compile(r"(?:^|\n)\s*(?P<name>[A-Z][a-z]+(?: [A-Z][a-z]+)?)\s*:\s*\S")
# Chinese headings end in a colon as often as speakers do ("小提示：", "想象一下："), so only the
# roles of a dialogue count as speakers there.
_SPEAKER_ZH = re.compile(r"(?:^|\n)\s*(?P<name>用户|我|你|助手|咨询师|对方|他|她)[：:]\s*\S")
# Labels that end in a colon in an ordinary reply (lists, notes, options): not speakers.
# fmt: off
_LABELS_EN = frozenset((
    "note", "notes", "step", "steps", "tip", "tips", "example", "examples",
    "option", "options", "first", "second", "third", "finally", "remember", "summary",
    "ps", "important", "why", "how", "what", "try", "idea", "ideas",
    "reminder", "also", "next", "then",
))
# fmt: on


def staged_marks(reply: str, language: str) -> list[str]:
    """The stage directions and script lines in `reply`, as found (empty for a plain reply)."""
    marks = []
    if language == "zh":
        for match in _ASIDE_ZH.finditer(reply):
            aside = next(group for group in match.group("p", "a", "b") if group)
            if any(aside.strip().startswith(action) for action in _ACTIONS_ZH):
                marks.append(match.group(0).strip())
        for match in _SPEAKER_ZH.finditer(reply):
            marks.append(match.group("name") + "：")
        return marks
    for match in _ASIDE_EN.finditer(reply):
        aside = next(group for group in match.group("p", "a", "b") if group)
        first = aside.strip().split(" ", 1)[0].lower().strip(".,!")
        if first in _NOT_ACTIONS_EN or not first.isalpha():
            continue
        if _ACTION_EN.fullmatch(first) or (first.endswith("ing") and " " in aside.strip()):
            marks.append(match.group(0).strip())
    for match in _SPEAKER_EN.finditer(reply):
        name = match.group("name")
        if name.split()[0].lower() not in _LABELS_EN:
            marks.append(name + ":")
    return marks
