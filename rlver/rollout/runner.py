"""Multi-turn rollouts: a batch of dialogues between the policy and simulated users.

The user speaks first. The engine samples a batch of dialogues' replies in one call; the
format splits each completion into thinking and visible reply; the simulator answers and
moves the emotions. Finished dialogues leave; the rest go on. Which dialogues share an engine
call is the schedule's choice (rlver.rollout.schedules: as soon as each user has answered, by
default, or in lockstep); each reply is sampled with a seed of its own dialogue and turn, so
the schedule never changes what a dialogue says.

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
from dataclasses import dataclass
from typing import Any

from rlver.core.emotion import Difficulty
from rlver.core.interfaces import (
    PromptFormat,
    RolloutEngine,
    SamplingSettings,
    StopRequested,
    UserSession,
    UserSimulator,
)
from rlver.core.seeding import run_seed
from rlver.core.trajectory import PolicyTurn, TokenSequence, Trajectory, pack_sequences, summarize
from rlver.core.types import Profile, UserTurn
from rlver.modeling.models import Policy
from rlver.rollout.dialogue import RunningDialogue
from rlver.rollout.schedules import SCHEDULES, group_openings, run_dialogue_level, run_lockstep, turn_seed

__all__ = [
    "PolicyTurn", "RolloutRunner", "RolloutSettings", "StopRequested", "TokenSequence", "Trajectory",
    "dialogue_seed", "pack_sequences", "summarize",
]  # fmt: skip


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
            None (the default): the run's seed (`--seed_everything`), resolved when the module
            is built (`rlver.core.seeding.run_seed`).
        end_at_sentence: A reply that reaches `max_new_tokens` mid-sentence is cut back to its
            last complete sentence (finish reason "sentence"): the user reads whole sentences, and
            the update trains on the kept tokens only (a prefix of a sample is a sample of that
            prefix, so their log-probs stay exact). A reply with no sentence end is kept whole
            (finish reason "length"). For non-thinking formats: a thinking turn cut inside its
            thinking is a format error either way.
        schedule: `dialogue`: each dialogue goes on as soon as its user has answered (users
            behind an endpoint are asked one dialogue at a time, concurrently); `lockstep`: every
            turn waits for all generations and then all answers (rlver.rollout.schedules).
    """

    max_turns: int = 8
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    max_context_tokens: int = 4096
    seed: int | None = None
    schedule: str = "dialogue"
    end_at_sentence: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule ({self.schedule!r}) must be one of {', '.join(SCHEDULES)}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns ({self.max_turns}) must be >= 1")
        if self.max_context_tokens <= self.max_new_tokens:
            raise ValueError(
                f"max_context_tokens ({self.max_context_tokens}) "
                f"must exceed max_new_tokens ({self.max_new_tokens})"
            )
        SamplingSettings(
            self.max_new_tokens, self.temperature, self.top_p, self.seed or 0
        )  # validates the rest


# What ends a sentence, and what may follow its mark before the sentence is over (quotes, brackets).
SENTENCE_MARKS = ".!?\u2026\u3002\uff01\uff1f"  # . ! ? ... and the full-width 。！？
CLOSERS = "\"')]\u201d\u2019\uff09\u300d\u300f"


def sentence_end(tokenizer: Any, token_ids: Sequence[int]) -> int | None:
    """How many of `token_ids` make up the reply's complete sentences (None: not one complete).

    A sentence is complete where its mark (and any closing quote or bracket) is followed by
    white space, a full-width mark, or the reply's end: "3.5" and "e.g." inside a word are not
    ends. The decoded text of each prefix is checked, so a mark merged into a token with what
    follows it (".\n") counts where that token ends.
    """
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    for count in range(len(token_ids), 0, -1):
        prefix = tokenizer.decode(list(token_ids[:count]), skip_special_tokens=True)
        body = prefix.rstrip()
        while body and body[-1] in CLOSERS:
            body = body[:-1]
        if not body or body[-1] not in SENTENCE_MARKS:
            continue
        rest = text[len(prefix) :] if text.startswith(prefix) else ""
        if not rest or rest[0].isspace() or prefix != prefix.rstrip() or body[-1] > "\u2fff":
            return count
    return None


