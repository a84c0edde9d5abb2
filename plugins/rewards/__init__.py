"""Built-in rewards: final emotion, thinking-format compliance, difficulty-aware emotion gain, the
per-turn emotion change, and a cost for phrasing shared across users (shared_phrasing.py)."""

from __future__ import annotations

from collections.abc import Sequence

from rlver import hookimpl
from rlver.core.interfaces import RewardFunction
from rlver.core.trajectory import Trajectory

from .shared_phrasing import SharedPhrasingCost


def emotion_potential(emotion: float) -> float:
    """The paper's reward as a function of an emotion: max(emotion / 100, 0)."""
    return max(emotion / 100.0, 0.0)


class FinalEmotionReward(RewardFunction):
    """The paper's reward: max(final emotion / 100, 0), once per dialogue."""

    def __call__(self, trajectories: Sequence[Trajectory]) -> list[float]:
        return [emotion_potential(t.final_emotion) for t in trajectories]


class EmotionChangeReward(RewardFunction):
    """Per policy turn: how the user's emotion moved after that reply, scaled as `final_emotion`.

    Turn t earns phi(E_t) - phi(E_{t-1}), phi(E) = max(E / 100, 0) and E_t the emotion the user
    reported after reply t: the emotion as the simulator applied it, so the difficulty's clamp
    and scaling and the end conditions (success, failure, a turn the simulator could not play:
    no change) are in it already. The turns sum to phi(E_T) - phi(E_0): with the final emotion
    as a potential, this is `final_emotion` less a constant of the dialogue's start, and at
    gamma = 1 it moves each turn's return-to-go to what that turn and the later ones earned.
    At gamma < 1 shaping is potential-based only as gamma * phi(E_t) - phi(E_{t-1}), which this
    is not: the trainer refuses the pair (`potential_based`, rlver.train.components).
    """

    # Its turns are differences of a potential, phi(E_t) - phi(E_{t-1}): exact only undiscounted.
    potential_based = True

    def __call__(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        scores = []
        for trajectory in trajectories:
            emotions = trajectory.emotions
            per_turn = []
            for turn in range(trajectory.num_turns):
                before = emotions[min(turn, len(emotions) - 1)]
                after = emotions[min(turn + 1, len(emotions) - 1)]  # no reaction yet: no change
                per_turn.append(emotion_potential(after) - emotion_potential(before))
            scores.append(per_turn)
        return scores


class FormatReward(RewardFunction):
    """Thinking-format compliance: `bonus` if every reply is well-formed, else minus
    `penalty` times the fraction of malformed replies.

    Args:
        penalty: Subtracted, scaled by the fraction of malformed replies.
        bonus: Added when every reply is well-formed.
    """

    def __init__(self, penalty: float = 1.0, bonus: float = 0.0) -> None:
        if penalty < 0 or bonus < 0:
            raise ValueError("penalty and bonus must be >= 0")
        self.penalty, self.bonus = penalty, bonus

    def __call__(self, trajectories: Sequence[Trajectory]) -> list[float]:
        scores = []
        for trajectory in trajectories:
            turns = max(trajectory.num_turns, 1)
            if trajectory.format_violations == 0:
                scores.append(self.bonus)
            else:
                scores.append(-self.penalty * trajectory.format_violations / turns)
        return scores


class EmotionGainReward(RewardFunction):
    """Emotion gained relative to where this environment's difficulty started the user.

    (final - start) / (100 - start) for gains and (final - start) / start for
    losses, so in [-1, 1] whatever the start: reaching 100 from 30 (hard) and from
    50 (easy) both score 1, and an easy start is not a free head start.
    """

    def __call__(self, trajectories: Sequence[Trajectory]) -> list[float]:
        scores = []
        for trajectory in trajectories:
            start, final = trajectory.start_emotion, trajectory.final_emotion
            gain = final - start
            headroom = (100.0 - start) if gain >= 0 else start
            scores.append(gain / headroom if headroom > 0 else 0.0)
        return scores


@hookimpl
def rlver_register_rewards(register):
    register("final_emotion", FinalEmotionReward)
    register("format", FormatReward)
    register("emotion_gain", EmotionGainReward)
    register("emotion_change", EmotionChangeReward)
    register("shared_phrasing", SharedPhrasingCost)
