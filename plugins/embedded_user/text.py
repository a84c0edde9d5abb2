"""Language-aware text measures: words, content words, overlap, garble and length.

English is measured in words; Chinese, which has no spaces, in characters:
its "content units" are character bigrams without function characters
(李明, 婚姻), which line up well enough with words for overlap counting.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter

_CJK = re.compile(r"[\u4e00-\u9fff]")
_CJK_RUN = re.compile(r"[\u4e00-\u9fff]+")
_LATIN_LETTER = re.compile(r"[a-z]")
_EN_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")
_QUESTION_SPAN = re.compile(r"[^.!?。！？\n]*[?？]")
_OPEN_QUESTION_EN = re.compile(r"(?<![a-z])(what|how|why|which|when|where|who|tell me)(?![a-z])")
_OPEN_QUESTION_ZH = re.compile(r"什么|怎么|为什么|哪|如何|怎样|多少|说说|聊聊|讲讲")


def word_set(text: str) -> frozenset[str]:
    """The whitespace-separated words of a block of text, for long word lists."""
    return frozenset(text.split())


_EN_STOPWORDS = word_set(
    """
    a about above after again against all also am an and any are aren't as at be because been before
    being below between both but by can can't could couldn't did didn't do does doesn't doing don't
    down during each even ever every few for from further get gets got had hadn't has hasn't have
    haven't having he he'd he'll he's her here hers herself him himself his how i i'd i'll i'm i've
    if in into is isn't it it's its itself just know let's like made make many me might more most
    much must my myself no nor not now of off on once only or other our ours ourselves out over own
    really said same say says she she'd she'll she's should shouldn't so some such than that that's
    the their theirs them themselves then there there's these they they'd they'll they're they've
    thing things think this those though through to too under until up upon us very want was wasn't
    way we we'd we'll we're we've well were weren't what what's when where which while who whom why
    will with won't would wouldn't yeah yes yet you you'd you'll you're you've your yours yourself
    yourselves feel feels felt sounds sound something anything everything nothing someone anyone lot
    lots still back going gonna tell told time maybe sure okay right
    """
)

# Characters that make a bigram a function-word bigram rather than content.
_ZH_STOP_CHARS = frozenset(
    "的了是在我你他她它们这那有和也就都不没会要个一吗呢吧啊呀么着过被把给让对很太还又再说跟与及而但却所以因为如果自己什怎样很得地之其"
)

_ZH_FUNCTION_CHARS = frozenset("的了是我你在不有这吗呢吧啊他她也就都很")

# Letter pairs common in English words. Keyboard mash ("asdkj zxcvb") is mostly
# made of other pairs, while real text rarely has more than a few.
_COMMON_EN_BIGRAMS = word_set(
    """
    th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io le ve co
    me de hi ri ro ic ne ea ra ce li ch ll be ma si om ur ca el ta la ns di fo ho pe ec pr no ct us
    ac ot il tr ly nc et ut ss so rs un lo wa ge ie wh ee wi em ad ol rt po we na ul ni ts mo ow pa
    im mi ai sh ir su id os iv ia am fi ci vi pl ig tu ev ld ry mp fe bl ab gh ty op wo sa ay ex ke
    fr oo av ag if ap gr od bo sp rd do uc bu ei ov by rm ep tt oc fa ef cu rn sc gi da yo cr cl du
    ga qu ue ff ba ey ls va um pp ua up lu go ht ru ug ds lt pi rc rr eg au ck ew mu br bi pt ak pu
    ui rg ib tl ny ki rk ys ob mm fu ph og ms ye ud mb ip ub oi rl gu dr hr cc tw ft wn nu af hu nn
    eo vo rv nf xp gn sm fl iz ok nl my gl aw ju oa sy sl ps jo lf nv je nk kn gs dy hy ze ks xt bs
    ik dd cy rp sk xi oe oy ws lv dl rf eu dg wr xa yi nm eb rb tm gy ja hn yp za ny oh ah mb lk
    """
)


def normalize(text: str) -> str:
    """Lowercase with typographic quotes straightened, so cues match one spelling."""
    return (
        text.replace("\u2019", "'")
        .replace("\u2018", "'")
        .replace("\u201c", '"')
        .replace("\u201d", '"')
        .lower()
    )


def english_words(text: str) -> list[str]:
    return _EN_WORD.findall(normalize(text))


def stem(word: str) -> str:
    """A crude suffix strip so "weddings"/"wedding", "planned"/"plan" meet."""
    word = word.removesuffix("'s")
    for suffix in ("ing", "ed", "es", "s", "ly"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)]
            break
    if len(word) >= 4 and word[-1] == word[-2]:  # planned -> plann -> plan
        word = word[:-1]
    return word


def cjk_count(text: str) -> int:
    return len(_CJK.findall(text))


def content_units(text: str, language: str) -> set[str]:
    """The content words of `text` (stemmed English words, Chinese content bigrams)."""
    units = {stem(w) for w in english_words(text) if len(w) >= 3 and w not in _EN_STOPWORDS}
    if language == "zh":
        units |= set(chinese_content_bigrams(text))
    return units


def chinese_bigrams(text: str) -> list[str]:
    bigrams: list[str] = []
    for run in _CJK_RUN.findall(text):
        bigrams.extend(run[i : i + 2] for i in range(len(run) - 1))
    return bigrams


def chinese_content_bigrams(text: str) -> list[str]:
    """Chinese bigrams without function characters: 李明, 婚姻, but not 我的."""
    return [bigram for bigram in chinese_bigrams(text) if not set(bigram) & _ZH_STOP_CHARS]


def shingles(text: str, language: str) -> set[tuple[str, ...]]:
    """Three-unit shingles: word trigrams (English) or character trigrams (Chinese)."""
    if language == "zh" and cjk_count(text) > english_word_count(text):
        units: list[str] = _CJK.findall(text)
    else:
        units = english_words(text)
    if len(units) < 3:
        return {tuple(units)} if units else set()
    return {tuple(units[i : i + 3]) for i in range(len(units) - 2)}


def similarity_units(text: str, language: str) -> set[str]:
    """The units compared for near-duplicates: all words, or all Chinese bigrams."""
    if language == "zh" and cjk_count(text) > english_word_count(text):
        return set(chinese_bigrams(text))
    return set(english_words(text))


def jaccard(a: set, b: set) -> float:
    if not a or not b:
        return 0.0
    return len(a & b) / len(a | b)


def english_word_count(text: str) -> int:
    return len(english_words(text))


def length_in_words(text: str, language: str) -> float:
    """Length in English-word equivalents (two Chinese characters count as one word)."""
    if language == "zh":
        return cjk_count(text) / 2 + english_word_count(text)
    return float(english_word_count(text))


def questions(text: str) -> list[str]:
    """The question sentences of `text`."""
    return [span.strip() for span in _QUESTION_SPAN.findall(normalize(text)) if span.strip(" ?？")]


def is_open_question(question: str) -> bool:
    return bool(_OPEN_QUESTION_EN.search(question) or _OPEN_QUESTION_ZH.search(question))


_KEYBOARD_ROWS = ("qwertyuiop", "asdfghjkl", "zxcvbnm")


def _plausible_english_word(word: str) -> bool:
    if len(word) <= 2:
        return True
    if len(word) >= 4 and any(word in row or word in row[::-1] for row in _KEYBOARD_ROWS):
        return False
    if not re.search(r"[aeiouy]", word):
        return False
    if re.search(r"[^aeiouy']{5,}", word):  # "sdfgh"; real words stop at four ("strengths" aside)
        return False
    if re.search(r"(.)\1\1", word):
        return False
    return len(word) <= 20


def garble_reason(text: str, language: str) -> str | None:
    """Why `text` is not usable language ("empty", "symbols", ...), or None when it is."""
    visible = "".join(text.split())
    if not visible:
        return "empty"
    letters = [ch for ch in visible if ch.isalpha()]
    if len(letters) < 0.5 * len(visible):
        return "symbols"
    cjk = cjk_count(visible)
    latin = len(_LATIN_LETTER.findall(visible.lower()))
    if language == "zh":
        if cjk < 0.2 * len(letters) and latin >= 10:
            return "wrong_script"
    elif latin < 0.5 * len(letters):
        return "wrong_script"
    if language == "zh" and cjk >= latin:
        return _chinese_garble(visible)
    return _english_garble(english_words(text))


def _english_garble(words: list[str]) -> str | None:
    if not words:
        return "symbols"
    if _repeats(words):
        return "repeated_tokens"
    implausible = sum(not _plausible_english_word(w) for w in words)
    pairs = [w[i : i + 2] for w in words for i in range(len(w) - 1) if "'" not in w[i : i + 2]]
    uncommon = sum(pair not in _COMMON_EN_BIGRAMS for pair in pairs)
    if implausible / len(words) >= 0.4 or (len(pairs) >= 6 and uncommon / len(pairs) >= 0.35):
        return "random_characters"
    if len(words) >= 6 and not set(words) & _EN_STOPWORDS:  # no function word at all
        return "word_salad"
    return None


def _chinese_garble(visible: str) -> str | None:
    chars = _CJK.findall(visible)
    if _repeats(chars):
        return "repeated_tokens"
    if len(chars) >= 12 and not set(chars) & _ZH_FUNCTION_CHARS:
        return "word_salad"
    return None


def _repeats(units: list[str]) -> bool:
    """One unit dominating a short text, or a long text looping over the same phrases.

    Distinct-trigram share, not distinct-unit share: a long natural text reuses
    its words (and Chinese its characters) a lot, but rarely a three-unit run.
    """
    if len(units) >= 4 and Counter(units).most_common(1)[0][1] / len(units) > 0.4:
        return True
    if len(units) < 12:
        return False
    trigrams = [tuple(units[i : i + 3]) for i in range(len(units) - 2)]
    return len(set(trigrams)) / len(trigrams) < 0.5


# What ends a sentence, and what may close it after its mark (quotes, brackets).
_SENTENCE_END_MARKS = ".!?\u2026\u3002\uff01\uff1f~\uff5e"
_CLOSING_MARKS = "\"')]}\u00bb\u201d\u2019\u300d\u300f\uff09\u3011"


def breaks_off(text: str) -> bool:
    """True when `text` stops mid-sentence, as a reply cut at a token limit does: its last visible
    character (closing quotes and brackets aside) is no sentence mark and no symbol (an emoji
    ends a line as a full stop does). A colon counts as breaking off: what it announced never came."""
    body = text.rstrip()
    while body and body[-1] in _CLOSING_MARKS:
        body = body[:-1].rstrip()
    if not body:
        return False
    last = body[-1]
    return last not in _SENTENCE_END_MARKS and unicodedata.category(last) not in ("So", "Sk")
