"""How far a simulator plugin agrees with SAGE: recorded dialogues replayed turn by turn.

Each recorded SAGE dialogue (the format `rlver score` reads) is replayed through a simulator
plugin with teacher forcing: the session opens with the recorded opening, is shown each
recorded assistant reply, moves its own emotion, and is then told what the user really said
next (`UserSession.follow`). Its change at each turn is compared with SAGE's recorded change
(the difference of consecutive `emotion-point`s), and its own emotion after the whole recorded
dialogue (or where it ended the dialogue itself) with SAGE's final `emo_point`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlver.data.profiles import parse_profile
from rlver.interfaces import UserSimulator
from rlver.score import ScoreError, _number
from rlver.transcripts import read_numbered_transcripts

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
    final: float = math.nan  # the plugin's own emotion at the end
    ended_early: str | None = None  # the plugin's termination before the recording ended


def replay(simulator: UserSimulator, dialogues: Sequence[RecordedDialogue], *, seed: int = 0) -> list[Replay]:
    """Replay `dialogues` through `simulator`, all dialogues' turn k in one batch."""
    sessions = []
    for dialogue in dialogues:
        profile = parse_profile(dialogue.record, where=dialogue.where)
        session = simulator.open(profile, seed=seed)
        session.follow(dialogue.user_texts[0])
        sessions.append(session)
    replays = [Replay(d, final=s.emotion) for d, s in zip(dialogues, sessions, strict=True)]
    turn = 0
    while True:
        active = [
            i for i, d in enumerate(dialogues) if turn < len(d.replies) and replays[i].ended_early is None
        ]
        if not active:
            return replays
        replies = [dialogues[i].replies[turn] for i in active]
        answers = simulator.respond_batch([sessions[i] for i in active], replies)
        for i, answer in zip(active, answers, strict=True):
            recorded = dialogues[i].emotions[turn + 1] - dialogues[i].emotions[turn]
            result = replays[i]
            result.final = answer.emotion
            if answer.termination == "simulator_error":
                result.ended_early = "simulator_error"
                continue
            result.changes.append((float(answer.change), recorded))
            if answer.termination is not None and turn + 1 < len(dialogues[i].replies):
                result.ended_early = answer.termination
            elif answer.termination is None:
                sessions[i].follow(dialogues[i].user_texts[turn + 1])
        turn += 1


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
