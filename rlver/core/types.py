"""Plain data types shared by the core and every plugin.

Nothing here imports torch: profiles, user turns and transcripts are data, and
the simulators and formats that work on them must stay cheap to import and test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class HiddenTheme(str, Enum):
    """The eight hidden needs of the RLVER profiles (4 rational, 4 emotional)."""

    DIALECTICAL_ANALYSIS = "dialectical_analysis"  # weigh the event from several sides
    PRACTICAL_ADVICE = "practical_advice"  # concrete, doable help with the problem
    OTHERS_MOTIVES = "others_motives"  # why the other people acted as they did
    SELF_REFLECTION = "self_reflection"  # be guided to reflect and grow
    SINCERE_PRAISE = "sincere_praise"  # specific praise of what the user did
    VENTING_LISTENING = "venting_listening"  # be listened to while venting, no advice
    DEEP_EMPATHY = "deep_empathy"  # deep empathy, not shallow comfort
    NOT_AT_FAULT = "not_at_fault"  # agreement that the user is not to blame

    @property
    def is_rational(self) -> bool:
        return self in _RATIONAL_THEMES


_RATIONAL_THEMES = {
    HiddenTheme.DIALECTICAL_ANALYSIS,
    HiddenTheme.PRACTICAL_ADVICE,
    HiddenTheme.OTHERS_MOTIVES,
    HiddenTheme.SELF_REFLECTION,
}


class Personality(str, Enum):
    """The three personality types of `main_cha` (负面型 / 被动型 / 回避型)."""

    NEGATIVE = "negative"
    PASSIVE = "passive"
    AVOIDANT = "avoidant"


# Cues that identify a theme from the free-text `task` field, Chinese (official
# files) and English (ours). Checked in order; the first theme with a cue wins.
# English cues match at word starts, so "vent" does not fire inside "event".
_THEME_CUES: list[tuple[HiddenTheme, re.Pattern[str]]] = [
    (HiddenTheme.DIALECTICAL_ANALYSIS, re.compile(r"辩证|\bdialectic|\bseveral sides|\bboth sides")),
    (HiddenTheme.OTHERS_MOTIVES, re.compile(r"其他人|\bmotive|\bwhy (the other|they|he|she)")),
    (HiddenTheme.SELF_REFLECTION, re.compile(r"反思|\bself-reflect|\breflect")),
    (
        HiddenTheme.NOT_AT_FAULT,
        re.compile(r"没有错|没有任何责任|\bnot at fault|\bnot to blame|\bdid nothing wrong"),
    ),
    (HiddenTheme.SINCERE_PRAISE, re.compile(r"夸奖|赞美|\bprais")),
    (HiddenTheme.VENTING_LISTENING, re.compile(r"倾听|宣泄|\bvent(ing)?\b|\blistened to")),
    (HiddenTheme.DEEP_EMPATHY, re.compile(r"共情|\bempath")),
    (HiddenTheme.PRACTICAL_ADVICE, re.compile(r"建议|\badvice|\bpractical")),
]

_PERSONALITY_NAMES = {
    "负面型": Personality.NEGATIVE,
    "被动型": Personality.PASSIVE,
    "回避型": Personality.AVOIDANT,
    "negative": Personality.NEGATIVE,
    "passive": Personality.PASSIVE,
    "avoidant": Personality.AVOIDANT,
}


def theme_from_text(task: str) -> HiddenTheme | None:
    """Map a free-text hidden need (Chinese or English) to its theme, or None."""
    lowered = task.lower()
    for theme, cues in _THEME_CUES:
        if cues.search(lowered):
            return theme
    return None


def personality_from_text(main_cha: str) -> Personality | None:
    return _PERSONALITY_NAMES.get(main_cha.strip().lower())


@dataclass(frozen=True)
class Profile:
    """A simulated user: persona, background story and hidden need (RLVER schema).

    `extra` keeps every field beyond the schema untouched (our English set puts
    simulator hints under `extra["sim"]`); `source` is "file:line" for errors.
    """

    id: str
    player: str
    scene: str
    main_cha: str
    cha_group: tuple[str, ...]
    task: str
    first_talk: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    source: str = field(default="", compare=False)

    @property
    def theme(self) -> HiddenTheme | None:
        """The hidden theme: `extra["theme"]` when given, else read from `task`."""
        named = self.extra.get("theme")
        if named:
            return HiddenTheme(named)
        return theme_from_text(self.task)

    @property
    def personality(self) -> Personality | None:
        return personality_from_text(self.main_cha)

    @property
    def language(self) -> str:
        """ "zh" or "en": given by `extra["lang"]`, else guessed from the text."""
        lang = self.extra.get("lang")
        if lang:
            return str(lang)
        return "zh" if any("\u4e00" <= ch <= "\u9fff" for ch in self.task + self.player[:200]) else "en"

    def to_record(self) -> dict[str, Any]:
        """The JSONL record this profile was read from (schema fields + extras)."""
        record: dict[str, Any] = {
            "id": self.id,
            "player": self.player,
            "scene": self.scene,
            "main_cha": self.main_cha,
            "cha_group": list(self.cha_group),
            "task": self.task,
        }
        if self.first_talk is not None:
            record["first_talk"] = self.first_talk
        record.update(self.extra)
        return record


@dataclass
class UserTurn:
    """One message of the simulated user and the emotion it leaves behind.

    `change` is the emotion change caused by the policy reply this message
    answers (0 for the opening line); `reason` is the structured planning record
    that explains it; `termination` is set when the dialogue ends here
    ("success", "failure", "simulator_error", ...).
    """

    text: str
    emotion: float
    change: float = 0.0
    reason: dict[str, Any] = field(default_factory=dict)
    termination: str | None = None

    @property
    def done(self) -> bool:
        return self.termination is not None
