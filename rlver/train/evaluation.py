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
from rlver.evaluate.judging import MISSING_COLUMN, check_judge_spec, judge_test_records, judged_path
from rlver.evaluate.score import score_records, with_intervals
from rlver.parallel.hang_watch import turn_progress
from rlver.rollout.runner import RolloutSettings
from rlver.rollout.transcripts import to_sage_record
from rlver.train.run_log import rollout_metrics, simulator_errors


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
        dimensions = (
            "".join(f"{name:<8} {'-' if means[name] is None else f'{means[name]:.1f}'}\n" for name in names)
            + f"{MISSING_COLUMN}  {means[MISSING_COLUMN]}\n"
        )
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


class EvaluationHooks:
    """The LightningModule's validation and test hooks, mixed into `RLVERModule`.

    They use the module's rollout runner, hyperparameters, rank and logging helpers.
    """

    def validation_step(self, batch: list[Any], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "val")

    def test_step(self, batch: list[Any], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "test")

    def on_test_epoch_start(self) -> None:
        self._test_trajectories: list[Trajectory] = []
        judge = plain_config(self.hparams.get("judge"))  # a bad spec fails now, not after the dialogues
        if judge is not None:
            check_judge_spec(judge, "--model.judge")

    def on_test_epoch_end(self) -> None:
        """Sentient-benchmark output: SAGE-format records per rank, scores of all ranks' dialogues."""
        sentient_output(
            self._test_trajectories,
            self._log_dir(),
            self.hparams.policy,
            self.global_rank,
            self.trainer.world_size,
            self._gather_objects,
            plain_config(self.hparams.get("judge")),
        )

    def evaluation_rollouts(self, profiles: Sequence[Any], seed: int) -> list[Trajectory]:
        """Dialogues with `profiles` at `eval_temperature` (greedy by default), weights as they are now."""
        eval_settings = evaluation_settings(self.rollout_settings, self.hparams.eval_temperature)
        previous, self.runner.settings = self.runner.settings, eval_settings
        try:
            with self._generation_weights():
                return self.runner.run(list(profiles), seed=seed, on_turn=turn_progress(self._trainer))
        finally:
            self.runner.settings = previous

    def _evaluate(self, batch: Sequence[Any], batch_idx: int, split: str) -> None:
        seed = run_seed(self.rollout_settings.seed) + 7919 * self.global_rank + batch_idx
        trajectories = self.evaluation_rollouts(list(batch), seed=seed)
        self._append_transcripts(f"{split}_step{self.global_step}", trajectories, self.global_step)
        if split == "test":
            self._test_trajectories.extend(trajectories)
        metrics = evaluation_metrics(trajectories, split, lambda dialogues: self._score(dialogues, {}))
        metrics.update(self._simulator_metrics())
        self._log_metrics(metrics, on_epoch=True, on_step=False)
