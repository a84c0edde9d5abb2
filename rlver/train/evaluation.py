"""Validation and test: dialogues at the evaluation temperature, and the Sentient benchmark's output.

It never trains: no gradient, no optimizer, no change to the training rollouts' settings.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlver.core.trajectory import Trajectory
from rlver.evaluate.score import score_records
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

    def on_test_epoch_end(self) -> None:
        """Sentient-benchmark output: SAGE-format records per rank, scores of all ranks' dialogues."""
        sentient_output(
            self._test_trajectories,
            self._log_dir(),
            self.hparams.policy,
            self.global_rank,
            self.trainer.world_size,
            self._gather_objects,
        )

    def evaluation_rollouts(self, profiles: Sequence[Any], seed: int) -> list[Trajectory]:
        """Dialogues with `profiles` at `eval_temperature` (greedy by default), weights as they are now."""
        eval_settings = evaluation_settings(self.rollout_settings, self.hparams.eval_temperature)
        previous, self.runner.settings = self.runner.settings, eval_settings
        try:
            with self._generation_weights():
                return self.runner.run(list(profiles), seed=seed)
        finally:
            self.runner.settings = previous

    def _evaluate(self, batch: Sequence[Any], batch_idx: int, split: str) -> None:
        seed = self.rollout_settings.seed + 7919 * self.global_rank + batch_idx
        trajectories = self.evaluation_rollouts(list(batch), seed=seed)
        self._append_transcripts(f"{split}_step{self.global_step}", trajectories, self.global_step)
        if split == "test":
            self._test_trajectories.extend(trajectories)
        metrics = evaluation_metrics(trajectories, split, lambda dialogues: self._score(dialogues, {}))
        metrics.update(self._simulator_metrics())
        self._log_metrics(metrics, on_epoch=True, on_step=False)