def dialogue_seed(base_seed: int, profile_id: str, index: int) -> int:
    """A stable per-dialogue seed (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{base_seed}:{profile_id}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


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

        Every rank calls it at the same point of a step, so the engine's collectives (a deferred
        weight reload) run here first, before any dialogue can end or stop on this rank alone.
        """
        if group_size < 1 or len(profiles) % group_size:
            raise ValueError(f"{len(profiles)} profiles do not split into groups of {group_size}")
        self.engine.prepare_for_rollout()
        base_seed = run_seed(self.settings.seed) if seed is None else seed
        self.timings = {"generate": 0.0, "simulator": 0.0}
        seeds = [dialogue_seed(base_seed, profile.id, i) for i, profile in enumerate(profiles)]
        leaders = range(0, len(profiles), group_size)
        for leader in leaders:
            members = profiles[leader : leader + group_size]
            if any(member.id != members[0].id for member in members):
                raise ValueError(f"group at {leader} mixes profiles {sorted({m.id for m in members})}")
        dialogues = [
            self._new_dialogue(index, base_seed, profile, seeds[index], seeds[index - index % group_size])
            for index, profile in enumerate(profiles)
        ]
        if self.settings.schedule == "dialogue" and self.simulator.waits_on_io:
            run_dialogue_level(
                self, dialogues, group_openings(self, group_size, dialogues), on_turn, should_stop
            )
            return [d.trajectory for d in dialogues]
        started = time.perf_counter()
        openings = self.openings([d.session for d in dialogues], group_size)
        self.timings["simulator"] += time.perf_counter() - started
        ready = self.start(dialogues, openings)
        if self.settings.schedule == "dialogue":
            run_dialogue_level(self, dialogues, lambda answers: ready, on_turn, should_stop)
        else:
            run_lockstep(self, dialogues, on_turn, should_stop)
        return [d.trajectory for d in dialogues]

    # ------------------------------------------------------------------ what the schedules call
    def start(
        self, dialogues: Sequence[RunningDialogue], openings: Sequence[UserTurn]
    ) -> list[RunningDialogue]:
        """Begin `dialogues` with their users' opening lines; the ones still going."""
        for dialogue, opening in zip(dialogues, openings, strict=True):
            self._begin(dialogue, opening)
        return [d for d in dialogues if not d.trajectory.termination]

    def check_stop(self, should_stop: Callable[[], bool] | None, turn: int) -> None:
        if should_stop is not None and should_stop():
            raise StopRequested(f"stopped before turn {turn}")

    def sample(self, batch: Sequence[RunningDialogue]) -> list[PolicyTurn]:
        """One engine call for `batch`: each reply drawn with its own dialogue's and turn's seed."""
        sampling = SamplingSettings(
            self.settings.max_new_tokens,
            self.settings.temperature,
            self.settings.top_p,
            seed=run_seed(self.settings.seed),
            prompt_seeds=tuple(turn_seed(d.call_seed, d.trajectory.num_turns, d.index) for d in batch),
        )
        started = time.perf_counter()
        generations = self.engine.generate([d.prompt_ids for d in batch], sampling)
        self.timings["generate"] += time.perf_counter() - started
        policy_turns = []
        for dialogue, generation in zip(batch, generations, strict=True):
            ids, logprobs, finish = (
                list(generation.token_ids),
                list(generation.logprobs),
                generation.finish_reason,
            )
            if finish == "length" and self.settings.end_at_sentence:
                cut = sentence_end(self.policy.tokenizer, ids)
                if cut is not None and cut < len(ids):
                    ids, logprobs, finish = ids[:cut], logprobs[:cut], "sentence"
            completion = self.policy.tokenizer.decode(ids, skip_special_tokens=True)
            policy_turns.append(
                PolicyTurn(
                    prompt_ids=list(dialogue.prompt_ids),
                    response_ids=ids,
                    logprobs=logprobs,
                    finish_reason=finish,
                    completion=completion,
                    parsed=self.prompt_format.parse(completion),
                )
            )
        return policy_turns

    def openings(self, sessions: Sequence[UserSession], group_size: int) -> list[UserTurn]:
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

    def _new_dialogue(
        self, index: int, call_seed: int, profile: Profile, seed: int, user_seed: int
    ) -> RunningDialogue:
        """A dialogue before its opening: the session (a group shares `user_seed`) and prompt."""
        session = self.simulator.open(profile, seed=user_seed)
        trajectory = Trajectory(profile, seed, self.system_prompt(profile), components=self.components)
        level = session.difficulty
        trajectory.difficulty = level.name if isinstance(level, Difficulty) else level
        return RunningDialogue(index, call_seed, trajectory, session)

    def _begin(self, dialogue: RunningDialogue, opening: UserTurn) -> None:
        trajectory = dialogue.trajectory
        trajectory.user_turns.append(opening)
        dialogue.messages = [
            {"role": "system", "content": trajectory.system_prompt},
            {"role": "user", "content": opening.text},
        ]
        if opening.done:
            trajectory.termination = opening.termination or "simulator_ended"
        dialogue.prompt_text = self.context.render(dialogue.messages)
        dialogue.prompt_ids = self.context.encode(dialogue.prompt_text)

    def fits_context(self, dialogue: RunningDialogue) -> bool:
        if len(dialogue.prompt_ids) + self.settings.max_new_tokens <= self.settings.max_context_tokens:
            return True
        dialogue.trajectory.termination = "context_limit"
        return False

    def advance(self, dialogue: RunningDialogue, policy_turn: PolicyTurn, user_turn: UserTurn) -> None:
        """Record a reply and the user's answer; end the dialogue or build its next prompt."""
        trajectory = dialogue.trajectory
        trajectory.policy_turns.append(policy_turn)
        trajectory.user_turns.append(user_turn)
        if user_turn.done:
            trajectory.termination = user_turn.termination or "simulator_ended"
        elif trajectory.num_turns >= self.settings.max_turns:
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
