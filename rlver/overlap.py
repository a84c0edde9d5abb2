"""Overlapped rollouts (opt-in): the next step's dialogues run while this step's update does.

Step k trains on dialogues sampled by the weights of step k-1 while the dialogues of step k+1
are rolled out in a background thread with the weights of step k. Staleness is exactly one
step for every dialogue but those of the first step (none): a rollout never sees a weight
sync while it runs, so what it samples depends only on the weights it started with and its
seeds, never on timing; a resumed run therefore trains on what the uninterrupted one would
(the checkpoint holds the finished next-step dialogues, since the weights they were sampled
with are no longer anywhere).

The correction is decoupled PPO's (Hilton et al. 2022; AReaL): the clipped ratio is taken
against the proximal policy (the weights about to be updated, whose log-probs the trainer
computes anyway), and each token's advantage is multiplied by the behaviour importance weight
pi_prox / pi_behaviour (the engine's recorded log-probs), truncated at `max_importance_weight`
as in truncated importance sampling. Because the weight is positive and detached, scaling the
advantage is the same as scaling the clipped surrogate.

The engine must hold weights of its own: vLLM does; `hf` samples from the training module
itself, so the overlapped mode gives it a snapshot copy of the policy (one more copy of the
weights in memory) that is refreshed between rollouts.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from rlver.interfaces import ParsedReply
from rlver.models import Policy
from rlver.rollout import RolloutRunner
from rlver.trajectory import PolicyTurn, Trajectory
from rlver.types import Profile, UserTurn

PENDING_KEY = "rlver_overlap_pending"


@dataclass(frozen=True)
class OverlapSettings:
    """`--model.overlap`: roll out the next step while this step's update runs.

    Args:
        max_importance_weight: Truncation of the behaviour importance weight
            pi_prox / pi_behaviour (>= 1); tokens above it count at this weight.
    """

    max_importance_weight: float = 2.0

    def __post_init__(self) -> None:
        if not self.max_importance_weight >= 1.0:
            raise ValueError(
                f"--model.overlap.max_importance_weight ({self.max_importance_weight}) must be >= 1"
            )


@dataclass
class PendingRollout:
    """The next step's dialogues: in flight (`future`) or finished (`trajectories`)."""

    step: int
    profiles: list[Profile]
    weights_step: int  # the step whose weights sampled them
    future: Future | None = None
    trajectories: list[Trajectory] | None = None
    timings: dict[str, float] = dataclasses.field(default_factory=lambda: {"generate": 0.0, "simulator": 0.0})

    def result(self) -> list[Trajectory]:
        if self.trajectories is None:
            assert self.future is not None
            self.trajectories = self.future.result()  # an exception in the rollout surfaces here
        return self.trajectories


