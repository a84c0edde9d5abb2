"""Built-in rewards: final emotion, thinking-format compliance, difficulty-aware emotion gain."""

from __future__ import annotations

from collections.abc import Sequence

from rlver import hookimpl
from rlver.interfaces import RewardFunction
from rlver.rollout import Trajectory


class FinalEmotionReward(RewardFunction):
    """The paper's reward: max(final emotion / 100, 0), once per dialogue."""

    def __call__(self, trajectories: Sequence[Trajectory]) -> list[float]:
        return [max(t.final_emotion / 100.0, 0.0) for t in trajectories]


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
