"""How a training step gets its dialogues: the step's profiles, their seeds, the rollout.

`StepRollouts` is a part the module owns (`module.rollouts`): it holds the rollout runner and,
with `--model.overlap`, the pipeline of the steps rolled out ahead (rlver.rollout.overlap).
Every step rolls out its own dialogues, or trains on the ones rolled out during the last update
while the next steps' run. It reads the module only for what the Trainer decides (the step, the
rank, the weights being trained), never another part's attributes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlver.checkpoint.stopping import run_unless_stopped
from rlver.core.interfaces import SimulatorUnavailable
from rlver.core.plugins import get_registry
from rlver.core.seeding import run_seed
from rlver.core.trajectory import Trajectory
from rlver.core.types import Profile
from rlver.modeling.models import Policy
from rlver.modeling.networks import weights_for_generation
from rlver.parallel.hang_watch import turn_progress
from rlver.parallel.sharding import is_sharded
from rlver.rollout.overlap import (
    PENDING_KEY,
    OverlapSettings,
    PendingRollout,
    RolloutPipeline,
    SnapshotPolicy,
    background_run,
    behaviour_correction,
    trajectories_from_json,
    trajectories_to_json,
)
from rlver.rollout.runner import RolloutRunner
from rlver.train.curriculum import DifficultyCurriculum
from rlver.train.ranks import Ranks

RolledOut = tuple[list[Trajectory], int]  # the dialogues and the step whose weights sampled them


class StepRollouts:
    """The module's rollouts: one step's dialogues, their seeds, and the steps rolled out ahead.

    Args:
        module: The LightningModule (its step, rank, Trainer and policy weights are read).
        ranks: The module's collectives.
        build_runner: A rollout runner over a policy (the module's engine, simulator, format).
        seed: The rollouts' seed setting (`rollout.seed`; None: the run's seed).
        group_size: Dialogues per profile.
        curriculum: The difficulty curriculum, if any.
        overlap: The overlapped mode's settings (None: every step rolls out its own dialogues).
    """

    def __init__(
        self,
        module: Any,
        ranks: Ranks,
        build_runner: Callable[[Policy], RolloutRunner],
        seed: int | None,
        group_size: int,
        curriculum: DifficultyCurriculum | None,
        overlap: OverlapSettings | None,
    ) -> None:
        self.module, self.ranks, self.build_runner = module, ranks, build_runner
        self.seed, self.group_size, self.curriculum, self.overlap = seed, group_size, curriculum, overlap
        self.runner: RolloutRunner | None = None
        self.pipeline = RolloutPipeline()  # the overlapped mode's steps ahead
        self.snapshot: SnapshotPolicy | None = None
        self.background_runners: list[RolloutRunner] = []
        self.fatal_error: SimulatorUnavailable | None = None  # what stopped the run, if not a signal

    # ------------------------------------------------------------------ set up
    def build(self, policy: Policy) -> None:
        """The runner over `policy`, asleep until the first rollout (a resumed run restores the
        optimizer's state into the memory the engine would hold), and the overlapped mode's."""
        self.runner = self.build_runner(policy)
        self.runner.engine.release_memory()
        if self.overlap is not None:
            self._build_background_runners(policy)

    def _build_background_runners(self, policy: Policy) -> None:
        """One runner per step in flight, over the engine when it holds weights of its own (vLLM),
        else over an engine on a snapshot copy of the policy; all of them share that one engine."""
        depth = self.overlap.max_staleness
        self.pipeline, self.snapshot = RolloutPipeline(workers=depth), None
        first = self.runner
        if first.engine.samples_from_training_module:
            if is_sharded(self.module.policy_model):
                raise ValueError("--model.overlap with the hf engine needs an unsharded policy; use vllm")
            self.snapshot = SnapshotPolicy(policy)
            policy = self.snapshot.policy
            first = self.build_runner(policy)
        self.background_runners = [
            RolloutRunner(
                policy, first.engine, first.simulator, first.prompt_format, first.settings, first.components
            )
            for _ in range(depth)
        ]

    # ------------------------------------------------------------------ a step's dialogues
    def step_dialogues(self, batch: Sequence[Profile], step: int) -> list[Profile]:
        """The step's profiles, each at its curriculum level, each repeated group_size times."""
        batch = list(batch)
        if self.curriculum is not None:
            offset = self.ranks.rank * len(batch)
            batch = self.curriculum.assign(batch, step, run_seed(self.seed), offset=offset)
        return [profile for profile in batch for _ in range(self.group_size)]

    def group_ids(self, count: int) -> torch.Tensor:
        return torch.tensor([i // self.group_size for i in range(count)])

    def rollout_seed(self, step: int) -> int:
        return run_seed(self.seed) + 1_000_003 * step + 7919 * self.ranks.rank

    def generation_weights(self) -> contextlib.AbstractContextManager:
        engine = self.runner.engine if self.runner is not None else None
        return weights_for_generation(engine, self.module.policy_model)

    def roll_out(self, dialogues: list[Profile], step: int, seconds: dict) -> RolledOut | None:
        """The step's dialogues and the step whose weights sampled them; None when a stop (a
        signal, a simulator gone) drops the step."""
        if self.overlap is not None:
            return self._overlapped_roll_out(dialogues, step, seconds)
        started = time.perf_counter()
        seed = self.rollout_seed(step)

        def run(should_stop: Any) -> list[Trajectory]:
            with self.generation_weights():
                return self.runner.run(
                    dialogues, seed=seed, group_size=self.group_size, should_stop=should_stop
                )

        try:
            trajectories, fatal = run_unless_stopped(run, self.module._trainer, self.ranks.gather_objects)
        finally:
            # e.g. vLLM sleeps on GPUs, so that the update gets the memory, and so does the
            # checkpoint a stop writes next (a preemption's SIGTERM mostly lands in a rollout)
            self.runner.engine.release_memory()
        self.fatal_error = fatal or self.fatal_error
        if trajectories is None:
            return None
        seconds["rollout"] = time.perf_counter() - started
        seconds.update(generate=self.runner.timings["generate"], simulator=self.runner.timings["simulator"])
        get_registry().call_observers("rlver_on_rollout_end", trajectories=trajectories, step=step)
        return trajectories, step

    def sync_after_update(self, seconds: dict) -> None:
        """The engine samples from the updated policy (overlapped: synced before the next rollout
        starts, and timed there)."""
        if self.overlap is None:
            started = time.perf_counter()
            self.runner.engine.sync_weights()
            seconds["weight_sync"] = time.perf_counter() - started

    # ------------------------------------------------------------------ overlapped steps
    def _overlapped_roll_out(self, dialogues: list[Profile], step: int, seconds: dict) -> RolledOut | None:
        """This step's dialogues (the ones rolled out ahead, if they are these) and, when no
        rollout is left ahead, the start of the next steps'."""
        pipeline = self.pipeline
        started = time.perf_counter()
        sampled_by: list[int] = []

        def run(should_stop: Any) -> list[Trajectory]:
            pending = pipeline.matching(step, dialogues)
            if pending is not None:
                sampled_by.append(pending.weights_step)
                seconds.update(generate=pending.timings["generate"], simulator=pending.timings["simulator"])
                return pending.result()
            pipeline.wait()  # the engine's weights change only when no rollout runs
            sync_started = time.perf_counter()
            self._sync_engine_for_rollout()
            seconds["weight_sync"] = time.perf_counter() - sync_started
            sampled_by.append(step)
            with self.generation_weights():
                trajectories = self.runner.run(
                    dialogues,
                    seed=self.rollout_seed(step),
                    group_size=self.group_size,
                    should_stop=should_stop,
                )
            seconds.update(
                generate=self.runner.timings["generate"], simulator=self.runner.timings["simulator"]
            )
            return trajectories

        trajectories, fatal = run_unless_stopped(run, self.module._trainer, self.ranks.gather_objects)
        self.fatal_error = fatal or self.fatal_error
        if trajectories is None:
            return None
        pipeline.finish(step)
        seconds["rollout"] = time.perf_counter() - started  # the trainer's wait, not the rollout's length
        get_registry().call_observers("rlver_on_rollout_end", trajectories=trajectories, step=step)
        if not pipeline.pending:
            sync_started = time.perf_counter()
            self._start_rollouts_ahead(step + 1)
            seconds["weight_sync"] = seconds.get("weight_sync", 0.0) + time.perf_counter() - sync_started
        return trajectories, sampled_by[0]

    def _start_rollouts_ahead(self, first_step: int) -> None:
        """Start the rollouts of steps first_step .. first_step + max_staleness - 1 (those
        before `max_steps`) with the weights of now."""
        trainer = self.module._trainer
        last = first_step + self.overlap.max_staleness
        if trainer is not None and trainer.max_steps > 0:
            last = min(last, trainer.max_steps)
        if trainer is None or first_step >= last:
            return
        datamodule = getattr(trainer, "datamodule", None)
        if not hasattr(datamodule, "train_batch_at"):
            raise ValueError("--model.overlap needs rlver's ProfileDataModule (it foresees the next batch)")
        self._sync_engine_for_rollout()
        for step in range(first_step, last):
            dialogues = self.step_dialogues(datamodule.train_batch_at(step), step)
            runner = self.background_runners[step % len(self.background_runners)]
            run = background_run(
                runner, dialogues, self.rollout_seed(step), self.group_size, turn_progress(trainer)
            )
            self.pipeline.start(step, dialogues, weights_step=self.module.global_step, run=run)

    def _sync_engine_for_rollout(self) -> None:
        if self.snapshot is not None:
            self.snapshot.refresh()
        else:
            self.runner.engine.sync_weights()

    def corrected_advantages(
        self, advantages: torch.Tensor, proximal: torch.Tensor, batch: Any, sampled_by: int, metrics: dict
    ) -> torch.Tensor:
        """Dialogues sampled by older weights: decoupled PPO's behaviour correction."""
        if self.overlap is None:
            return advantages
        staleness = self.module.global_step - sampled_by
        return behaviour_correction(
            advantages, proximal, batch.engine_logprobs, batch.loss_mask, staleness,
            self.overlap.max_importance_weight, metrics,
        )  # fmt: skip

    # ------------------------------------------------------------------ the checkpoint's copy
    def save_pending(self, checkpoint: dict[str, Any]) -> None:
        """The finished rollouts ahead (the weights that sampled them are nowhere else)."""
        if self.overlap is None or not self.pipeline.pending:
            return
        saved = []
        for pending in self.pipeline.pending.values():
            try:
                trajectories = pending.result()
            except Exception:
                return  # a failed rollout ahead: the resumed run rolls those steps out again
            saved.append(
                {"step": pending.step, "weights_step": pending.weights_step,
                 "trajectories": trajectories_to_json(trajectories)}
            )  # fmt: skip
        checkpoint[PENDING_KEY] = saved

    def load_pending(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(PENDING_KEY)
        if self.overlap is None or saved is None:
            return
        for state in [saved] if isinstance(saved, dict) else saved:  # a dict: one, as first written
            trajectories = trajectories_from_json(state["trajectories"])
            profiles = [t.profile for t in trajectories]
            self.pipeline.pending[state["step"]] = PendingRollout(
                state["step"], profiles, state["weights_step"], trajectories=trajectories
            )
