"""The embedded user: a deterministic, rule-based affective user that needs no LLM.

It follows the SAGE loop without the two LLM calls: a transparent rubric
(`rubric.py`) plays the planning step and yields a raw change; the shared
mechanics in `rlver.core.emotion` scale, clamp and cap it and decide termination;
`voice.py` plays the reply step from the profile's own story. The planning
record on `UserTurn.reason` is documented in `rubric.py`.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from rlver.core.emotion import (
    Difficulty,
    apply_change,
    band,
    profile_difficulty,
    resolve_difficulty,
    termination,
)
from rlver.core.interfaces import UserSession, UserSimulator
from rlver.core.seeding import stable_hash
from rlver.core.types import Profile, UserTurn

from . import semantic
from .assessment import Assessment
from .rubric import Rubric, RubricSettings, TurnContext
from .story import story_keywords
from .voice import Voice

SUPPORTED_LANGUAGES = ("en", "zh")
# A reply that costs this much or more makes the user stop telling their story.
WITHDRAW_BELOW = -3.0
JUDGES = ("rubric", "semantic")
# The rubric's verdicts the semantic judge never overrides: gaming, not meaning.
GUARDED_SIGNALS = ("garbled", "stuffing")


class EmbeddedUserSimulator(UserSimulator):
    """Rule-based simulated user with SAGE emotion mechanics; no model, no network."""

    def __init__(
        self,
        difficulty: str | dict[str, Any] = "normal",
        seed: int = 0,
        short_reply_words: int = 4,
        long_reply_words: int = 120,
        near_duplicate_similarity: float = 0.75,
        language: str | None = None,
        judge: str = "semantic",
    ) -> None:
        """Configure the embedded user.

        Args:
            difficulty: "easy", "normal" or "hard", or a dict overriding a preset, e.g.
                {"base": "hard", "start": 35}. Sets the start emotion, the scaling of
                gains and losses, the clamp, the end condition and the tolerance of mild
                misses. A profile's own `difficulty` field (or a training curriculum's
                level) wins over this.
            seed: base seed for the user's wording; mixed with each dialogue's seed and the
                profile id. Under the rubric the emotion path never depends on it; the
                semantic judge compares a reply with the user's words, so it does.
            short_reply_words: replies under this many words (two Chinese characters count
                as one word) are too short to engage, a mild miss.
            long_reply_words: replies over this many words are a wall of text, a mild miss.
            near_duplicate_similarity: word-overlap (Jaccard) at or above which a reply counts
                as a repeat of an earlier one; within (0, 1].
            language: "en" or "zh" to force the rubric's and the user's language; None takes
                each profile's own.
            judge: "semantic" (default): a map calibrated on recorded SAGE dialogues turns
                sentence embeddings of the reply (against the user's message, the hidden need
                and reference replies), the rubric's criteria and the user's mood into the
                change, the rubric's guards against gaming kept (semantic.py; per-turn r with
                SAGE 0.56-0.59 on held-out dialogues). "rubric": the rubric's change alone,
                from the reply's words (no encoder; r 0.12).
        """
        try:
            self.difficulty: Difficulty = resolve_difficulty(difficulty)
        except (ValueError, TypeError) as error:
            raise ValueError(f"embedded simulator: difficulty: {error}") from None
        _require(isinstance(seed, int) and not isinstance(seed, bool), f"seed ({seed!r}) must be an integer")
        _require(
            isinstance(short_reply_words, int) and short_reply_words >= 1,
            f"short_reply_words ({short_reply_words!r}) must be an integer >= 1",
        )
        _require(
            isinstance(long_reply_words, int) and long_reply_words > short_reply_words,
            f"long_reply_words ({long_reply_words!r}) must be an integer"
            f" > short_reply_words ({short_reply_words})",
        )
        _require(
            isinstance(near_duplicate_similarity, int | float) and 0 < near_duplicate_similarity <= 1,
            f"near_duplicate_similarity ({near_duplicate_similarity!r}) must be within (0, 1]",
        )
        _require(
            language is None or language in SUPPORTED_LANGUAGES,
            f"language ({language!r}) must be one of {', '.join(SUPPORTED_LANGUAGES)} or None",
        )
        _require(judge in JUDGES, f"judge ({judge!r}) must be one of {', '.join(JUDGES)}")
        if judge == "semantic":
            semantic.encoder()  # fail now, with the install hint, not at the first reply
            semantic.load_calibration()
        self.judge = judge
        self.seed = seed
        self.language = language
        self.settings = RubricSettings(
            tolerance=self.difficulty.tolerance,
            short_reply_words=short_reply_words,
            long_reply_words=long_reply_words,
            near_duplicate_similarity=float(near_duplicate_similarity),
        )

    def open(self, profile: Profile, *, seed: int) -> EmbeddedUserSession:
        difficulty = profile_difficulty(profile, self.difficulty)
        language = self.language or profile.language
        if language not in SUPPORTED_LANGUAGES:
            language = "en"
        settings = dataclasses.replace(self.settings, tolerance=difficulty.tolerance)
        rubric = Rubric(profile.theme, profile.personality, language, settings)
        voice = Voice(profile, language, random.Random(stable_hash(self.seed, seed, profile.id)))
        keywords = story_keywords(profile, language)
        return EmbeddedUserSession(profile, difficulty, rubric, voice, keywords, judge=self.judge)


class EmbeddedUserSession(UserSession):
    """One dialogue with the embedded user; holds all of that dialogue's state."""

    def __init__(
        self,
        profile: Profile,
        difficulty: Difficulty,
        rubric: Rubric,
        voice: Voice,
        keywords: set[str],
        judge: str = "semantic",
    ) -> None:
        self.profile = profile
        self.judge = judge
        self._last_user_text = ""  # the user's latest whole message, for the semantic judge
        self._last_change = 0.0  # the user's previous change, for the semantic judge
        self._before_reply = difficulty.start
        self.difficulty = difficulty
        self.rubric = rubric
        self.voice = voice
        self.keywords = frozenset(keywords)
        self._emotion = difficulty.start
        self._replies: list[str] = []
        self._story_so_far = ""  # the story part of the user's latest message, for attention
        self._opening: UserTurn | None = None
        self._ended: str | None = None

    @property
    def emotion(self) -> float:
        return self._emotion

    def opening(self) -> UserTurn:
        if self._opening is None:
            text, story = self.voice.opening()
            self._story_so_far = story
            self._last_user_text = text
            self._opening = UserTurn(text=text, emotion=self._emotion, reason={"analysis": "opening line"})
        return self._opening

    def adopt_opening(self, turn: UserTurn) -> None:
        # The embedded user's opening is a function of its seed, which a group shares: write
        # our own (it keeps the voice's random stream in step) and check it is the same line.
        own = self.opening()
        if own.text != turn.text:
            raise ValueError(f"profile {self.profile.id}: group members opened differently")

    def follow(self, text: str, emotion: float | None = None) -> None:
        if emotion is not None:  # the recorded emotion, and whether it ended the dialogue
            if self._opening is not None:
                self._last_change = float(emotion) - self._before_reply
            self._emotion = float(emotion)
            self._ended = termination(self._emotion, self.difficulty)
        if self._opening is None:
            reason = {"analysis": "recorded opening"}
            self._opening = UserTurn(text=text, emotion=self._emotion, reason=reason)
        self._story_so_far = text  # what the next reply should attend to
        self._last_user_text = text

    def respond(self, reply: str) -> UserTurn:
        if self._ended:
            raise RuntimeError(f"profile {self.profile.id}: the dialogue already ended ({self._ended})")
        self.opening()
        context = TurnContext(self._story_so_far, self.keywords, tuple(self._replies))
        assessment = self.rubric.assess(reply, context)
        if self.judge == "semantic":
            self._judge_semantically(reply, assessment)
        before = self._before_reply = self._emotion
        emotion, _ = apply_change(before, assessment.raw_change, self.difficulty)
        # Two decimals keep transcripts readable and free of float noise (35.869999...).
        self._emotion = round(emotion, 2)
        applied = round(self._emotion - before, 2)
        self._last_change = applied
        self._replies.append(reply)
        band_label = band(self._emotion)
        self._ended = termination(self._emotion, self.difficulty)
        if self._ended:
            text = self.voice.goodbye(self._ended)
        else:
            text, story = self.voice.reply(band_label, assessment.signal, willing=applied > WITHDRAW_BELOW)
            self._story_so_far = story or self._story_so_far
            self._last_user_text = text
        return UserTurn(
            text=text,
            emotion=self._emotion,
            change=applied,
            reason=assessment.record(applied, self._emotion, band_label),
            termination=self._ended,
        )

    def _judge_semantically(self, reply: str, assessment: Assessment) -> None:
        """Replace the rubric's change by the calibrated map's, unless a guard says no."""
        rubric_change = assessment.raw_change
        if assessment.signal in GUARDED_SIGNALS:
            assessment.details["semantic"] = {"guard": assessment.signal}
            return
        values = semantic.features(
            reply,
            self._last_user_text,
            self.profile.task,
            assessment.criteria,
            self._emotion,
            self._replies,
            self._last_change,
        )
        change = semantic.load_calibration().predict(values)
        copy = semantic.copied(values)
        if copy is not None:  # the user's own words handed back, or an earlier reply again
            change = min(change, -semantic.COPY_PENALTY)
            assessment.signal = "repetition"
            similarity = max(values["on_topic"], values["repeat"])
            assessment.notes["semantic"] = f"{copy} (similarity {similarity:.2f})"
        else:
            assessment.notes["semantic"] = f"calibrated map over the rubric's {rubric_change:+.1f}"
        assessment.criteria["semantic"] = round(change - rubric_change, 2)
        assessment.details["semantic"] = {"features": values, "change": change}
        if assessment.signal is None or assessment.signal in ("met", "missed", "hurt"):
            assessment.signal = Rubric._signal(assessment)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"embedded simulator: {message}")
