"""Emotion mechanics shared by every user simulator (the SAGE rules).

Emotion lives in [0, 100]. A turn's raw change is scaled by the difficulty,
clamped to +-max_change (unless the difficulty has no clamp) and the result
capped to [0, 100]. Bands: S >= 100, A >= 70, B >= 40, C >= 10, F < 10. A
dialogue succeeds at >= success_at and fails below failure_below (the SAGE
benchmark: < 10) or at or below failure_at_or_below (the reference "hard"
training user: when emotion reaches 0); then the user says goodbye.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

EMOTION_MIN = 0.0
EMOTION_MAX = 100.0

# (label, lower bound), highest first.
BANDS: tuple[tuple[str, float], ...] = (
    ("S", 100.0),
    ("A", 70.0),
    ("B", 40.0),
    ("C", 10.0),
    ("F", float("-inf")),
)


def band(emotion: float) -> str:
    """The band label of an emotion score: S, A, B, C or F."""
    for label, lower in BANDS:
        if emotion >= lower:
            return label
    raise AssertionError("unreachable: the last band has no lower bound")


@dataclass(frozen=True)
class Difficulty:
    """How hard the simulated user is to please.

    start: emotion at the first user message.
    max_change: each turn's change is clamped to [-max_change, +max_change]
        (None: no clamp, as in the reference "hard" training user).
    positive_scale / negative_scale: multiply gains / losses before the clamp.
    tolerance: 0..1, how much a mild miss is forgiven (used by rubric
        simulators; 1 forgives every mild miss, 0 none).
    success_at: the dialogue succeeds when emotion >= success_at.
    failure_below: the dialogue fails when emotion < failure_below (None: never).
    failure_at_or_below: the dialogue also fails when emotion <= this (None: never);
        "hard" uses 0, as the reference training user stops at emotion <= 0.
    """

    name: str = "normal"
    start: float = 40.0
    max_change: float | None = 10.0
    positive_scale: float = 1.0
    negative_scale: float = 1.0
    tolerance: float = 0.5
    success_at: float = 100.0
    failure_below: float | None = 10.0
    failure_at_or_below: float | None = None

    def __post_init__(self) -> None:
        if not EMOTION_MIN <= self.start <= EMOTION_MAX:
            raise ValueError(f"difficulty {self.name!r}: start ({self.start}) must be within [0, 100]")
        if self.max_change is not None and self.max_change <= 0:
            raise ValueError(f"difficulty {self.name!r}: max_change ({self.max_change}) must be > 0")
        if self.positive_scale < 0 or self.negative_scale < 0:
            raise ValueError(f"difficulty {self.name!r}: change scales must be >= 0")
        if not 0.0 <= self.tolerance <= 1.0:
            raise ValueError(f"difficulty {self.name!r}: tolerance ({self.tolerance}) must be within [0, 1]")


DIFFICULTIES: dict[str, Difficulty] = {
    "easy": Difficulty("easy", start=50.0, positive_scale=1.25, negative_scale=0.75, tolerance=0.8),
    "normal": Difficulty("normal", start=40.0),
    # The reference "hard" training user: starts at 30, no clamp, ends when emotion reaches 0;
    # its harsher wording is the scales and the low tolerance here, its own prompts in LLM users.
    "hard": Difficulty(
        "hard",
        start=30.0,
        max_change=None,
        positive_scale=0.8,
        negative_scale=1.25,
        tolerance=0.2,
        failure_below=None,
        failure_at_or_below=0.0,
    ),
}


def resolve_difficulty(spec: str | dict[str, Any] | Difficulty) -> Difficulty:
    """A preset name, a Difficulty, or a dict: {"base": "hard", "start": 35, ...}."""
    if isinstance(spec, Difficulty):
        return spec
    if isinstance(spec, str):
        if spec not in DIFFICULTIES:
            raise ValueError(f"unknown difficulty {spec!r}; available: {', '.join(DIFFICULTIES)}")
        return DIFFICULTIES[spec]
    if isinstance(spec, dict):
        options = dict(spec)
        base = resolve_difficulty(options.pop("base", options.get("name", "normal")))
        unknown = set(options) - set(Difficulty.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown difficulty option(s): {', '.join(sorted(unknown))}")
        return replace(base, **options)
    raise TypeError(f"difficulty must be a name, a dict or a Difficulty, got {type(spec).__name__}")


def apply_change(emotion: float, raw_change: float, difficulty: Difficulty) -> tuple[float, float]:
    """Apply one turn's raw change. Returns (new emotion, change actually applied)."""
    scale = difficulty.positive_scale if raw_change > 0 else difficulty.negative_scale
    change = raw_change * scale
    if difficulty.max_change is not None:
        change = max(-difficulty.max_change, min(difficulty.max_change, change))
    new_emotion = max(EMOTION_MIN, min(EMOTION_MAX, emotion + change))
    return new_emotion, new_emotion - emotion


def termination(emotion: float, difficulty: Difficulty) -> str | None:
    """ "success", "failure" or None (the dialogue goes on)."""
    if emotion >= difficulty.success_at:
        return "success"
    if difficulty.failure_below is not None and emotion < difficulty.failure_below:
        return "failure"
    if difficulty.failure_at_or_below is not None and emotion <= difficulty.failure_at_or_below:
        return "failure"
    return None


def profile_difficulty(profile: Any, default: Difficulty) -> Difficulty:
    """The difficulty a profile asks for (`extra["difficulty"]`), else `default`.

    Every simulator calls this so a per-profile level (or one a curriculum set)
    wins over the simulator's own setting.
    """
    spec = profile.extra.get("difficulty")
    if spec is None:
        return default
    try:
        return resolve_difficulty(spec)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{profile.source or profile.id}: difficulty: {error}") from None
