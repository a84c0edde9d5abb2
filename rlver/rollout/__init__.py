"""Dialogues between the policy and simulated users: the runner (`runner`), when each reply is
sampled (`schedules`, `dialogue`), the pieces of rollouts overlapped with the update (`overlap`:
the pipeline, the correction, the snapshot) and the transcript formats (`transcripts`). A training
step's use of them is the training side's (`rlver.train.rollouts`).

May import `rlver.core`, `rlver.data`, `rlver.parallel`, `rlver.modeling` and `rlver.checkpoint`
(the graceful stop). Never imports the training side (`rlver.train`) nor the planner.

`from rlver.rollout import RolloutRunner` (the flat layout's module) still works, with a
deprecation warning: the names now live in `rlver.rollout.runner` and `rlver.core.trajectory`.
"""

from rlver.core.legacy_paths import moved_attribute

# The old module's public names (its __all__), all still exported by the runner.
__getattr__ = moved_attribute(
    __name__,
    "rlver.rollout.runner",
    names=(
        "PolicyTurn", "RolloutRunner", "RolloutSettings", "StopRequested", "TokenSequence", "Trajectory",
        "dialogue_seed", "pack_sequences", "summarize",
    ),
)  # fmt: skip
