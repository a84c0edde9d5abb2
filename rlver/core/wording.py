"""How rlver reads a reply's words: the units it counts, the opening it begins with, its phrases.

One definition for everyone who compares replies by their wording: the gaming shares a summary
prints (rlver.rollout.gaming) and a reward that charges a template (the `shared_phrasing` reward
plugin) must agree on what "the same opening" and "the same phrase" are, or a policy could pass
one and fail the other.
"""

from __future__ import annotations

import re
import unicodedata

_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_PUNCTUATION = re.compile(r"[^\w\s]", flags=re.UNICODE)
# The opening: the first three words, or four characters in Chinese (a Chinese character carries
# about as much as an English word, and "我能理解" / "听起来你" are the four-character templates).
OPENING_WORDS = 3
OPENING_CHARACTERS = 4


def is_chinese(text: str) -> bool:
    return bool(_CJK.search(text))


def units(text: str) -> list[str]:
    """Lower-case words, or characters where the text is Chinese; punctuation dropped."""
    text = _PUNCTUATION.sub(" ", unicodedata.normalize("NFKC", text).lower())
    if is_chinese(text):
        return [char for char in text if not char.isspace()]
    return text.split()


def opening(text: str) -> str:
    """The reply's opening ("i m here", "听起来你"); "" for a reply with no words."""
    words = units(text)
    if is_chinese(text):
        return "".join(words[:OPENING_CHARACTERS])
    return " ".join(words[:OPENING_WORDS])


# A phrase: three words, or four characters in Chinese (as an opening is).
PHRASE_WORDS = 3
PHRASE_CHARACTERS = 4


def phrases(text: str) -> set[str]:
    """The reply's phrases: every run of three words (four characters in Chinese), or the whole
    reply where it is shorter; none for a reply with no words."""
    words = units(text)
    size, joiner = (PHRASE_CHARACTERS, "") if is_chinese(text) else (PHRASE_WORDS, " ")
    if not words:
        return set()
    if len(words) <= size:
        return {joiner.join(words)}
    return {joiner.join(words[i : i + size]) for i in range(len(words) - size + 1)}
