"""Multi-turn rollouts: a batch of dialogues between the policy and simulated users.

The user speaks first. Each turn, every active dialogue's context goes to the
engine in one batched call; the format splits each completion into thinking
and visible reply; the simulator answers all active dialogues in one call and
moves their emotions. Finished dialogues leave the batch; the rest go on.

Token exactness: a policy turn stores the exact prompt ids given to the engine
and the exact ids it sampled, with their log-probs, so training never
re-tokenises policy text. When the history keeps the completion verbatim (the
non-thinking format), the next prompt is built by appending tokens to the
previous prompt + sampled ids, so the whole dialogue packs into one sequence
with the loss mask on the sampled spans. When the history differs from what
was sampled (thinking is hidden from the next turn), the next prompt is
rendered afresh and that turn starts a new sequence.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlver.interfaces import (
    ParsedReply,
    PromptFormat,
    RolloutEngine,
    SamplingSettings,
    UserSession,
    UserSimulator,
)
from rlver.models import Policy
from rlver.types import Profile, UserTurn


class StopRequested(Exception):
    """A stop was asked for (SIGTERM, Ctrl-C): the rest of this rollout or step is dropped."""


@dataclass(frozen=True)
class RolloutSettings:
    """How dialogues are run.

    Args:
        max_turns: Policy replies per dialogue at most (each is followed by a user reaction).
        max_new_tokens: Token limit of one policy reply (thinking included).
        temperature: Sampling temperature; 0 is greedy.
        top_p: Nucleus sampling mass.
        max_context_tokens: A dialogue whose next prompt plus reply would exceed this ends
            with termination "context_limit".
        seed: Base seed; dialogue i of a call uses a seed derived from it, the profile and i.
    """

    max_turns: int = 8
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    max_context_tokens: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns ({self.max_turns}) must be >= 1")
        if self.max_context_tokens <= self.max_new_tokens:
            raise ValueError(
                f"max_context_tokens ({self.max_context_tokens}) "
                f"must exceed max_new_tokens ({self.max_new_tokens})"
            )
        SamplingSettings(self.max_new_tokens, self.temperature, self.top_p, self.seed)  # validates the rest


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


def dialogue_seed(base_seed: int, profile_id: str, index: int) -> int:
    """A stable per-dialogue seed (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{base_seed}:{profile_id}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class _Dialogue:
    """The mutable state of one running dialogue."""

    def __init__(self, trajectory: Trajectory, session: UserSession, messages: list[dict[str, str]]) -> None:
        self.trajectory = trajectory
        self.session = session
        self.messages = messages  # the policy's view: system, user, assistant (visible) ...
        self.prompt_ids: list[int] = []
        self.prompt_text = ""


class ChatContext:
    """Builds prompt ids from chat messages with the tokenizer's chat template."""

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.stop_texts = {tokenizer.decode([i]) for i in stop_ids}

    def render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def extend(
        self, prompt_ids: list[int], prompt_text: str, turn: PolicyTurn, next_text: str, content: str
    ) -> list[int] | None:
        """Prompt ids for the next turn built on the exact sampled ids, or None if impossible.

        Possible when the re-rendered conversation starts with the previous prompt
        text followed by the completion text; the rest (end-of-turn marker, the
        user's message, the generation prompt) is tokenised and appended.
        """
        head = prompt_text + content
        if not next_text.startswith(head):
            return None
        glue = next_text[len(head) :]
        if turn.finish_reason == "stop":
            stop_text = self.tokenizer.decode(turn.response_ids[-1:])
            if not glue.startswith(stop_text):
                return None
            glue = glue[len(stop_text) :]
        return prompt_ids + turn.response_ids + self.encode(glue)


class RolloutRunner:
    """Runs batches of dialogues with one engine, simulator and prompt format."""

    def __init__(
        self,
        policy: Policy,
        engine: RolloutEngine,
        simulator: UserSimulator,
        prompt_format: PromptFormat,
        settings: RolloutSettings,
        components: dict[str, Any] | None = None,
    ) -> None:
        self.policy = policy
        self.engine = engine
        self.simulator = simulator
        self.prompt_format = prompt_format
        self.settings = settings
        self.components = dict(components or {})
        self.context = ChatContext(policy.tokenizer, policy.stop_token_ids)
        self.timings = {"generate": 0.0, "simulator": 0.0}  # seconds spent in the last run()

    def run(
        self,
        profiles: Sequence[Profile],
        *,
        seed: int | None = None,
        group_size: int = 1,
        on_turn: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Trajectory]:
        """Run one dialogue per profile. Order is kept.

        Each run of `group_size` consecutive profiles is a group (GRPO's n dialogues of
        one profile): its members face the same user (one simulator seed) with the same
        opening line, written once; the policy samples each member's replies with its own
        seed. on_turn(turn, active) is called after every turn, for progress display;
        should_stop() before every turn: when it says True, StopRequested is raised.
        """
        if group_size < 1 or len(profiles) % group_size:
            raise ValueError(f"{len(profiles)} profiles do not split into groups of {group_size}")
        base_seed = self.settings.seed if seed is None else seed
        self.timings = {"generate": 0.0, "simulator": 0.0}
        seeds = [dialogue_seed(base_seed, profile.id, i) for i, profile in enumerate(profiles)]
        leaders = range(0, len(profiles), group_size)
        for leader in leaders:
            members = profiles[leader : leader + group_size]
            if any(member.id != members[0].id for member in members):
                raise ValueError(f"group at {leader} mixes profiles {sorted({m.id for m in members})}")
        sessions = [
            self.simulator.open(profile, seed=seeds[index - index % group_size])
            for index, profile in enumerate(profiles)
        ]
        started = time.perf_counter()
        openings = self._openings(sessions, group_size)
        self.timings["simulator"] += time.perf_counter() - started
        dialogues = [
            self._open(session, seed, opening)
            for session, seed, opening in zip(sessions, seeds, openings, strict=True)
        ]
        active = [d for d in dialogues if not d.trajectory.termination]
        for turn in range(self.settings.max_turns):
            if should_stop is not None and should_stop():
                raise StopRequested(f"stopped before turn {turn}")
            active = [d for d in active if self._fits_context(d)]
            if not active:
                break
            sampling = SamplingSettings(
                self.settings.max_new_tokens,
                self.settings.temperature,
                self.settings.top_p,
                seed=base_seed + turn,
            )
            started = time.perf_counter()
            generations = self.engine.generate([d.prompt_ids for d in active], sampling)
            self.timings["generate"] += time.perf_counter() - started
            policy_turns = []
            for dialogue, generation in zip(active, generations, strict=True):
                completion = self.policy.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
                policy_turns.append(
                    PolicyTurn(
                        prompt_ids=list(dialogue.prompt_ids),
                        response_ids=list(generation.token_ids),
                        logprobs=list(generation.logprobs),
                        finish_reason=generation.finish_reason,
                        completion=completion,
                        parsed=self.prompt_format.parse(completion),
                    )
                )
            started = time.perf_counter()
            user_turns = self.simulator.respond_batch(
                [d.session for d in active], [t.parsed.visible for t in policy_turns]
            )
            self.timings["simulator"] += time.perf_counter() - started
            for dialogue, policy_turn, user_turn in zip(active, policy_turns, user_turns, strict=True):
                self._advance(dialogue, policy_turn, user_turn, last_turn=turn == self.settings.max_turns - 1)
            active = [d for d in active if not d.trajectory.termination]
            if on_turn is not None:
                on_turn(turn + 1, len(active))
        return [d.trajectory for d in dialogues]

    def _openings(self, sessions: Sequence[UserSession], group_size: int) -> list[UserTurn]:
        """Each group's first session writes the opening; the others adopt it."""
        if not sessions:
            return []
        leaders = list(range(0, len(sessions), group_size))
        written = self.simulator.opening_batch([sessions[i] for i in leaders])
        openings: list[UserTurn | None] = [None] * len(sessions)
        own: list[int] = []  # sessions that cannot adopt an opening write their own
        for leader, opening in zip(leaders, written, strict=True):
            openings[leader] = opening
            for index in range(leader + 1, leader + group_size):
                try:
                    sessions[index].adopt_opening(opening)
                    openings[index] = opening
                except NotImplementedError:
                    own.append(index)
        if own:
            for index, opening in zip(
                own, self.simulator.opening_batch([sessions[i] for i in own]), strict=True
            ):
                openings[index] = opening
        return [opening for opening in openings if opening is not None]

    def system_prompt(self, profile: Profile) -> str:
        """The format's explicit prompt, else the simulator protocol's own, else the format's."""
        fmt = self.prompt_format
        if fmt.custom_prompt is None:
            protocol = self.simulator.policy_system_prompt(profile, thinking=fmt.thinking)
            if protocol is not None:
                return fmt.adapt_system_prompt(protocol, profile)
        return fmt.system_prompt(profile)

    def _open(self, session: UserSession, seed: int, opening: UserTurn) -> _Dialogue:
        profile = session.profile
        system_prompt = self.system_prompt(profile)
        trajectory = Trajectory(profile, seed, system_prompt, components=self.components)
        level = getattr(session, "difficulty", None)  # a Difficulty, a name, or absent
        trajectory.difficulty = getattr(level, "name", level)
        trajectory.user_turns.append(opening)
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": opening.text}]
        dialogue = _Dialogue(trajectory, session, messages)
        if opening.done:
            trajectory.termination = opening.termination or "simulator_ended"
        dialogue.prompt_text = self.context.render(messages)
        dialogue.prompt_ids = self.context.encode(dialogue.prompt_text)
        return dialogue

    def _fits_context(self, dialogue: _Dialogue) -> bool:
        if len(dialogue.prompt_ids) + self.settings.max_new_tokens <= self.settings.max_context_tokens:
            return True
        dialogue.trajectory.termination = "context_limit"
        return False

    def _advance(
        self, dialogue: _Dialogue, policy_turn: PolicyTurn, user_turn: UserTurn, *, last_turn: bool
    ) -> None:
        trajectory = dialogue.trajectory
        trajectory.policy_turns.append(policy_turn)
        trajectory.user_turns.append(user_turn)
        if user_turn.done:
            trajectory.termination = user_turn.termination or "simulator_ended"
        elif last_turn:
            trajectory.termination = "max_turns"
        if trajectory.termination:
            return
        parsed = policy_turn.parsed
        # The history keeps the completion verbatim only when nothing was hidden from it.
        verbatim = parsed.thinking is None and parsed.visible == policy_turn.completion.strip()
        content = policy_turn.completion if verbatim else parsed.visible
        dialogue.messages.append({"role": "assistant", "content": content})
        dialogue.messages.append({"role": "user", "content": user_turn.text})
        next_text = self.context.render(dialogue.messages)
        extended = None
        if verbatim:
            extended = self.context.extend(
                dialogue.prompt_ids, dialogue.prompt_text, policy_turn, next_text, content
            )
        dialogue.prompt_ids = extended if extended is not None else self.context.encode(next_text)
        dialogue.prompt_text = next_text


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
