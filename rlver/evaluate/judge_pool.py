"""Judge pools: several judges score the same dialogues; each dimension is reported as the pool's
mean with the judges' agreement beside it.

One LLM judge's score is one model's opinion, with that model's biases. A pool (`--judge` given
several times, or a list of specs) has every judge score every dialogue. Per dialogue and
dimension the pool's score is the mean of the judges that scored it; a dimension's mean is the
mean of those over the dialogues (as for one judge). Beside it stands Krippendorff's alpha at the
interval level over the judges x dialogues matrix (a score a judge could not give is missing,
which alpha allows): 1 is perfect agreement, 0 what chance would give, below 0 systematic
disagreement. Below `AGREEMENT_THRESHOLD` (0.667) the judges are said to disagree: Krippendorff's
standards for data reliability ("Content Analysis", 2nd ed., 2004) rely on data from 0.800 and
allow tentative conclusions from 0.667, no lower; a mean the judges disagree on below that is not a
finding about the policy but about the judges. Alpha is left out (None, shown as '-') where it
is undefined: no dialogue scored by two judges, or every score the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

AGREEMENT_THRESHOLD = 0.667
AGREEMENT_KEY = "agreement"  # in a summary: dimension -> alpha (None: undefined); pools only
JUDGES_KEY = "judges"  # in a summary: the pool's judge labels; pools only

Scores = Mapping[str, float | None]


def krippendorff_alpha(matrix: Sequence[Sequence[float | None]]) -> float | None:
    """Krippendorff's alpha (interval) of a judges x dialogues matrix, None marking a missing score;
    None where alpha is undefined (no dialogue with two scores, or no variation among them)."""
    values = np.array([[np.nan if v is None else float(v) for v in row] for row in matrix], dtype=float)
    if values.ndim != 2 or values.shape[0] < 2:
        return None
    pairable = values[:, (~np.isnan(values)).sum(axis=0) >= 2]  # a lone score pairs with nothing
    scored = pairable[~np.isnan(pairable)]
    if scored.size == 0 or np.unique(scored).size < 2:
        return None
    import krippendorff  # here, not at the top: `rlver fit` imports this module and never needs it

    return float(krippendorff.alpha(reliability_data=pairable, level_of_measurement="interval"))


def pooled_scores(verdict: Sequence[Scores], dimensions: Sequence[str]) -> dict[str, float | None]:
    """One dialogue's pool score per dimension: the mean of the judges that gave one (None: none)."""
    pooled: dict[str, float | None] = {}
    for name in dimensions:
        values = [float(v) for scores in verdict if (v := scores.get(name)) is not None]
        pooled[name] = math.fsum(values) / len(values) if values else None
    return pooled


def dimension_agreement(
    verdicts: Sequence[Sequence[Scores]], dimensions: Sequence[str]
) -> dict[str, float | None]:
    """Per dimension, alpha over the judges x dialogues of `verdicts` (each: one scores dict per judge)."""
    judges = len(verdicts[0]) if verdicts else 0
    return {
        name: krippendorff_alpha(
            [[verdict[judge].get(name) for verdict in verdicts] for judge in range(judges)]
        )
        for name in dimensions
    }


def judges_disagree(alpha: float | None) -> bool:
    return alpha is not None and alpha < AGREEMENT_THRESHOLD


def agreement_text(alpha: float | None) -> str:
    """'alpha 0.84', 'alpha 0.31: judges disagree', or 'alpha -' where it is undefined."""
    if alpha is None:
        return "alpha -"
    return f"alpha {alpha:.2f}" + (": judges disagree" if judges_disagree(alpha) else "")


def pool_cell(mean: float | None, alpha: float | None) -> str:
    """A pool's dimension in a table cell: '6.4 (alpha 0.31: judges disagree)'."""
    return f"{'-' if mean is None else f'{mean:.1f}'} ({agreement_text(alpha)})"


def judge_labels(specs: Sequence[str | Mapping[str, Any]]) -> list[str]:
    """What each judge of a pool is called in the judged files: its `model`, else its plugin name;
    a label that repeats gets its place in the pool (`#2`)."""
    labels = [
        spec if isinstance(spec, str) else str(spec.get("model") or spec.get("name") or "judge")
        for spec in specs
    ]
    return [
        f"{label}#{index + 1}" if labels.count(label) > 1 else label for index, label in enumerate(labels)
    ]
