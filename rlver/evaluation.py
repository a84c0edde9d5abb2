"""Validation and test: dialogues at the evaluation temperature, and the Sentient benchmark's output."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlver.rollout import RolloutSettings, Trajectory
from rlver.run_log import rollout_metrics, simulator_errors


def evaluation_settings(settings: RolloutSettings, temperature: float) -> RolloutSettings:
    """The training rollouts' settings at the evaluation temperature (0: greedy)."""
    return dataclasses.replace(settings, temperature=temperature)


def evaluation_metrics(
    trajectories: Sequence[Trajectory], split: str, rewards: Callable[[Sequence[Trajectory]], Any]
) -> dict[str, float]:
    """`<split>/` summaries of a rank's evaluation dialogues, with the mean of `rewards`."""
    metrics = rollout_metrics(trajectories, prefix=split)
    metrics[f"{split}/reward"] = rewards(trajectories).mean().item()
    metrics[f"{split}/simulator_errors"] = simulator_errors(trajectories)
    return metrics


def sentient_output(
    trajectories: Sequence[Trajectory],
    directory: Path | None,
    policy: str,
    rank: int,
    world: int,
    gather: Callable[[Any], list[Any]],
) -> None:
    """Sentient-benchmark output: SAGE-format records and Score / Success / Failure.

    Every rank writes its own dialogues (`<directory>/sentient/<policy name>[_rank<R>].jsonl`);
    rank 0 prints the scores of all ranks' dialogues (`gather` collects them in rank order).
    """
    from rlver.score import score_records
    from rlver.transcripts import to_sage_record

    records = [to_sage_record(trajectory) for trajectory in trajectories]
    path = None
    if directory is not None:
        label = Path(str(policy).rstrip("/")).name or "policy"
        suffix = f"_rank{rank}" if world > 1 else ""
        path = directory / "sentient" / f"{label}{suffix}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    records = [record for part in gather(records) for record in part]
    if rank != 0 or not records:
        return
    scores = score_records(records)
    errors = sum(t.termination == "simulator_error" for t in trajectories)
    print(
        f"\nSentient benchmark ({scores['dialogues']} dialogues"
        f"{f', {errors} ended by simulator errors' if errors else ''})\n"
        f"Score    {scores['score']:.1f}\n"
        f"Success  {scores['success']}\n"
        f"Failure  {scores['failure']}\n"
        + (f"records  {path}  (rlver score {path})\n" if path is not None else ""),
        flush=True,
    )
