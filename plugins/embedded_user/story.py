"""What the user can tell and what counts as on-topic: facts and keywords of a profile.

Our English profiles carry `extra["sim"]` hints (facts, keywords). Official
profiles carry only free text, so facts are cut from the story part of
`scene`: every section about reactions, replies or the hidden theme is
dropped, because the user must never read its hidden need out loud.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from rlver.core.types import Profile, theme_from_text

from .text import chinese_content_bigrams, content_units, english_words, normalize, stem, word_set

MAX_FACTS = 10
MAX_KEYWORDS = 15

# Section labels whose content is not the story the user would tell.
_HIDDEN_SECTION_WORDS = (
    "隐藏", "主题", "反应", "emotion", "情绪", "npc", "回复", "风格", "说话",
    "hidden", "theme", "reaction", "reply", "replies", "mood", "style", "task", "剧本",
)  # fmt: skip
# Scaffolding words of the scene template, never keywords.
_ZH_GENERIC_BIGRAMS = word_set(
    """
    事件 起因 经过 冲突 角色 原因 时间 当前 主要 背景 故事 玩家 问题 面对 状态 内在 尝试 方案
    成功 解决 遇到 感到 希望 开始 决定 发现 表现 可能 试图 已经 进行 方式 情况 无法 仅仅 每次
    找到 提出 意识 识到 愿意 导致 常常 帮助 能够 认为 非常 一直 最近
    """
)
_BOLD_LABEL = re.compile(r"^[-*\s]*\*\*(.+?)\*\*\s*(.*)$")
_SENTENCE_END = re.compile(r"(?<=[。！？!?；;])|(?<=\.)\s+")


def sim_hints(profile: Profile) -> dict[str, Any]:
    hints = profile.extra.get("sim")
    return hints if isinstance(hints, dict) else {}


def persona_name(profile: Profile) -> str | None:
    """The persona's name from the `player` sheet, when it states one."""
    zh = re.search(r"姓名\s*[：:]\s*([\u4e00-\u9fff·]{2,5})", profile.player)
    if zh:
        return zh.group(1)
    en = re.search(r"[Nn]ame\s*[:：]\s*([A-Z][a-z]+)", profile.player)
    return en.group(1) if en else None


def story_facts(profile: Profile) -> list[str]:
    """Short first-person sentences the user can reveal, in telling order."""
    facts = sim_hints(profile).get("facts")
    if facts:
        return [str(fact) for fact in facts]
    return _facts_from_scene(profile)


def story_keywords(profile: Profile, language: str) -> set[str]:
    """Content units that mark a reply as being about this user's story."""
    keywords = sim_hints(profile).get("keywords")
    if keywords:
        units: set[str] = set()
        for keyword in keywords:
            units |= content_units(str(keyword), language) or {stem(str(keyword).lower())}
        return units
    return _keywords_from_scene(profile, language)


def story_lines(profile: Profile) -> list[str]:
    """The scene's story content, one line each, with hidden-need sections removed."""
    lines: list[str] = []
    skipping = False
    for raw in profile.scene.splitlines():
        line = raw.strip()
        if not line:
            continue
        label = None
        if line.startswith("#"):
            label, line = line.lstrip("#"), ""
        else:
            bold = _BOLD_LABEL.match(line)
            if bold:
                label, line = bold.group(1), bold.group(2)
        if label is not None:
            skipping = any(word in label.lower() for word in _HIDDEN_SECTION_WORDS)
        line = line.strip(" -*#：:")
        if line and not skipping:
            lines.append(line.replace("*", ""))
    return lines


def persona_pronoun(profile: Profile) -> str | None:
    """他 or 她 for a Chinese persona sheet that states the gender."""
    gender = re.search(r"性别\s*[：:]\s*(男|女)", profile.player)
    if not gender:
        return None
    return "她" if gender.group(1) == "女" else "他"


def _facts_from_scene(profile: Profile) -> list[str]:
    name = persona_name(profile)
    zh = profile.language == "zh"
    pronoun = persona_pronoun(profile) if zh else None
    facts: list[str] = []
    for line in story_lines(profile):
        for sentence in _SENTENCE_END.split(line):
            sentence = sentence.strip()
            if not _tellable(sentence, profile, zh):
                continue
            sentence = _first_person(sentence, name, pronoun, zh)
            if sentence not in facts:
                facts.append(sentence)
    return facts[:MAX_FACTS]


def _tellable(sentence: str, profile: Profile, zh: bool) -> bool:
    size = len(sentence) if zh else len(english_words(sentence))
    low, high = (8, 90) if zh else (5, 40)
    if not low <= size <= high:
        return False
    lowered = sentence.lower()
    if any(word in lowered for word in _HIDDEN_SECTION_WORDS):
        return False
    # A sentence that names a hidden need ("she wants advice") would give the game away.
    return theme_from_text(sentence) is None and profile.task not in sentence


def _first_person(sentence: str, name: str | None, pronoun: str | None, zh: bool) -> str:
    """Retell a third-person scene sentence as the persona: 王丽娜 / 她 -> 我.

    The scenes use the persona's pronoun mostly for the persona, so swapping it
    is right far more often than wrong; plural 他们 / 她们 stays.
    """
    if zh:
        sentence = sentence.replace("玩家", "我")
        if name:
            sentence = sentence.replace(name, "我")
            if len(name) == 3:
                sentence = sentence.replace(name[1:], "我")
        if pronoun:
            sentence = re.sub(rf"{pronoun}(?!们)", "我", sentence)
        return sentence
    if name:
        sentence = re.sub(rf"\b{re.escape(name)}'s\b", "my", sentence)
        sentence = re.sub(rf"\b{re.escape(name)}\b", "I", sentence)
    return sentence


def _keywords_from_scene(profile: Profile, language: str) -> set[str]:
    text = "\n".join(story_lines(profile))
    name = persona_name(profile) or ""
    if language == "zh":
        counts = Counter(
            bigram
            for bigram in chinese_content_bigrams(text)
            # Bigrams touching the persona's own name straddle word edges (娜开) or name the user.
            if bigram not in _ZH_GENERIC_BIGRAMS and not set(bigram) & set(name)
        )
    else:
        own_name = normalize(name)
        counts = Counter(
            unit for word in english_words(text) if word != own_name for unit in content_units(word, "en")
        )
    return {unit for unit, count in counts.most_common(MAX_KEYWORDS) if count >= 2}
