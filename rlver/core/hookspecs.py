"""Hook specifications: the only ways a plugin extends rlver.

Registration hooks receive a `register(name, factory)` callable. A factory is a
class or function whose keyword arguments are the options a config may set;
names are unique per kind across all installed plugins. Observer hooks are
called with keyword arguments and their return values are ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from rlver.core.trajectory import Trajectory

hookspec = pluggy.HookspecMarker("rlver")

Register = Callable[[str, Callable[..., Any]], None]


@hookspec
def rlver_register_simulators(register: Register) -> None:
    """Register user simulator factories (returning `rlver.core.interfaces.UserSimulator`)."""


@hookspec
def rlver_register_rewards(register: Register) -> None:
    """Register reward function factories (returning `rlver.core.interfaces.RewardFunction`)."""


@hookspec
def rlver_register_advantages(register: Register) -> None:
    """Register advantage estimator factories (returning `rlver.core.interfaces.AdvantageEstimator`)."""


@hookspec
def rlver_register_formats(register: Register) -> None:
    """Register prompt format factories (returning `rlver.core.interfaces.PromptFormat`)."""


@hookspec
def rlver_register_engines(register: Register) -> None:
    """Register rollout engine factories (returning `rlver.core.interfaces.RolloutEngine`).

    An engine factory receives the loaded policy as `policy=` (an
    `rlver.modeling.models.Policy`) plus its own options.
    """


@hookspec
def rlver_register_judges(register: Register) -> None:
    """Register dialogue judge factories (returning `rlver.core.interfaces.DialogueJudge`).

    A judge scores finished dialogues on named dimensions (empathy, insight, action, ...);
    `rlver score --judge NAME` reports them beside Score / Success / Failure.
    """


@hookspec
def rlver_on_rollout_end(trajectories: Sequence[Trajectory], step: int | None) -> None:
    """Observe a finished batch of dialogues (step is None outside training)."""


@hookspec
def rlver_on_train_step_end(metrics: dict[str, float], step: int) -> None:
    """Observe the metrics of a finished training step."""
