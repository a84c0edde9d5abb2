"""How a training step gets its dialogues: the step's profiles, their seeds, the rollout.

Mixed into `RLVERModule`. Every step rolls out its own dialogues, or (`--model.overlap`) trains
on the ones rolled out during the last update while the next step's run (rlver.rollout.overlap).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from rlver.checkpoint.stopping import run_unless_stopped
from rlver.core.plugins import get_registry
from rlver.core.seeding import run_seed
from rlver.core.trajectory import Trajectory
from rlver.core.types import Profile
from rlver.modeling.networks import weights_for_generation
from rlver.rollout.overlap import OverlapHooks


class StepRollouts(OverlapHooks):
    """The module's rollout part; `_roll_out` is what `training_step` calls."""

    def _step_dialogues(self, batch: Sequence[Profile], step: int) -> list[Profile]:
        """The step's profiles, each at its curriculum level, each repeated group_size times."""
        batch = list(batch)
        if self.curriculum is not None:
            offset = self.global_rank * len(batch)
            batch = self.curriculum.assign(batch, step, run_seed(self.rollout_settings.seed), offset=offset)
        return [profile for profile in batch for _ in range(self.hparams.group_size)]

    def _rollout_seed(self, step: int) -> int:
        return run_seed(self.rollout_settings.seed) + 1_000_003 * step + 7919 * self.global_rank

    def _roll_out(
        self, dialogues: list[Profile], step: int, seconds: dict
    ) -> tuple[list[Trajectory], int] | None:
        """The step's dialogues and the step whose weights sampled them; None when a stop (a
        signal, a simulator gone) drops the step."""
        if self.overlap is not None:
            return self._overlapped_roll_out(dialogues, step, seconds)
        started = time.perf_counter()
        seed = self._rollout_seed(step)

        def run(should_stop: Any) -> list[Trajectory]:
            with self._generation_weights():
                return self.runner.run(
                    dialogues, seed=seed, group_size=self.hparams.group_size, should_stop=should_stop
                )

        try:
            trajectories, fatal = run_unless_stopped(run, self._trainer, self._gather_objects)
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

    def _generation_weights(self) -> contextlib.AbstractContextManager:
        engine = self.runner.engine if self.runner is not None else None
        return weights_for_generation(engine, self.policy_model)
