"""What a run reports: rollout summaries, metrics merged over ranks, transcripts, sample dialogues.

Metric keys are grouped: `rollout/`, `reward/`, `advantage/`, `ppo/`, `perf/`, `simulator/`,
`val/`, `test/`. Ranks may report different keys (a rank whose dialogues all failed has no
losses; simulators count only what happened), so they are merged by one gather of every
rank's dict (`merge_rank_metrics`), never synchronised key by key. Nothing here changes what is trained.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlver.core.trajectory import Trajectory, summarize
from rlver.train.curriculum import difficulty_metrics

# Metrics that count events: summed over ranks, not averaged.
SUMMED_METRICS = (
    "rollout/simulator_errors",
    "rollout/trained_dialogues",
    "val/simulator_errors",
    "test/simulator_errors",
)
SUMMED_PREFIXES = ("simulator/", "advantage/degenerate_groups")
# Largest values: the maximum over ranks (a mean would hide the one rank where it blew up).
MAXED_METRICS = ("advantage/max_abs", "rollout/logprob_gap")
# Shown in the progress bar.
PROGRESS_BAR = {"rollout/final_emotion", "reward/total", "val/final_emotion"}


def merge_rank_metrics(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One metrics dict from every rank's: counters summed, maxima the largest, others averaged
    where reported."""
    merged: dict[str, float] = {}
    for name in sorted({name for metrics in per_rank for name in metrics}):
        values = [metrics[name] for metrics in per_rank if name in metrics]
        summed = name in SUMMED_METRICS or name.startswith(SUMMED_PREFIXES)
        if name in MAXED_METRICS:
            merged[name] = max(values)
        else:
            merged[name] = sum(values) if summed else sum(values) / len(values)
    return merged


def rollout_metrics(trajectories: Sequence[Trajectory], prefix: str) -> dict[str, float]:
    """Means over a rank's dialogues: final emotion, success and failure rates, turns, reply sizes."""
    summary = summarize(trajectories)
    count = max(len(trajectories), 1)
    turns = [t for tr in trajectories for t in tr.policy_turns]
    return {
        f"{prefix}/final_emotion": summary["mean_final_emotion"],
        f"{prefix}/success_rate": summary["success"] / count,
        f"{prefix}/failure_rate": summary["failure"] / count,
        f"{prefix}/turns": summary["mean_turns"],
        f"{prefix}/reply_tokens": sum(len(t.response_ids) for t in turns) / max(len(turns), 1),
        f"{prefix}/format_violation_rate": summary["format_violations"] / max(len(turns), 1),
        f"{prefix}/truncated_rate": sum(t.finish_reason == "length" for t in turns) / max(len(turns), 1),
        # replies cut back to their last whole sentence (`rollout.end_at_sentence`)
        f"{prefix}/sentence_cut_rate": sum(t.finish_reason == "sentence" for t in turns) / max(len(turns), 1),
    }


def simulator_errors(trajectories: Sequence[Trajectory]) -> float:
    """How many dialogues the simulator ended with an error (summed over ranks)."""
    return float(sum(t.termination == "simulator_error" for t in trajectories))


def perf_metrics(
    seconds: Mapping[str, float], trajectories: Sequence[Trajectory], trained_tokens: int
) -> dict[str, float]:
    """`perf/` metrics from a step's phase durations (rollout, generate, simulator, update, ...)."""
    sampled_tokens = sum(len(t.response_ids) for tr in trajectories for t in tr.policy_turns)
    return {
        **{f"perf/{phase}_seconds": value for phase, value in seconds.items()},
        "perf/rollout_tokens_per_second": sampled_tokens / max(seconds["rollout"], 1e-9),
        "perf/update_tokens_per_second": trained_tokens / max(seconds["update"], 1e-9),
    }


def log_metrics(
    module: Any,
    metrics: Mapping[str, float],
    gather: Callable[[Any], list[Any]],
    step: int | None = None,
    **kwargs: Any,
) -> dict[str, float]:
    """Log metrics of all ranks' dialogues through `module.log`, whatever keys each rank has.

    One gather merges every rank's finite values: counters summed, the rest averaged over the
    ranks that report them. A training step's metrics (`step` given) go to the loggers at once,
    under the step's index, rather than after Lightning's end-of-batch hooks: so they are on disk
    before the checkpoint written at the end of the step (rlver.checkpoint.resume flushes them), and a crash
    right after that checkpoint loses none. Returns the merged metrics.
    """
    finite = {name: float(value) for name, value in metrics.items() if math.isfinite(value)}
    merged = merge_rank_metrics(gather(finite))
    to_loggers = step is None
    with warnings.catch_warnings():
        # Values are already identical on every rank; Lightning's advice to sync them is moot.
        warnings.filterwarnings("ignore", message=".*sync_dist=True.*")
        for name, value in merged.items():
            options = {"prog_bar": name in PROGRESS_BAR, "sync_dist": False, "batch_size": 1, **kwargs}
            module.log(name, value, logger=to_loggers, **options)
    trainer = module._trainer
    if step is not None and trainer is not None and (step + 1) % trainer.log_every_n_steps == 0:
        for logger in trainer.loggers:
            logger.log_metrics(merged, step=step)
    return merged


