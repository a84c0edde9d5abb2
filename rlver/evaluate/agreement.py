"""How far a simulator plugin agrees with SAGE: recorded dialogues replayed turn by turn.

Each recorded SAGE dialogue (the format `rlver score` reads) is replayed through a simulator
plugin with teacher forcing: the session opens with the recorded opening and emotion, is shown
each recorded assistant reply, makes its change, and is then told what the user really said
next and how they really felt (`UserSession.follow`). So each turn's change is judged in the
state SAGE's user was in, and is compared with SAGE's recorded change (the difference of
consecutive `emotion-point`s). The plugin's own final emotion is its changes added up from the
recorded start (clamped to 0-100, stopping at 0 or 100 as a dialogue would), compared with
SAGE's final `emo_point`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlver.core.interfaces import UserSimulator
from rlver.data.profiles import parse_profile
from rlver.evaluate.score import ScoreError, _number
from rlver.rollout.transcripts import read_numbered_transcripts

HELD_OUT_PERCENT = 30  # dialogues whose id hashes below this are never used to tune a simulator


def split_of(dialogue_id: str) -> str:
    """ "held_out" for a fixed 30% of dialogue ids (by SHA-256), "tune" for the rest."""
    bucket = int(hashlib.sha256(dialogue_id.encode()).hexdigest()[:8], 16) % 100
    return "held_out" if bucket < HELD_OUT_PERCENT else "tune"


@dataclass
class RecordedDialogue:
    """One recorded dialogue: the user's messages and emotions, the assistant's replies."""

    record: dict[str, Any]
    where: str
    user_texts: list[str]
    emotions: list[float]  # after each user message; [0] is the start
    replies: list[str]  # replies[i] answers user_texts[i]

    @property
    def id(self) -> str:
        return str(self.record.get("id", self.where))

    @property
    def final(self) -> float:
        return _number(self.record.get("emo_point", self.emotions[-1]), self.where, "emo_point")


def load_recorded(path: str | Path) -> list[RecordedDialogue]:
    """The dialogues of a SAGE record file; a line that cannot be replayed raises naming file:line."""
    dialogues = []
    for line, record in read_numbered_transcripts(path):
        where = f"{path}:{line}"
        if not isinstance(record, dict) or not isinstance(record.get("history"), list):
            raise ScoreError(f"{where}: not a SAGE record (no 'history' list)")
        users, emotions, replies = [], [], []
        for index, message in enumerate(record["history"]):
            if not isinstance(message, dict):
                raise ScoreError(f"{where}: field 'history[{index}]': expected an object")
            if message.get("role") == "user":
                if len(users) > len(replies):  # two user messages in a row: the later one counts
                    users.pop(), emotions.pop()
                users.append(str(message.get("content", "")))
                name = f"history[{index}].emotion-point"
                emotions.append(_number(message.get("emotion-point"), where, name))
            elif message.get("role") == "assistant" and len(users) > len(replies):
                replies.append(str(message.get("content", "")))
        if not users:
            raise ScoreError(f"{where}: field 'history': no user message")
        dialogues.append(RecordedDialogue(record, where, users, emotions, replies[: len(users) - 1]))
    return dialogues


@dataclass
class Replay:
    """One dialogue replayed: (plugin change, recorded change) per turn, and both finals."""

    dialogue: RecordedDialogue
    changes: list[tuple[float, float]] = field(default_factory=list)
    final: float = math.nan  # the plugin's own emotion at the end: its changes added up
    ended_early: str | None = None  # its own emotion reached 0 or 100 first, or a simulator error


def replay(simulator: UserSimulator, dialogues: Sequence[RecordedDialogue], *, seed: int = 0) -> list[Replay]:
    """Replay `dialogues` through `simulator`, all dialogues' turn k in one batch."""
    sessions = []
    for dialogue in dialogues:
        profile = parse_profile(dialogue.record, where=dialogue.where)
        session = simulator.open(profile, seed=seed)
        session.follow(dialogue.user_texts[0], dialogue.emotions[0])
        sessions.append(session)
    replays = [Replay(d, final=d.emotions[0]) for d in dialogues]
    failed: set[int] = set()  # a simulator error ends that dialogue's replay
    for turn in range(max((len(d.replies) for d in dialogues), default=0)):
        active = [i for i, d in enumerate(dialogues) if turn < len(d.replies) and i not in failed]
        answers = simulator.respond_batch(
            [sessions[i] for i in active], [dialogues[i].replies[turn] for i in active]
        )
        for i, answer in zip(active, answers, strict=True):
            dialogue, result = dialogues[i], replays[i]
            if answer.termination == "simulator_error":
                result.ended_early = "simulator_error"
                failed.add(i)
                continue
            recorded = dialogue.emotions[turn + 1] - dialogue.emotions[turn]
            change = float(answer.emotion) - dialogue.emotions[turn]  # from the recorded state
            result.changes.append((change, recorded))
            if result.ended_early is None:
                result.final = min(100.0, max(0.0, result.final + change))
                if result.final in (0.0, 100.0) and turn + 1 < len(dialogue.replies):
                    result.ended_early = "reached 0" if result.final == 0.0 else "reached 100"
            sessions[i].follow(dialogue.user_texts[turn + 1], dialogue.emotions[turn + 1])
    return replays


# --------------------------------------------------------------------------- statistics
def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Pearson's r (NaN with fewer than 2 points or no spread)."""
    n = len(xs)
    if n < 2:
        return math.nan
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mean_x) ** 2 for x in xs)
    syy = sum((y - mean_y) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return math.nan
    return sxy / math.sqrt(sxx * syy)


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            result[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return result


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    return pearson(ranks(xs), ranks(ys))


@dataclass
class Agreement:
    turns: int
    turn_pearson: float
    turn_spearman: float
    dialogues: int
    final_pearson: float
    mean_final: float  # the plugin's, replayed
    mean_recorded_final: float  # SAGE's
    ended_early: int
    simulator_errors: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def agreement(replays: Iterable[Replay]) -> Agreement:
    replays = list(replays)
    pairs = [pair for r in replays for pair in r.changes]
    ours, theirs = [p[0] for p in pairs], [p[1] for p in pairs]
    finals = [r.final for r in replays]
    recorded = [r.dialogue.final for r in replays]
    return Agreement(
        turns=len(pairs),
        turn_pearson=pearson(ours, theirs),
        turn_spearman=spearman(ours, theirs),
        dialogues=len(replays),
        final_pearson=pearson(finals, recorded),
        mean_final=sum(finals) / max(len(finals), 1),
        mean_recorded_final=sum(recorded) / max(len(recorded), 1),
        ended_early=sum(r.ended_early not in (None, "simulator_error") for r in replays),
        simulator_errors=sum(r.ended_early == "simulator_error" for r in replays),
    )


def to_json(agreements: dict[str, Agreement]) -> str:
    return json.dumps({name: a.as_dict() for name, a in agreements.items()}, indent=2)
