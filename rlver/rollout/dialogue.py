"""One running dialogue's state, and what the schedules need from the runner that drives it.

The runner (`rlver.rollout.runner`) decides how a dialogue advances; the schedules
(`rlver.rollout.schedules`) decide when. Both read the state below; the schedules reach the
runner only through `DialogueDriver`, so the schedules never import the runner that uses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rlver.core.interfaces import UserSession, UserSimulator
    from rlver.core.trajectory import PolicyTurn, Trajectory
    from rlver.core.types import UserTurn


class RunningDialogue:
    """The mutable state of one running dialogue (`index`: its place in the call's order)."""

    def __init__(self, index: int, call_seed: int, trajectory: Trajectory, session: UserSession) -> None:
        self.index = index
        self.call_seed = call_seed  # the run's base seed: with `index`, its replies' seeds
        self.trajectory = trajectory
        self.session = session
        self.messages: list[dict[str, str]] = []  # the policy's view: system, user, assistant ...
        self.prompt_ids: list[int] = []
        self.prompt_text = ""


class MaxTurns(Protocol):
    @property
    def max_turns(self) -> int: ...


class DialogueDriver(Protocol):
    """The runner's side of a schedule: sample replies, let users answer, move dialogues on."""

    @property
    def settings(self) -> MaxTurns: ...  # read-only: a runner's richer settings satisfy it

    simulator: UserSimulator
    timings: dict[str, float]

    def check_stop(self, should_stop: Callable[[], bool] | None, turn: int) -> None: ...

    def fits_context(self, dialogue: RunningDialogue) -> bool: ...

    def sample(self, batch: Sequence[RunningDialogue]) -> list[PolicyTurn]: ...

    def advance(self, dialogue: RunningDialogue, policy_turn: PolicyTurn, user_turn: UserTurn) -> None: ...

    def openings(self, sessions: Sequence[UserSession], group_size: int) -> list[UserTurn]: ...

    def start(
        self, dialogues: Sequence[RunningDialogue], openings: Sequence[UserTurn]
    ) -> list[RunningDialogue]: ...