def append_transcripts(
    directory: Path, split: str, rank: int, trajectories: Sequence[Trajectory], step: int
) -> None:
    """Add the dialogues to `<directory>/rollouts/<split>_rank<rank>.jsonl`, one record a line."""
    folder = directory / "rollouts"
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(
        json.dumps({"step": step, **trajectory.to_record()}, ensure_ascii=False) + "\n"
        for trajectory in trajectories
    )
    # One write: a kill can tear only the last line, which rlver.checkpoint.resume drops on resume.
    with (folder / f"{split}_rank{rank}.jsonl").open("a", encoding="utf-8") as handle:
        handle.write(lines)


def log_samples(experiment: Any, trajectories: Sequence[Trajectory], step: int) -> None:
    """Two dialogues as text and every dialogue's emotion curve, in TensorBoard (when it is one)."""
    if not hasattr(experiment, "add_text"):
        return
    for index, trajectory in enumerate(trajectories[:2]):
        experiment.add_text(f"samples/dialogue_{index}", dialogue_markdown(trajectory), global_step=step)
    experiment.add_figure("rollout/emotion_trajectories", emotion_figure(trajectories), global_step=step)


def dialogue_markdown(trajectory: Trajectory) -> str:
    record = trajectory.to_record()
    lines = [
        f"**{record['profile_id']}** ({record['theme']}, {record['personality']}): "
        f"{record['start_emotion']:.0f} -> {record['final_emotion']:.0f}, {record['termination']}",
        "",
    ]
    for turn in record["turns"]:
        if turn["role"] == "user":
            lines.append(f"- **user** [{turn['emotion']:.0f}]: {turn['text']}")
        else:
            lines.append(f"- **assistant**: {turn['text']}")
    return "\n".join(lines)


def emotion_figure(trajectories: Sequence[Trajectory]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 3))
    for trajectory in trajectories:
        axes.plot(range(len(trajectory.emotions)), trajectory.emotions, alpha=0.5)
    axes.set_xlabel("turn")
    axes.set_ylabel("emotion")
    axes.set_ylim(0, 100)
    figure.tight_layout()
    return figure


class RunLog:
    """What the module reports: metrics merged over ranks, transcripts and sample dialogues (a part
    of `RLVERModule`, `module.run_log`).

    Args:
        module: The LightningModule (`log`, its Trainer's log folder and loggers, its rank).
        ranks: The module's collectives (one gather merges every rank's metrics).
        samples_every_n_steps: Sample dialogues and an emotion plot every N steps (0: never).
    """

    def __init__(self, module: Any, ranks: Any, samples_every_n_steps: int) -> None:
        self.module, self.ranks, self.samples_every_n_steps = module, ranks, samples_every_n_steps

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None, **kwargs: Any) -> None:
        log_metrics(self.module, metrics, self.ranks.gather_objects, step=step, **kwargs)

    def log_dir(self) -> Path | None:
        trainer = self.module._trainer
        if trainer is None:
            return None
        directory = trainer.log_dir or trainer.default_root_dir
        return Path(directory) if directory else None

    def append_transcripts(self, split: str, trajectories: Sequence[Trajectory], step: int) -> None:
        directory = self.log_dir()
        if directory is not None:
            append_transcripts(directory, split, self.ranks.rank, trajectories, step)

    def log_samples(self, trajectories: Sequence[Trajectory], step: int) -> None:
        every, logger = self.samples_every_n_steps, self.module.logger
        if every and not step % every and self.ranks.rank == 0 and logger is not None:
            log_samples(getattr(logger, "experiment", None), trajectories, step)


def simulator_metrics(simulator: Any) -> dict[str, float]:
    """The simulator's counters since the last call (requests, retries, re-asks, ...)."""
    return {f"simulator/{name}": float(value) for name, value in simulator.drain_metrics().items()}


def rank_difficulty_metrics(
    trajectories: Sequence[Trajectory], levels: Sequence[str], ranks: Any, device: Any
) -> dict[str, float]:
    """Share of dialogues and mean final emotion per curriculum level, over all ranks."""
    import torch

    return difficulty_metrics(
        [t.profile.extra.get("difficulty") for t in trajectories],
        [t.final_emotion for t in trajectories],
        levels,
        lambda values: (
            ranks.reduce_sum(torch.tensor(values, device=device)).tolist() if ranks.has_trainer else values
        ),
    )
