"""What serves and what violates each hidden need: the rubric's `need` criterion, as data.

A reply's cues (cues.py) are counted per category; each rule below says what one category is worth
for one theme. rubric.py sums the rules, caps the positive part and charges a mild miss where
nothing serves the need.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlver.core.types import HiddenTheme


@dataclass(frozen=True)
class NeedRule:
    """One cue category's effect on one hidden need.

    weight: the contribution of one matching cue; more distinct cues add with
        diminishing returns (x1, x1.25, x1.5).
    mild: a mild miss, forgiven in part by the difficulty's tolerance.
    """

    cue: str
    weight: float
    mild: bool = False


T = HiddenTheme
NEED_RULES: dict[HiddenTheme, tuple[NeedRule, ...]] = {
    T.DIALECTICAL_ANALYSIS: (
        NeedRule("two_sided", 3.5),
        NeedRule("motives", 1.5),
        NeedRule("reflective_question", 1.0),
        NeedRule("one_sided", -2.5),
        NeedRule("shallow_comfort", -2.0),
        NeedRule("blame_other", -1.5, mild=True),
    ),
    T.PRACTICAL_ADVICE: (
        NeedRule("advice", 2.5),
        NeedRule("steps", 2.5),
        NeedRule("shallow_comfort", -2.5),
    ),
    T.OTHERS_MOTIVES: (
        NeedRule("motives", 4.0),
        NeedRule("two_sided", 1.0),
        NeedRule("blame_other", -2.5),
        NeedRule("shallow_comfort", -2.0),
        NeedRule("one_sided", -1.5, mild=True),
    ),
    T.SELF_REFLECTION: (
        NeedRule("reflective_question", 3.5),
        NeedRule("two_sided", 1.0),
        NeedRule("criticism", -3.0),
        NeedRule("shallow_comfort", -1.5),
        NeedRule("validation", -1.0, mild=True),
        NeedRule("advice", -1.0, mild=True),
    ),
    T.SINCERE_PRAISE: (
        NeedRule("concrete_praise", 4.5),
        NeedRule("generic_praise", 0.5),
        NeedRule("criticism", -3.5),
        NeedRule("shared_blame", -2.5),
        NeedRule("advice", -1.0, mild=True),
    ),
    T.VENTING_LISTENING: (
        NeedRule("listening", 3.0),
        NeedRule("empathy", 1.5),
        NeedRule("feeling_words", 0.5),
        NeedRule("advice", -4.0),
        NeedRule("shallow_comfort", -2.0),
        NeedRule("criticism", -3.0),
        NeedRule("shared_blame", -2.0),
    ),
    T.DEEP_EMPATHY: (
        NeedRule("empathy", 3.5),
        NeedRule("feeling_words", 1.5),
        NeedRule("listening", 0.5),
        NeedRule("shallow_comfort", -4.5),
        NeedRule("criticism", -2.5),
        NeedRule("shared_blame", -2.0),
        NeedRule("advice", -1.5, mild=True),
    ),
    T.NOT_AT_FAULT: (
        NeedRule("validation", 4.5),
        NeedRule("blame_other", 0.5),
        NeedRule("shared_blame", -5.0),
        NeedRule("criticism", -3.0),
        NeedRule("two_sided", -1.5, mild=True),
        NeedRule("motives", -1.5, mild=True),
    ),
}
