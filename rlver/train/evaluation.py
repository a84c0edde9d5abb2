"""Validation and test: dialogues at the evaluation temperature, and the Sentient benchmark's output.

It never trains: no gradient, no optimizer, no change to the training rollouts' settings.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlver.core.plugins import plain_config
from rlver.core.seeding import run_seed
from rlver.core.trajectory import Trajectory
from rlver.evaluate.judging import check_judge_spec, dimension_lines, judge_test_records, judged_path
from rlver.evaluate.score import score_records, with_intervals
from rlver.parallel.hang_watch import turn_progress
from rlver.rollout.runner import RolloutSettings
from rlver.rollout.transcripts import to_sage_record
from rlver.train.run_log import rollout_metrics, simulator_errors, simulator_metrics


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


def records_path(directory: Path, policy: str, rank: int, world: int) -> Path:
    """`<directory>/sentient/<policy name>[_rank<R>].jsonl`: where a rank's test records go."""
    label = Path(str(policy).rstrip("/")).name or "policy"
    suffix = f"_rank{rank}" if world > 1 else ""
    return directory / "sentient" / f"{label}{suffix}.jsonl"


def sentient_output(
    trajectories: Sequence[Trajectory],
    directory: Path | None,
    policy: str,
    rank: int,
    world: int,
    gather: Callable[[Any], list[Any]],
    judge: str | dict[str, Any] | None = None,
) -> None:
    """Sentient-benchmark output: SAGE-format records and Score / Success / Failure.

    Every rank writes its own dialogues (`records_path`); rank 0 prints the scores of all ranks'
    dialogues (`gather` collects them in rank order). With a `judge` spec (`--model.judge`, as
    `rlver score --judge` takes it), rank 0 also judges every rank's records, writes each file's
    judgements beside it (`<file>.judged.jsonl`) and prints the dimensions' means below Failure.
    """

    records = [to_sage_record(trajectory) for trajectory in trajectories]
    path = None
    if directory is not None:
        path = records_path(directory, policy, rank, world)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    parts = gather(records)
    records = [record for part in parts for record in part]
    if rank != 0 or not records:
        return
    scores = score_records(records)
    cells = with_intervals(scores)
    errors = sum(t.termination == "simulator_error" for t in trajectories)
    dimensions = ""
    if judge is not None:
        # Without a log folder there is no records file to put the judgements beside: the
        # paths only name the dialogues in messages then.
        paths = [records_path(directory or Path("."), policy, r, world) for r in range(len(parts))]
        means, names = judge_test_records(
            list(zip(paths, parts, strict=True)), judge, flag="--model.judge", write=directory is not None
        )
        dimensions = dimension_lines(means, names)  # a pool's agreement beside each
        if directory is not None:
            dimensions += "judged   " + " ".join(str(judged_path(p)) for p in paths) + "\n"
    print(
        f"\nSentient benchmark ({scores['dialogues']} dialogues"
        f"{f', {errors} ended by simulator errors' if errors else ''})\n"
        f"Score    {cells['score']}  (95% interval over dialogues)\n"
        f"Success  {cells['success']}\n"
        f"Failure  {cells['failure']}\n"
        + dimensions
        + (f"records  {path}  (rlver score {path})\n" if path is not None else ""),
        flush=True,
    )


class Evaluator:
    """Validation and test dialogues, and the Sentient benchmark's output (a part of
    `RLVERModule`, `module.evaluator`).

    Args:
        module: The LightningModule (its step and Trainer are read).
        rollouts: The module's rollouts (their runner samples the evaluation dialogues).
        run_log: Where metrics and transcripts go.
        ranks: The module's collectives.
        settings: The training rollouts' settings; evaluation changes only the temperature.
        temperature: The evaluation temperature (0: greedy).
        rewards: The summed reward of dialogues (for `<split>/reward`).
        simulator: The user simulator (its counters are logged).
        policy: The policy's name or path (names the test records).
        judge: `rlver test`'s dialogue judge spec, or None.
    """

    def __init__(
        self,
        module: Any,
        rollouts: Any,
        run_log: Any,
        ranks: Any,
        settings: RolloutSettings,
        temperature: float,
        rewards: Callable[[Sequence[Trajectory]], Any],
        simulator: Any,
        policy: str,
        judge: Any,
    ) -> None:
        self.module, self.rollouts, self.run_log, self.ranks = module, rollouts, run_log, ranks
        self.settings = evaluation_settings(settings, temperature)
        self.seed, self.rewards, self.simulator = settings.seed, rewards, simulator
        self.policy, self.judge = policy, plain_config(judge)
        self.test_trajectories: list[Trajectory] = []

    def dialogues(self, profiles: Sequence[Any], seed: int, simulator: Any = None) -> list[Trajectory]:
        """Dialogues with `profiles` at the evaluation temperature, weights as they are now; with
        `simulator`, against those users instead of the training simulator's."""
        runner = self.rollouts.runner
        previous = runner.settings, runner.simulator
        runner.settings, runner.simulator = self.settings, simulator or runner.simulator
        try:
            with self.rollouts.generation_weights():
                return runner.run(list(profiles), seed=seed, on_turn=turn_progress(self.module._trainer))
        finally:
            runner.settings, runner.simulator = previous

    def evaluate(self, batch: Sequence[Any], batch_idx: int, split: str) -> None:
        """One validation or test batch: its dialogues, transcripts and `<split>/` metrics."""
        step = self.module.global_step
        seed = run_seed(self.seed) + 7919 * self.ranks.rank + batch_idx
        trajectories = self.dialogues(list(batch), seed=seed)
        self.run_log.append_transcripts(f"{split}_step{step}", trajectories, step)
        if split == "test":
            self.test_trajectories.extend(trajectories)
        metrics = evaluation_metrics(trajectories, split, self.rewards)
        metrics.update(simulator_metrics(self.simulator))
        self.run_log.log_metrics(metrics, on_epoch=True, on_step=False)

    def start_test(self) -> None:
        self.test_trajectories = []
        if self.judge is not None:  # a bad spec fails now, not after the dialogues
            check_judge_spec(self.judge, "--model.judge")

    def end_test(self) -> None:
        """Sentient-benchmark output: SAGE-format records per rank, scores of all ranks' dialogues."""
        sentient_output(
            self.test_trajectories,
            self.run_log.log_dir(),
            self.policy,
            self.ranks.rank,
            self.module.trainer.world_size,
            self.ranks.gather_objects,
            self.judge,
        )
