"""Overlapped rollouts (opt-in): the next steps' dialogues run while this step's update does.

With `max_staleness` k, the step that finds no rollout ahead of it starts the rollouts of the
next k steps at once, in background threads, with its own (not yet updated) weights; steps
t+1..t+k then train on them, at staleness 1..k. k = 1 is the plain pipeline: step k trains on
dialogues sampled by the weights of step k-1 while those of step k+1 run. A larger k keeps more
dialogues in flight (k steps' worth) where users are slow to answer, at more staleness. The
engine's weights change only when no rollout runs, so what a rollout samples depends only on
the weights it started with and its seeds, never on timing; a resumed run therefore trains on
what the uninterrupted one would (the checkpoint holds the finished rollouts ahead, since the
weights they were sampled with are no longer anywhere).

The correction is decoupled PPO's (Hilton et al. 2022; AReaL): the clipped ratio is taken
against the proximal policy (the weights about to be updated, whose log-probs the trainer
computes anyway), and each token's advantage is multiplied by the behaviour importance weight
pi_prox / pi_behaviour (the engine's recorded log-probs), truncated at `max_importance_weight`
as in truncated importance sampling. Because the weight is positive and detached, scaling the
advantage is the same as scaling the clipped surrogate.

The engine must hold weights of its own: vLLM does; `hf` samples from the training module
itself, so the overlapped mode gives it a snapshot copy of the policy (one more copy of the
weights in memory) that is refreshed when no rollout runs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from rlver.core.interfaces import ParsedReply
from rlver.core.trajectory import PolicyTurn, Trajectory
from rlver.core.types import Profile, UserTurn
from rlver.modeling.models import Policy
from rlver.rollout.runner import RolloutRunner

PENDING_KEY = "rlver_overlap_pending"


@dataclass(frozen=True)
class OverlapSettings:
    """`--model.overlap`: roll out the next step while this step's update runs.

    Args:
        max_importance_weight: Truncation of the behaviour importance weight
            pi_prox / pi_behaviour (>= 1); tokens above it count at this weight.
        max_staleness: How many steps ahead rollouts run (>= 1): the step with none ahead starts
            the next `max_staleness` steps' rollouts together, so a step trains on dialogues
            sampled 1 to `max_staleness` updates ago.
    """

    max_importance_weight: float = 2.0
    max_staleness: int = 1

    def __post_init__(self) -> None:
        if not self.max_importance_weight >= 1.0:
            raise ValueError(
                f"--model.overlap.max_importance_weight ({self.max_importance_weight}) must be >= 1"
            )
        staleness = self.max_staleness
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 1:
            raise ValueError(f"--model.overlap.max_staleness ({staleness!r}) must be an integer >= 1")


@dataclass
class PendingRollout:
    """A step's dialogues rolled out ahead: in flight (`future`) or finished (`trajectories`)."""

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
    """The rollouts of the steps ahead of the one being trained, each in a background thread."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = workers
        self._pool = self._new_pool()
        self.pending: dict[int, PendingRollout] = {}  # by step, in step order

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="rlver-next-steps")

    def start(
        self, step: int, profiles: list[Profile], weights_step: int, run: Callable[[dict], list[Trajectory]]
    ) -> PendingRollout:
        """Run `run(timings)` in the background for `step`; it fills `timings` as it goes."""
        pending = PendingRollout(step, list(profiles), weights_step)
        pending.future = self._pool.submit(run, pending.timings)
        self.pending[step] = pending
        return pending

    def matching(self, step: int, profiles: list[Profile]) -> PendingRollout | None:
        """The pending rollout, finished, when it is the one for `step` and these profiles; else
        None (e.g. an epoch's last, partial batch differs from the one foreseen). It stays
        pending until the step goes on (`finish`): a stop now checkpoints it."""
        pending = self.pending.get(step)
        if pending is None:
            return None
        pending.result()
        if pending.profiles != list(profiles):
            return None
        return pending

    def finish(self, step: int) -> None:
        """The step has its dialogues: its rollout (used or not) is no longer pending."""
        self.pending.pop(step, None)

    def wait(self) -> None:
        """Until no rollout runs (the engine is then free; an error surfaces here)."""
        for pending in list(self.pending.values()):
            pending.result()

    def drop(self) -> None:
        """Forget the pending rollouts (the run ends, or a stop); running ones finish unseen."""
        self.pending = {}
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._new_pool()


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
    thread, and the background rollout and the trainer both call it), never asleep (it generates
    through the update; a sleeping engine defers its sync to the next generation, which here
    would read the weights while the update changes them)."""
    name = spec if isinstance(spec, str) else spec.get("name")
    if name != "vllm":
        return spec
    return {
        **({"name": spec} if isinstance(spec, str) else spec),
        "own_thread": True,
        "sleep_between_rollouts": False,
    }


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


def background_run(
    runner: RolloutRunner,
    dialogues: list[Profile],
    seed: int,
    group_size: int,
    on_turn: Callable | None = None,
) -> Callable:
    """`run(timings)` for the pipeline: `runner`'s dialogues, its timings filled in after."""

    def run(timings: dict) -> list[Trajectory]:
        trajectories = runner.run(dialogues, seed=seed, group_size=group_size, on_turn=on_turn)
        timings.update(runner.timings)
        return trajectories

    return run
