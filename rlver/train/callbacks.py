"""Callbacks a recipe can add under `trainer.callbacks`."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L

from rlver.checkpoint.stopping import last_checkpoint_path
from rlver.core.console import phase
from rlver.evaluate.intervals import paired_by_key, per_user_means


class BeforeAfter(L.Callback):
    """Shows that the policy learned: held-out users' final emotion before and after training, paired.

    Evaluates at `eval_temperature` (greedy by default) on the first `limit` profiles of
    `split` when training starts (fresh runs only: a resumed run's "before" is not the start)
    and when it ends, then prints both, the paired change with its 95% interval over users
    (rlver.evaluate.intervals), and where to look next; `<log dir>/before_after.json` keeps every user's
    scores. The evaluation has its own `seed` (the simulated users' wording), not the training's:
    the untrained model's score is then the same whatever the training seed, and before and after
    differ only by what training changed. Every rank talks with the same users (so sharded
    generation stays in step); rank 0 prints.

    Args:
        split: The data split to evaluate on: test or val.
        limit: How many of its profiles (0: all).
        seed: The evaluation's seed (fixed: independent of `seed_everything` and the rollout seed).
        samples: Dialogues per user, at seeds `seed`, `seed + 1`, ...; a user's score is their mean.
    """

    def __init__(self, split: str = "test", limit: int = 0, seed: int = 0, samples: int = 1) -> None:
        if split not in ("test", "val"):
            raise ValueError(f"BeforeAfter split ({split!r}) must be test or val")
        if limit < 0:
            raise ValueError(f"BeforeAfter limit ({limit}) must be >= 0")
        if samples < 1:
            raise ValueError(f"BeforeAfter samples ({samples}) must be >= 1")
        self.split, self.limit, self.seed, self.samples = split, limit, seed, samples
        self.before: dict[str, float] | None = None

    def _finals(self, trainer: L.Trainer, pl_module: Any) -> dict[str, float]:
        profiles = trainer.datamodule.profiles(self.split)
        profiles = profiles[: self.limit] if self.limit else profiles
        return heldout_scores(pl_module.evaluation_rollouts, profiles, self.seed, self.samples)

    def _users(self, trainer: L.Trainer) -> str:
        count = len(trainer.datamodule.profiles(self.split))
        users = min(count, self.limit) if self.limit else count
        return f"{users} held-out users" + (f" x {self.samples} dialogues" if self.samples > 1 else "")

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
        mean_after = sum(after.values()) / max(len(after), 1)
        lines = [
            f"\nrlver: greedy mean final emotion of {len(after)} held-out users ({self.split}, evaluation"
            f" seed {self.seed}; change: mean over users [95% interval])"
        ]
        if 0 < trainer.global_step < (trainer.max_steps or 0) and not trainer.interrupted:
            stopped = f"stopped at step {trainer.global_step} of {trainer.max_steps}"
            lines.append(f"  ({stopped}: max_time or a stop signal)")
        change = paired_by_key(self.before, after) if self.before is not None else None
        if change is not None:
            lines.append(
                f"  before training  {change.before:.1f}\n"
                f"  after {trainer.global_step} steps  {mean_after:.1f}  ({change.format()})"
            )
        else:
            lines.append(f"  after {trainer.global_step} steps  {mean_after:.1f}  (resumed run: no 'before')")
        record = {
            "split": self.split,
            "seed": self.seed,
            "samples": self.samples,
            "step": trainer.global_step,
            "before": self.before,
            "after": after,
            "change": change.as_dict() if change is not None else None,
        }
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            (Path(log_dir) / "before_after.json").write_text(json.dumps(record, indent=1) + "\n")
        lines += [
            f"  curves      tensorboard --logdir {log_dir}",
            f"  checkpoint  {checkpoint}",
            f"  export      rlver export --ckpt {checkpoint} --out <folder>",
        ]
        print("\n".join(lines), flush=True)


def heldout_scores(
    evaluate: Callable[..., list[Any]], profiles: Sequence[Any], seed: int, samples: int = 1
) -> dict[str, float]:
    """Each profile's mean final emotion over `samples` dialogues, all run as one batch.

    `evaluate(profiles, seed=...)` is `RLVERModule.evaluation_rollouts` (or a runner's `run`): a
    dialogue's user seed is derived from `seed`, its profile and its position, so the K copies of a
    profile face K differently-worded users, and the same call gives the same users every time.
    """
    repeated = [profile for profile in profiles for _ in range(samples)]
    trajectories = evaluate(repeated, seed=seed)
    return per_user_means([p.id for p in repeated], [t.final_emotion for t in trajectories])
