"""Callbacks a recipe can add under `trainer.callbacks`."""

from __future__ import annotations

from typing import Any

import lightning as L

from rlver.console import phase
from rlver.stopping import last_checkpoint_path


class BeforeAfter(L.Callback):
    """Shows that the policy learned: held-out users' mean final emotion before and after training.

    Evaluates at `eval_temperature` (greedy by default) on the first `limit` profiles of
    `split` when training starts (fresh runs only: a resumed run's "before" is not the start)
    and when it ends, then prints both and where to look next. Every rank talks with the
    same users (so sharded generation stays in step); rank 0 prints.

    Args:
        split: The data split to evaluate on: test or val.
        limit: How many of its profiles (0: all).
    """

    def __init__(self, split: str = "test", limit: int = 16) -> None:
        if split not in ("test", "val"):
            raise ValueError(f"BeforeAfter split ({split!r}) must be test or val")
        if limit < 0:
            raise ValueError(f"BeforeAfter limit ({limit}) must be >= 0")
        self.split, self.limit = split, limit
        self.before: list[float] | None = None

    def _finals(self, trainer: L.Trainer, pl_module: Any) -> list[float]:
        profiles = trainer.datamodule.profiles(self.split)
        profiles = profiles[: self.limit] if self.limit else profiles
        trajectories = pl_module.evaluation_rollouts(profiles, seed=pl_module.rollout_settings.seed)
        return [t.final_emotion for t in trajectories]

    def _users(self, trainer: L.Trainer) -> str:
        count = len(trainer.datamodule.profiles(self.split))
        return f"{min(count, self.limit) if self.limit else count} held-out users"

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.runner.engine.sync_weights()  # an engine with its own copy must hold these weights
        if trainer.global_step != 0:
            self.before = None
            return
        with phase(f"talking with {self._users(trainer)} before training (greedy)"):
            self.before = self._finals(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with phase(f"talking with {self._users(trainer)} after training (greedy)"):
            after = self._finals(trainer, pl_module)
        log_dir = trainer.log_dir or trainer.default_root_dir  # a broadcast: every rank asks
        checkpoint = last_checkpoint_path(trainer)
        if trainer.global_rank != 0:
            return
        mean_after = summarize_finals(after)
        lines = [f"\nrlver: greedy mean final emotion of {len(after)} held-out users ({self.split})"]
        if 0 < trainer.global_step < (trainer.max_steps or 0) and not trainer.interrupted:
            stopped = f"stopped at step {trainer.global_step} of {trainer.max_steps}"
            lines.append(f"  ({stopped}: max_time or a stop signal)")
        if self.before is not None:
            mean_before = summarize_finals(self.before)
            improved = sum(a > b for a, b in zip(after, self.before, strict=True))
            lines.append(
                f"  before training  {mean_before:.1f}\n"
                f"  after {trainer.global_step} steps  {mean_after:.1f}  ({mean_after - mean_before:+.1f}; "
                f"{improved}/{len(after)} users ended happier)"
            )
        else:
            lines.append(f"  after {trainer.global_step} steps  {mean_after:.1f}  (resumed run: no 'before')")
        lines += [
            f"  curves      tensorboard --logdir {log_dir}",
            f"  checkpoint  {checkpoint}",
            f"  export      rlver export --ckpt {checkpoint} --out <folder>",
        ]
        print("\n".join(lines), flush=True)


def summarize_finals(finals: list[float]) -> float:
    return sum(finals) / max(len(finals), 1)
