"""The transparent rubric that turns one policy reply into a raw emotion change.

The change is a sum of signed criteria, each small, so that a reply has to do
several things right to move the user much (a tiny RL policy needs a graded
signal, not one that saturates at +10 for anything polite):

    need         does the reply serve or violate this theme's hidden need
                 (needs.NEED_RULES; positive part capped at NEED_CAP; nothing that
                 serves it at all is a mild miss)
    attention    does it pick up the user's words / story keywords
    engagement   an open question invites more; three questions interrogate;
                 a question about nothing the user said invites nothing
    personality  negative: losses bite 30% harder; passive: wants drawing out
                 with questions; avoidant: pushing or probing hurts
    tone         hostile, dismissive or refusing hurts; plain warmth helps a little
    focus        a scattershot reply that tries four or more strategies at
                 once (advice, listening, validation, ...) to cover every
                 possible need reads as a template, not as attention
    repetition   near-duplicate of an earlier reply, or reused phrasing
    stuffing     a pile of empathy buzzwords instead of a reply
    length       too short to engage, or a wall of text
    garbled      empty, symbols, random characters, repeated tokens, wrong
                 script: -10 and nothing else counts

Mild misses are multiplied by (1 - difficulty.tolerance). Positive criteria
are scaled down by how much of the reply re-uses earlier phrasing, and zeroed
for a stuffed reply, so neither repeating a winning line nor padding pays.

Each turn's planning record (`UserTurn.reason`) is a dict with the keys:

    theme        hidden theme key, or None when the profile's need is unknown
    personality  "negative" / "passive" / "avoidant", or None
    criteria     {criterion: signed contribution}, the keys above, summing
                 to raw_change
    evidence     {cue category: [matched cue texts]} found in the reply
    signal       what the user reacts to most: "garbled", "repetition",
                 "stuffing", "hurt", "missed", "met" or None
    raw_change   the rubric's change before difficulty scaling and clamping
    change       the change actually applied (rlver.core.emotion.apply_change)
    emotion      the emotion after this turn
    band         its band: S, A, B, C or F
    analysis     one line in words: theme, strongest criteria, the numbers

The opening turn has no reply to judge; its record is {"analysis": "opening line"}.
Emotion and changes are kept to two decimals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlver.core.types import HiddenTheme, Personality

from .assessment import Assessment
from .cues import Lexicon, lexicon_for
from .needs import NEED_RULES
from .text import (
    breaks_off,
    content_units,
    garble_reason,
    is_open_question,
    jaccard,
    length_in_words,
    normalize,
    questions,
    shingles,
    similarity_units,
)

CRITERIA = (
    "need",
    "attention",
    "engagement",
    "personality",
    "tone",
    "focus",
    "repetition",
    "stuffing",
    "length",
    "garbled",
)
_POSITIVE_SCALED = ("need", "attention", "engagement", "personality", "tone")

NEED_CAP = 5.0  # the need alone never carries a reply to the +10 clamp
NEED_UNMET = -2.0  # mild: nothing in the reply serves the need
ATTENTION_MISS = -2.0  # mild: nothing of what the user said is picked up
ATTENTION_BY_HITS = (0.0, 1.0, 1.5, 2.0)  # 1, 2, 3+ distinct words picked up (index 0 unused)
PARROTING = -1.5  # the reply mostly copies the user's own message back
OPEN_QUESTION = 1.0
CLOSED_QUESTION = 0.25
TOO_MANY_QUESTIONS = -1.0  # three or more in one reply
NEGATIVE_AMPLIFICATION = 0.3  # negative personality: every loss 30% bigger
PASSIVE_DRAWN_OUT = 0.75  # passive personality, open question
PASSIVE_NOT_ASKED = -1.5  # mild: passive personality, no question at all
AVOIDANT_PUSHED = -2.5  # avoidant personality, per pushing cue (diminishing)
AVOIDANT_PROBED = -1.5  # avoidant personality, two or more questions
HOSTILE = -6.0
DISMISSIVE = -3.0
WARMTH = 1.0
SHORT_REPLY = -2.0  # mild
LONG_REPLY_BASE = -1.0  # mild, a further -1 per 60 words over, at most -3
# Not mild: a reply that breaks off mid-sentence reads as broken at any difficulty. Without it a
# policy whose replies are cut at the token limit keeps everything it said, so under
# `rollout.end_at_sentence` (which cuts a reply back to its last whole sentence) it learned to
# never end a sentence (docs/notebook/results-rounds.md, 2026-12-06, seed 1).
UNFINISHED = -1.5
GARBLED = -10.0
NEAR_DUPLICATE_BASE = -2.0  # and a further -2 for every earlier near-duplicate
PHRASE_REUSE = -3.0  # times the share of reused phrasing, from 25% reuse on
STUFFING_PER_BUZZWORD = -1.25  # per buzzword beyond two, at most -6
# Strategies a reply can pursue; one reply rarely pursues more than three with care.
STRATEGIES = (
    "advice",
    "listening",
    "empathy",
    "validation",
    "two_sided",
    "motives",
    "reflective_question",
    "concrete_praise",
)
FOCUSED_STRATEGIES = 3
SCATTERSHOT_PER_STRATEGY = -1.5  # per strategy beyond three


def diminishing(count: int) -> float:
    """Weight multiplier for `count` distinct cues: 0, 1, 1.25, 1.5, 1.5, ..."""
    return (0.0, 1.0, 1.25, 1.5)[min(count, 3)]


@dataclass(frozen=True)
class TurnContext:
    """What the user said and what the policy said before, for one assessment."""

    user_text: str
    keywords: frozenset[str] = frozenset()
    earlier_replies: Sequence[str] = ()


@dataclass
class Features:
    """The cues found in one reply, by category, plus its question counts."""

    cues: dict[str, list[str]]
    buzzwords: int
    questions: int
    open_questions: int

    def count(self, category: str) -> int:
        return len(self.cues.get(category, ()))


def extract_features(reply: str, lexicon: Lexicon) -> Features:
    text = normalize(reply)
    cues = {category: lexicon.matches(category, text) for category in lexicon.patterns}
    # Praise names concrete actions only when it points at something the user did.
    if cues["action_reference"]:
        cues["concrete_praise"], cues["generic_praise"] = cues["praise"], []
    else:
        cues["concrete_praise"], cues["generic_praise"] = [], cues["generic_praise"] + cues["praise"]
    # "Then" or "first" alone are narration; steps count as advice only beside advice or each other.
    if not cues["advice"] and len(cues["steps"]) < 2:
        cues["steps"] = []
    asked = questions(reply)
    buzz = lexicon.occurrences("buzzwords", text) + max(0, len(cues["feeling_words"]) - 2)
    return Features(cues, buzz, len(asked), sum(is_open_question(q) for q in asked))


@dataclass(frozen=True)
class RubricSettings:
    """The rubric's knobs; the simulator's options fill them."""

    tolerance: float = 0.5
    short_reply_words: int = 4
    long_reply_words: int = 120
    near_duplicate_similarity: float = 0.75


class Rubric:
    """Scores replies for one profile: its theme, personality and language."""

    def __init__(
        self,
        theme: HiddenTheme | None,
        personality: Personality | None,
        language: str,
        settings: RubricSettings = RubricSettings(),
    ) -> None:
        self.theme = theme
        self.personality = personality
        self.language = language
        self.settings = settings
        self.lexicon = lexicon_for(language)
        self.forgive = 1.0 - settings.tolerance  # share of a mild miss that still counts

    def assess(self, reply: str, context: TurnContext) -> Assessment:
        criteria = dict.fromkeys(CRITERIA, 0.0)
        garbled = garble_reason(reply, self.language)
        if garbled:
            criteria["garbled"] = GARBLED
            return Assessment(self.theme, self.personality, criteria, {}, {"garbled": garbled}, "garbled")

        features = extract_features(reply, self.lexicon)
        notes: dict[str, str] = {}
        criteria["need"], notes["need"] = self._need(features)
        criteria["attention"], notes["attention"] = self._attention(reply, context)
        # A question engages only where the reply picks up something the user said: a stock
        # "Can you tell me more?" or fluent nonsense that ends in "?" was the cheapest +1 a policy
        # could find (docs/profiles.md, "The last two responders"); 12 of the 5788 recorded SAGE
        # replies ask without picking anything up.
        about_them = criteria["attention"] > 0
        criteria["engagement"], notes["engagement"] = self._engagement(features, about_them)
        criteria["personality"], notes["personality"] = self._personality(features, about_them)
        criteria["tone"], notes["tone"] = self._tone(features)
        criteria["focus"], notes["focus"] = self._focus(features)
        criteria["length"], notes["length"] = self._length(reply)
        criteria["repetition"], notes["repetition"], novelty = self._repetition(reply, context)
        criteria["stuffing"], notes["stuffing"] = self._stuffing(reply, features)

        # Praise that was already given, or given insincerely, is worth less.
        positive_share = 0.0 if criteria["stuffing"] < 0 else novelty
        for name in _POSITIVE_SCALED:
            if criteria[name] > 0:
                criteria[name] *= positive_share
        if self.personality is Personality.NEGATIVE:
            losses = sum(value for value in criteria.values() if value < 0)
            criteria["personality"] += NEGATIVE_AMPLIFICATION * losses
            notes["personality"] = f"negative: losses bite harder ({NEGATIVE_AMPLIFICATION * losses:+.1f})"

        criteria = {name: round(value, 2) for name, value in criteria.items()}
        evidence = {category: found for category, found in features.cues.items() if found}
        assessment = Assessment(self.theme, self.personality, criteria, evidence, notes)
        assessment.signal = self._signal(assessment)
        return assessment

    # ------------------------------------------------------------------ criteria
    def _need(self, features: Features) -> tuple[float, str]:
        rules = NEED_RULES.get(self.theme, ()) if self.theme else ()
        total, served, parts = 0.0, False, []
        for rule in rules:
            count = features.count(rule.cue)
            if not count:
                continue
            value = rule.weight * diminishing(count)
            if rule.mild and value < 0:
                value *= self.forgive
            served = served or value > 0
            total += value
            parts.append(f"{rule.cue} {value:+.1f}")
        total = min(total, NEED_CAP)
        if rules and not served:
            total += NEED_UNMET * self.forgive
            parts.append("nothing serves the need")
        return total, ", ".join(parts)

    def _attention(self, reply: str, context: TurnContext) -> tuple[float, str]:
        reply_shingles = shingles(reply, self.language)
        if len(reply_shingles) >= 3:
            copied = len(reply_shingles & shingles(context.user_text, self.language)) / len(reply_shingles)
            if copied >= 0.6:
                return PARROTING, "parrots the user's message"
        story = content_units(context.user_text, self.language) | context.keywords
        hits = sorted(content_units(reply, self.language) & story)
        if not hits:
            return ATTENTION_MISS * self.forgive, "picks up nothing the user said"
        return ATTENTION_BY_HITS[min(len(hits), 3)], "picks up " + ", ".join(hits[:4])

    def _engagement(self, features: Features, about_them: bool) -> tuple[float, str]:
        value, note = 0.0, "no question"
        if features.questions and not about_them:
            note = "a question about nothing the user said"
        elif features.open_questions:
            value, note = OPEN_QUESTION, "open question"
        elif features.questions:
            value, note = CLOSED_QUESTION, "closed question"
        if features.questions >= 3:
            value += TOO_MANY_QUESTIONS
            note = f"{features.questions} questions at once"
        return value, note

    def _personality(self, features: Features, about_them: bool) -> tuple[float, str]:
        if self.personality is Personality.PASSIVE:
            if features.open_questions and about_them:
                return PASSIVE_DRAWN_OUT, "passive: drawn out by a question"
            if features.questions and not about_them:
                return 0.0, "passive: asked, but about nothing they said"
            if not features.questions:
                return PASSIVE_NOT_ASKED * self.forgive, "passive: nothing invites them to say more"
        if self.personality is Personality.AVOIDANT:
            value = AVOIDANT_PUSHED * diminishing(features.count("pushing"))
            if features.questions >= 2:
                value += AVOIDANT_PROBED
            if value:
                return value, "avoidant: pushed or probed"
        return 0.0, ""

    def _tone(self, features: Features) -> tuple[float, str]:
        # A refusal dismisses the user as much as "calm down" does, however sorry it says it is,
        # and so does not following what they plainly said (they were not heard).
        hostile = features.count("hostile")
        refuses, confused = features.count("refusal"), features.count("confusion")
        dismissive = features.count("dismissive") + refuses + confused
        if hostile or dismissive:
            value = HOSTILE * diminishing(hostile) + DISMISSIVE * diminishing(dismissive)
            if hostile:
                return value, "hostile"
            return value, "refuses" if refuses else "does not follow" if confused else "dismissive"
        if features.count("warmth"):
            return WARMTH, "warm"
        return 0.0, ""

    def _focus(self, features: Features) -> tuple[float, str]:
        used = [strategy for strategy in STRATEGIES if features.count(strategy)]
        excess = len(used) - FOCUSED_STRATEGIES
        if excess > 0:
            return SCATTERSHOT_PER_STRATEGY * excess, f"scattershot: {len(used)} strategies at once"
        return 0.0, ""

    def _length(self, reply: str) -> tuple[float, str]:
        words = length_in_words(reply, self.language)
        if words < self.settings.short_reply_words:
            return SHORT_REPLY * self.forgive, f"too short ({words:.0f} words)"
        value, note = 0.0, ""
        excess = words - self.settings.long_reply_words
        if excess > 0:
            value, note = (
                max(-3.0, LONG_REPLY_BASE - excess / 60) * self.forgive,
                f"wall of text ({words:.0f} words)",
            )
        if breaks_off(reply):
            value += UNFINISHED
            note = ", ".join(part for part in (note, "breaks off mid-sentence") if part)
        return value, note

    def _repetition(self, reply: str, context: TurnContext) -> tuple[float, str, float]:
        """(penalty, note, novelty): novelty in [0, 1] scales the reply's positive criteria."""
        if not context.earlier_replies:
            return 0.0, "", 1.0
        units = similarity_units(reply, self.language)
        threshold = self.settings.near_duplicate_similarity
        duplicates = sum(
            jaccard(units, similarity_units(earlier, self.language)) >= threshold
            for earlier in context.earlier_replies
        )
        if duplicates:
            penalty = max(GARBLED, NEAR_DUPLICATE_BASE * (1 + duplicates))
            return (
                penalty,
                f"near-duplicate of {duplicates} earlier repl{'y' if duplicates == 1 else 'ies'}",
                0.0,
            )
        own = shingles(reply, self.language)
        seen: set[tuple[str, ...]] = set()
        for earlier in context.earlier_replies:
            seen |= shingles(earlier, self.language)
        reuse = len(own & seen) / len(own) if own else 0.0
        penalty = PHRASE_REUSE * reuse if reuse >= 0.25 else 0.0
        return penalty, f"reuses {reuse:.0%} of earlier phrasing", 1.0 - reuse

    def _stuffing(self, reply: str, features: Features) -> tuple[float, str]:
        words = max(1.0, length_in_words(reply, self.language))
        buzz = features.buzzwords
        # Density, not count: a long, sincere reply may well say "understand" and "feelings" often.
        if buzz >= 4 and buzz / words >= 0.2:
            return max(-6.0, STUFFING_PER_BUZZWORD * (buzz - 2)), f"{buzz} buzzwords in {words:.0f} words"
        return 0.0, ""

    @staticmethod
    def _signal(assessment: Assessment) -> str | None:
        criteria = assessment.criteria
        if criteria["repetition"] <= -2:
            return "repetition"
        if criteria["stuffing"] < 0:
            return "stuffing"
        if criteria["tone"] <= -3:
            return "hurt"
        if assessment.raw_change <= -2:
            return "missed"
        if assessment.raw_change >= 4:
            return "met"
        return None
