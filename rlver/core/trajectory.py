"""What a rollout produces: the policy's turns with their exact tokens, and finished dialogues.

Part of the contract (`rlver.core`): plugins see trajectories (reward functions, observer hooks)
and the training side reads them, so the types live below both. `rlver.rollout.runner` makes
them and re-exports these. `ParsedReply` (a prompt format's parse of a reply) is here because a
`PolicyTurn` holds one; `rlver.core.interfaces` re-exports it beside `PromptFormat`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlver.core.types import Profile, UserTurn


@dataclass(frozen=True)
class ParsedReply:
    """A policy completion split into what the user sees and the private reasoning.

    `format_ok` is False when the format's rules were broken (for the thinking
    format: missing, unclosed or nested tags); `format_error` says how.
    """

    visible: str
    thinking: str | None = None
    format_ok: bool = True
    format_error: str | None = None


@dataclass
class PolicyTurn:
    """One policy reply: exact ids in and out, their log-probs, and the parse."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    completion: str
    parsed: ParsedReply


@dataclass
class TokenSequence:
    """A packed training sequence; `loss_mask` is 1 exactly on policy-sampled tokens.

    `old_logprobs` holds the engine's log-probs at masked positions, 0 elsewhere.
    `turn_spans` lists (turn index, start, end) of each policy reply in the sequence.
    """

    input_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    turn_spans: list[tuple[int, int, int]]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class Trajectory:
    """A finished dialogue: the transcript, the exact tokens, and the outcome."""

    profile: Profile
    seed: int
    system_prompt: str
    user_turns: list[UserTurn] = field(default_factory=list)
    policy_turns: list[PolicyTurn] = field(default_factory=list)
    termination: str = ""
    components: dict[str, Any] = field(default_factory=dict)
    difficulty: str | None = None  # the level the user played (per simulator, profile or curriculum)

    @property
    def start_emotion(self) -> float:
        return self.user_turns[0].emotion

    @property
    def final_emotion(self) -> float:
        return self.user_turns[-1].emotion

    @property
    def emotions(self) -> list[float]:
        """Emotion after the opening line and after each policy reply."""
        return [turn.emotion for turn in self.user_turns]

    @property
    def num_turns(self) -> int:
        return len(self.policy_turns)

    @property
    def format_violations(self) -> int:
        return sum(not turn.parsed.format_ok for turn in self.policy_turns)

    @property
    def sequences(self) -> list[TokenSequence]:
        return pack_sequences(self.policy_turns)

    def to_record(self) -> dict[str, Any]:
        """The self-describing transcript line written to JSONL."""
        turns: list[dict[str, Any]] = []
        for index, user_turn in enumerate(self.user_turns):
            user: dict[str, Any] = {"role": "user", "text": user_turn.text, "emotion": user_turn.emotion}
            if index > 0:
                user["change"] = user_turn.change
                user["reason"] = user_turn.reason
            turns.append(user)
            if index < len(self.policy_turns):
                policy_turn = self.policy_turns[index]
                turns.append(
                    {
                        "role": "assistant",
                        "text": policy_turn.parsed.visible,
                        "thinking": policy_turn.parsed.thinking,
                        "format_ok": policy_turn.parsed.format_ok,
                        "format_error": policy_turn.parsed.format_error,
                        "num_tokens": len(policy_turn.response_ids),
                        "finish_reason": policy_turn.finish_reason,
                    }
                )
        profile = self.profile
        return {
            "profile_id": profile.id,
            "theme": profile.theme.value if profile.theme else None,
            "personality": profile.personality.value if profile.personality else None,
            "language": profile.language,
            **self.components,
            "seed": self.seed,
            "difficulty": self.difficulty,
            "system_prompt": self.system_prompt,
            "start_emotion": self.start_emotion,
            "final_emotion": self.final_emotion,
            "emotions": self.emotions,
            "termination": self.termination,
            "num_turns": self.num_turns,
            "format_violations": self.format_violations,
            "turns": turns,
        }


def pack_sequences(policy_turns: Sequence[PolicyTurn]) -> list[TokenSequence]:
    """Pack turns into sequences; a turn whose prompt extends the previous sequence joins it."""
    sequences: list[TokenSequence] = []
    for index, turn in enumerate(policy_turns):
        current = sequences[-1] if sequences else None
        if current is not None and turn.prompt_ids[: len(current)] == current.input_ids:
            added = turn.prompt_ids[len(current) :]
            current.input_ids.extend(added)
            current.loss_mask.extend([0] * len(added))
            current.old_logprobs.extend([0.0] * len(added))
        else:
            current = TokenSequence(
                list(turn.prompt_ids), [0] * len(turn.prompt_ids), [0.0] * len(turn.prompt_ids), []
            )
            sequences.append(current)
        start = len(current)
        current.input_ids.extend(turn.response_ids)
        current.loss_mask.extend([1] * len(turn.response_ids))
        current.old_logprobs.extend(turn.logprobs)
        current.turn_spans.append((index, start, len(current)))
    return sequences


def summarize(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Mean final emotion, success (>= 100) and failure (< 10) counts, mean turns."""
    count = len(trajectories)
    if count == 0:
        return {"dialogues": 0}
    finals = [t.final_emotion for t in trajectories]
    return {
        "dialogues": count,
        "mean_final_emotion": sum(finals) / count,
        "success": sum(t.termination == "success" for t in trajectories),
        "failure": sum(t.termination == "failure" for t in trajectories),
        "mean_turns": sum(t.num_turns for t in trajectories) / count,
        "format_violations": sum(t.format_violations for t in trajectories),
    }
