"""What the simulated user says: opening line, in-character replies, goodbye.

The wording draws on the profile (its facts in telling order, its reactions
per emotion level, its goodbye lines) and falls back to `lines.py`. Random
choices only pick among equivalent lines; they never touch the emotion, so
two seeds give the same emotion path with different wording.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rlver.core.types import Personality, Profile

from .lines import FEEDBACK, GOODBYES, OPENERS, REACTIONS, pick_language
from .story import sim_hints, story_facts

# Band -> the `sim.reactions` level a persona speaks at.
_LEVEL_BY_BAND = {"S": "high", "A": "high", "B": "medium", "C": "low", "F": "low"}


class Voice:
    """Speaks for one persona in one dialogue."""

    def __init__(self, profile: Profile, language: str, rng: random.Random) -> None:
        self.profile = profile
        self.language = pick_language(language)
        self.personality = (profile.personality or Personality.PASSIVE).value
        self._hints = sim_hints(profile)
        self._facts = story_facts(profile)
        self._next_fact = 0
        self._rng = rng
        self._last_line: str | None = None

    def opening(self) -> tuple[str, str]:
        """(text, story part): `first_talk`, else an opener and the first fact."""
        if self.profile.first_talk:
            return self.profile.first_talk, self.profile.first_talk
        fact = self._take_fact() or ""
        opener = self._choose(OPENERS[self.language][self.personality])
        return self._join([opener, fact]), fact

    def reply(self, band_label: str, signal: str | None, willing: bool) -> tuple[str, str]:
        """(text, story part). `willing`: the user still tells more of the story."""
        parts = []
        if signal:
            parts.append(self._choose(FEEDBACK[self.language][signal]))
        fact = self._take_fact() if willing else None
        if fact is None:
            parts.append(self._reaction(band_label))
        else:
            if not signal and self._rng.random() < 0.5:
                parts.append(self._reaction(band_label))
            parts.append(fact)
        return self._join(parts), fact or ""

    def goodbye(self, outcome: str) -> str:
        """The last line on "success" or "failure"."""
        custom = self._hints.get("goodbye")
        if isinstance(custom, dict) and custom.get(outcome):
            return str(custom[outcome])
        return GOODBYES[self.language][outcome]

    def _reaction(self, band_label: str) -> str:
        level = _LEVEL_BY_BAND[band_label]
        custom = self._hints.get("reactions")
        if isinstance(custom, dict) and custom.get(level):
            return self._choose([str(line) for line in custom[level]])
        return self._choose(REACTIONS[self.language][self.personality][level])

    def _take_fact(self) -> str | None:
        if self._next_fact >= len(self._facts):
            return None
        fact = self._facts[self._next_fact]
        self._next_fact += 1
        return fact

    def _choose(self, options: Sequence[str]) -> str:
        # Never the same line twice in a row: a person varies their words.
        fresh = [line for line in options if line != self._last_line] or list(options)
        self._last_line = self._rng.choice(fresh)
        return self._last_line

    def _join(self, parts: list[str]) -> str:
        parts = [part for part in parts if part]
        return ("" if self.language == "zh" else " ").join(parts)
