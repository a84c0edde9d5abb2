"""The rubric's verdict on one reply, and the planning record a user turn carries (rubric.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlver.core.types import HiddenTheme, Personality


@dataclass
class Assessment:
    """The rubric's verdict on one reply (rubric.py's module docstring describes the record)."""

    theme: HiddenTheme | None
    personality: Personality | None
    criteria: dict[str, float]
    evidence: dict[str, list[str]]
    notes: dict[str, str] = field(default_factory=dict)
    signal: str | None = None
    details: dict[str, object] = field(default_factory=dict)  # extra record keys (the semantic judge's)

    @property
    def raw_change(self) -> float:
        return round(sum(self.criteria.values()), 2)

    def record(self, applied: float, emotion: float, band_label: str) -> dict[str, object]:
        return {
            "theme": self.theme.value if self.theme else None,
            "personality": self.personality.value if self.personality else None,
            "criteria": dict(self.criteria),
            "evidence": {category: list(found) for category, found in self.evidence.items()},
            "signal": self.signal,
            "raw_change": self.raw_change,
            "change": round(applied, 2),
            "emotion": round(emotion, 2),
            "band": band_label,
            "analysis": self.analysis(applied, emotion, band_label),
            **self.details,
        }

    def analysis(self, applied: float, emotion: float, band_label: str) -> str:
        strongest = sorted(
            (c for c in self.criteria if self.criteria[c]), key=lambda c: -abs(self.criteria[c])
        )
        parts = [f"{c} {self.criteria[c]:+.1f} ({self.notes[c]})" for c in strongest[:3]]
        theme = self.theme.value if self.theme else "unknown need"
        return (
            f"{theme}: {'; '.join(parts) or 'nothing notable'} -> raw {self.raw_change:+.1f}, "
            f"applied {applied:+.1f}, emotion {emotion:.0f} ({band_label})"
        )
