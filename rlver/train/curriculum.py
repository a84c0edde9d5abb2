"""A difficulty curriculum: which environment level each training dialogue gets.

Stages run in order; each holds until `until_step` (exclusive, in RL iterations,
i.e. `trainer.global_step`) and mixes levels by weight:

    curriculum:
      - {until_step: 10, mix: easy}                    # steps 0-9: all easy
      - {until_step: 20, mix: {easy: 1, normal: 1}}    # steps 10-19: half and half
      - {mix: {normal: 1, hard: 3}}                    # then on: a quarter normal

A level is drawn per profile from a hash of (seed, step, profile id, index), so
it is the same in every process and on every rerun, and every dialogue of a
GRPO group (one profile repeated) shares it. The level is written into the
profile's `extra["difficulty"]`, which every simulator reads
(`rlver.core.emotion.profile_difficulty`), so it wins over the simulator's option and
over a profile's own `difficulty` field. Validation and test rollouts do not use
the curriculum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlver.core.emotion import DIFFICULTIES
from rlver.core.seeding import stable_hash
from rlver.core.types import Profile

FLAG = "--model.curriculum"
STAGE_KEYS = ("until_step", "mix")


@dataclass(frozen=True)
class Stage:
    """One stage: levels mixed by weight until `until_step` (None: to the end)."""

    until_step: int | None
    mix: tuple[tuple[str, float], ...]  # (level, weight), weights > 0, in the order given


class DifficultyCurriculum:
    """Stages of difficulty mixes over training steps; see the module docstring."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = tuple(stages)

    @classmethod
    def from_config(cls, config: str | Sequence[Mapping[str, Any]], flag: str = FLAG) -> DifficultyCurriculum:
        """Build from the recipe value: a level name (constant) or a list of stages.

        Raises ValueError naming the flag and the stage, e.g.
        `--model.curriculum[1].until_step (5) must be > the previous stage's (10)`.
        """
        if isinstance(config, str):
            config = [{"mix": config}]
        if isinstance(config, Mapping) or not isinstance(config, Sequence) or not config:
            raise ValueError(f"{flag} must be a level name or a non-empty list of stages, got {config!r}")
        stages: list[Stage] = []
        previous = 0
        for index, raw in enumerate(config):
            where = f"{flag}[{index}]"
            if not isinstance(raw, Mapping):
                raise ValueError(f"{where} must be a mapping with {' and '.join(STAGE_KEYS)}, got {raw!r}")
            unknown = sorted(set(raw) - set(STAGE_KEYS))
            if unknown:
                raise ValueError(
                    f"{where}: unknown key(s) {', '.join(unknown)}; accepted: {', '.join(STAGE_KEYS)}"
                )
            until_step = raw.get("until_step")
            last = index == len(config) - 1
            if until_step is None:
                if not last:
                    raise ValueError(
                        f"{where}.until_step is required: only the last stage may run to the end"
                    )
            elif not isinstance(until_step, int) or isinstance(until_step, bool) or until_step <= previous:
                raise ValueError(
                    f"{where}.until_step ({until_step!r}) must be an integer > "
                    + (f"the previous stage's ({previous})" if index else "0")
                )
            else:
                previous = until_step
            stages.append(Stage(until_step, _parse_mix(raw.get("mix"), f"{where}.mix")))
        return cls(stages)

    @property
    def levels(self) -> list[str]:
        """Every level any stage can draw, in first-seen order (for metric keys)."""
        seen: dict[str, None] = {}
        for stage in self.stages:
            seen.update(dict.fromkeys(level for level, _ in stage.mix))
        return list(seen)

    def stage_at(self, step: int) -> Stage:
        """The stage in force at `step`; past every `until_step`, the last stage."""
        for stage in self.stages:
            if stage.until_step is None or step < stage.until_step:
                return stage
        return self.stages[-1]

    def level_for(self, step: int, profile_id: str, index: int, seed: int) -> str:
        """The level of one profile at one step: deterministic, the same in every process."""
        mix = self.stage_at(step).mix
        if len(mix) == 1:
            return mix[0][0]
        total = sum(weight for _, weight in mix)
        point = _unit_hash(seed, step, profile_id, index) * total
        for level, weight in mix:
            point -= weight
            if point < 0:
                return level
        return mix[-1][0]  # float rounding at the very top of the range

    def assign(self, profiles: Sequence[Profile], step: int, seed: int, offset: int = 0) -> list[Profile]:
        """Copies of `profiles` with `extra["difficulty"]` set to their level at `step`.

        Call on the distinct profiles of a batch, before any repetition into groups,
        so that a group shares its level. `offset` shifts the indices (e.g. by rank).
        """
        return [
            dataclasses.replace(
                profile,
                extra={**profile.extra, "difficulty": self.level_for(step, profile.id, offset + i, seed)},
            )
            for i, profile in enumerate(profiles)
        ]


def _parse_mix(mix: Any, where: str) -> tuple[tuple[str, float], ...]:
    if isinstance(mix, str):
        mix = {mix: 1.0}
    if not isinstance(mix, Mapping) or not mix:
        raise ValueError(
            f"{where} must be a level name or a non-empty {{level: weight}} mapping, got {mix!r}"
        )
    parsed = []
    for level, weight in mix.items():
        if level not in DIFFICULTIES:
            raise ValueError(f"{where}: unknown level {level!r}; available: {', '.join(DIFFICULTIES)}")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight >= 0:
            raise ValueError(f"{where}.{level} ({weight!r}) must be a number >= 0")
        if weight > 0:
            parsed.append((level, float(weight)))
    if not parsed:
        raise ValueError(f"{where}: every weight is 0")
    return tuple(parsed)


def _unit_hash(*parts: object) -> float:
    """A number in [0, 1) from `parts`; unlike hash(), not salted per process."""
    return stable_hash(*parts) / 2**64


def difficulty_metrics(
    levels: Sequence[str | None],
    final_emotions: Sequence[float],
    known_levels: Sequence[str],
    reduce_sum: Callable[[list[float]], list[float]] = lambda values: values,
    prefix: str = "rollout",
) -> dict[str, float]:
    """`<prefix>/difficulty/<level>` (share of dialogues) and `<prefix>/final_emotion/<level>` (mean).

    `reduce_sum` sums a list of numbers over ranks (identity on one process). The
    counts are summed before dividing, so every rank logs the same keys and values
    whatever levels it happened to draw (distributed logging needs the same keys
    everywhere); a level no rank played gets no final_emotion key.
    """
    counts = [float(sum(level == name for level in levels)) for name in known_levels]
    sums = [
        float(sum(e for level, e in zip(levels, final_emotions, strict=True) if level == name))
        for name in known_levels
    ]
    reduced = reduce_sum([*counts, *sums, float(len(levels))])
    counts, sums, total = reduced[: len(known_levels)], reduced[len(known_levels) : -1], reduced[-1]
    metrics: dict[str, float] = {}
    for name, count, emotion_sum in zip(known_levels, counts, sums, strict=True):
        metrics[f"{prefix}/difficulty/{name}"] = count / total if total else 0.0
        if count:
            metrics[f"{prefix}/final_emotion/{name}"] = emotion_sum / count
    return metrics