class RolloutPipeline:
    """One background rollout at a time, for the step after the one being trained."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlver-next-step")
        self.pending: PendingRollout | None = None

    def start(self, step: int, profiles: list[Profile], weights_step: int, run: Any) -> None:
        self.pending = PendingRollout(step, list(profiles), weights_step, future=self._pool.submit(run))

    def matching(self, step: int, profiles: list[Profile]) -> PendingRollout | None:
        """The pending rollout, finished, when it is the one for `step` and these profiles; else
        None (e.g. an epoch's last, partial batch differs from the one foreseen). It stays
        pending until the step goes on (`pending = None`): a stop now checkpoints it."""
        pending = self.pending
        if pending is None:
            return None
        pending.result()
        if pending.step != step or pending.profiles != list(profiles):
            return None
        return pending

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()

    def drop(self) -> None:
        """Forget the pending rollout (the run ends, or a stop); a running one finishes unseen."""
        self.pending = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlver-next-step")


def behaviour_correction(
    advantages: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    staleness: int,
    cap: float,
    metrics: dict[str, float],
) -> torch.Tensor:
    """Advantages times min(pi_prox / pi_behaviour, cap) per token; logs the weights.

    All tensors are (S, L) over packed sequences; `staleness`: the steps between the weights
    that sampled them and the proximal weights (logged).
    """
    with torch.no_grad():
        weights = torch.exp((proximal_logprobs - behaviour_logprobs).clamp(max=20.0)) * mask
        truncated = weights.clamp(max=cap)
        counted = mask.sum().clamp(min=1.0)
        metrics["offpolicy/importance_weight_mean"] = float(weights.sum() / counted)
        metrics["offpolicy/importance_weight_max"] = float(weights.max()) if mask.any() else 0.0
        metrics["offpolicy/truncated_fraction"] = float(((weights > cap) * mask).sum() / counted)
        metrics["offpolicy/staleness"] = float(staleness)
    return advantages * torch.where(mask.bool(), truncated, torch.ones_like(truncated))


def engine_for_overlap(spec: Any) -> Any:
    """The engine spec for overlapped steps: vLLM on a thread of its own (its state is per
    thread, and the background rollout and the trainer both call it)."""
    name = spec if isinstance(spec, str) else spec.get("name")
    if name != "vllm":
        return spec
    return {**({"name": spec} if isinstance(spec, str) else spec), "own_thread": True}


class SnapshotPolicy:
    """A frozen copy of the policy for an engine that would otherwise sample from the module
    being trained (`hf`); `refresh` copies the live weights in between rollouts."""

    def __init__(self, live: Policy) -> None:
        self.live = live
        model = copy.deepcopy(live.model).eval()
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        self.policy = dataclasses.replace(live, model=model)

    @torch.no_grad()
    def refresh(self) -> None:
        self.policy.model.load_state_dict(self.live.model.state_dict())


# ------------------------------------------------------------------ the checkpoint's copy
def trajectories_to_json(trajectories: list[Trajectory]) -> str:
    """Exact (token ids, log-probs as float64 reprs) and plain: loads with weights_only=True."""
    return json.dumps([dataclasses.asdict(t) for t in trajectories])


def trajectories_from_json(text: str) -> list[Trajectory]:
    def trajectory(state: dict[str, Any]) -> Trajectory:
        profile = {**state["profile"], "cha_group": tuple(state["profile"]["cha_group"])}
        turns = [
            PolicyTurn(**{**turn, "parsed": ParsedReply(**turn["parsed"])}) for turn in state["policy_turns"]
        ]
        return Trajectory(
            **{
                **state,
                "profile": Profile(**profile),
                "user_turns": [UserTurn(**turn) for turn in state["user_turns"]],
                "policy_turns": turns,
            }
        )

    return [trajectory(state) for state in json.loads(text)]


class OverlapHooks:
    """The overlapped mode's part of `RLVERModule` (mixed in; inactive when `overlap` is None)."""

    def _overlapped_roll_out(self, dialogues: list[Profile], step: int, seconds: dict) -> Any:
        """This step's dialogues (the ones rolled out during the last update, if they are these)
        and the start of the next step's; (trajectories, weights step), or None on a stop."""
        from rlver.plugins import get_registry
        from rlver.stopping import run_unless_stopped

        pipeline: RolloutPipeline = self.pipeline
        started = time.perf_counter()
        sampled_by: list[int] = []

        def run(should_stop: Any) -> list[Trajectory]:
            pending = pipeline.matching(step, dialogues)
            if pending is not None:
                sampled_by.append(pending.weights_step)
                seconds.update(generate=pending.timings["generate"], simulator=pending.timings["simulator"])
                return pending.result()
            sync_started = time.perf_counter()
            self._sync_engine_for_rollout()
            seconds["weight_sync"] = time.perf_counter() - sync_started
            sampled_by.append(step)
            with self._generation_weights():
                trajectories = self.runner.run(
                    dialogues, seed=self._rollout_seed(step), group_size=self.hparams.group_size,
                    should_stop=should_stop,
                )  # fmt: skip
            seconds.update(
                generate=self.runner.timings["generate"], simulator=self.runner.timings["simulator"]
            )
            return trajectories

        trajectories, fatal = run_unless_stopped(run, self._trainer, self._gather_objects)
        self.fatal_error = fatal or self.fatal_error
        if trajectories is None:
            return None
        pipeline.pending = None
        seconds["rollout"] = time.perf_counter() - started  # the trainer's wait, not the rollout's length
        get_registry().call_observers("rlver_on_rollout_end", trajectories=trajectories, step=step)
        sync_started = time.perf_counter()
        self._start_next_rollout(step + 1)
        seconds["weight_sync"] = seconds.get("weight_sync", 0.0) + time.perf_counter() - sync_started
        return trajectories, sampled_by[0]

    def _start_next_rollout(self, step: int) -> None:
        trainer = self._trainer
        if trainer is None or (trainer.max_steps > 0 and step >= trainer.max_steps):
            return
        datamodule = getattr(trainer, "datamodule", None)
        if not hasattr(datamodule, "train_batch_at"):
            raise ValueError("--model.overlap needs rlver's ProfileDataModule (it foresees the next batch)")
        dialogues = self._step_dialogues(datamodule.train_batch_at(step), step)
        self._sync_engine_for_rollout()
        runner, seed, group_size = self.background_runner, self._rollout_seed(step), self.hparams.group_size

        def run() -> list[Trajectory]:
            trajectories = runner.run(dialogues, seed=seed, group_size=group_size)
            self.pipeline.pending.timings = dict(runner.timings)
            return trajectories

        self.pipeline.start(step, dialogues, weights_step=self.global_step, run=run)

    def _sync_engine_for_rollout(self) -> None:
        if self.snapshot is not None:
            self.snapshot.refresh()
        else:
            self.runner.engine.sync_weights()

    def _corrected_advantages(
        self, advantages: torch.Tensor, proximal: torch.Tensor, batch: Any, sampled_by: int, metrics: dict
    ) -> torch.Tensor:
        staleness = self.global_step - sampled_by
        return behaviour_correction(
            advantages, proximal, batch.engine_logprobs, batch.loss_mask, staleness,
            self.overlap.max_importance_weight, metrics,
        )  # fmt: skip

    def _build_background_runner(self, policy: Policy) -> None:
        """The runner the next step's rollouts use: the module's engine when it holds weights
        of its own (vLLM), else an engine over a snapshot copy of the policy."""
        from rlver.distributed import is_sharded

        self.pipeline, self.snapshot = RolloutPipeline(), None
        if getattr(self.runner.engine, "samples_from_training_module", False):
            if is_sharded(self.policy_model):
                raise ValueError("--model.overlap with the hf engine needs an unsharded policy; use vllm")
            self.snapshot = SnapshotPolicy(policy)
            self.background_runner = self.rollout_runner(self.snapshot.policy)
        else:  # the same engine (one copy of the weights), with a runner of its own (timings)
            live = self.runner
            self.background_runner = RolloutRunner(
                policy, live.engine, live.simulator, live.prompt_format, live.settings, live.components
            )

    def save_pending_rollout(self, checkpoint: dict[str, Any]) -> None:
        pending = self.pipeline.pending if self.overlap is not None else None
        if pending is None:
            return
        try:
            trajectories = pending.result()
        except Exception:
            return
        checkpoint[PENDING_KEY] = {
            "step": pending.step,
            "weights_step": pending.weights_step,
            "trajectories": trajectories_to_json(trajectories),
        }

    def load_pending_rollout(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(PENDING_KEY)
        if self.overlap is None or state is None:
            return
        trajectories = trajectories_from_json(state["trajectories"])
        profiles = [t.profile for t in trajectories]
        self.pipeline.pending = PendingRollout(
            state["step"], profiles, state["weights_step"], trajectories=trajectories
        )
