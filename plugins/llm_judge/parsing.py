"""Reading a judge's answer: one JSON object of dimension -> score, checked dimension by dimension.

Judges answer in many shapes: a bare object, one inside a ```json fence, one after a sentence,
numbers as strings. All of those are read. What cannot be read is an error the judge re-asks
about: no JSON object at all, a dimension missing, a score that is not a number or lies outside
0-10. A partly usable answer keeps what it has (`JudgeAnswer.scores`) and names what it lacks
(`problems`), so the last of the bounded re-asks can still record the dimensions it did get.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .rubrics import SCORE_MAX, SCORE_MIN

_FENCED = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL | re.IGNORECASE)


@dataclass
class JudgeAnswer:
    """The scores read from one answer and what was wrong with it (empty: fully usable)."""

    scores: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.problems


def _json_object(text: str) -> dict[str, Any] | None:
    """The answer's JSON object: the whole text, a fenced block, or the first {...} in it."""
    candidates = [text.strip()]
    candidates += [match.group(1) for match in _FENCED.finditer(text)]
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start : end + 1])
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except (json.JSONDecodeError, ValueError):
            continue
        if isinstance(value, dict):
            return value
    return None


def _score(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return None
    elif isinstance(value, dict) and "score" in value:  # {"score": 7, "reason": "..."}
        return _score(value["score"])
    else:
        return None
    return number if math.isfinite(number) else None


def parse_judge_answer(text: str, dimensions: Sequence[str]) -> JudgeAnswer:
    """The scores for `dimensions` in `text`, and a problem per dimension it could not score."""
    answer = JudgeAnswer()
    record = _json_object(text)
    if record is None:
        answer.problems.append(f"no JSON object in the answer: {text[:80]!r}")
        return answer
    lowered = {str(key).strip().lower(): value for key, value in record.items()}
    for name in dimensions:
        if name not in lowered:
            answer.problems.append(f"{name}: missing")
            continue
        score = _score(lowered[name])
        if score is None:
            answer.problems.append(f"{name}: not a number ({lowered[name]!r})")
        elif not SCORE_MIN <= score <= SCORE_MAX:
            answer.problems.append(f"{name}: {score:g} is outside {SCORE_MIN:g}-{SCORE_MAX:g}")
        else:
            answer.scores[name] = score
    return answer
