"""The contracts plugins implement. Plugins register factories for these.

A factory is any callable (usually the class itself) whose keyword arguments
are the options a config may set; `rlver.core.plugins.build` checks them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from rlver.core.emotion import Difficulty
from rlver.core.trajectory import ParsedReply, Trajectory
from rlver.core.types import Profile, UserTurn

if TYPE_CHECKING:  # the contract names tensors without importing torch for plugins that need none
    from torch import Tensor

__all__ = [
    "AdvantageBatch", "AdvantageEstimator", "AdvantageResult", "DialogueJudge", "Generation", "ParsedReply",
    "PromptFormat",
    "RewardFunction", "RolloutEngine", "SamplingSettings", "SimulatorUnavailable", "StopRequested",
    "Trajectory", "UserSession", "UserSimulator",
]  # fmt: skip


# --------------------------------------------------------------------------- simulators
class Component(ABC):  # noqa: B024 - a base for the interfaces, which declare the abstract methods
    """What every interface a plugin registers shares.

    `renamed_options`: old names of constructor options the class still takes (it maps them to
    the new ones itself, with a warning), so a config written with them passes the registry's
    option check; the keys are what counts. Empty by default.
    """

    renamed_options: ClassVar[Mapping[str, object]] = {}


class SimulatorUnavailable(RuntimeError):
    """The simulator cannot go on at all (endpoint down, key or model rejected).

    Unlike a failure of one dialogue (termination "simulator_error", left out of the loss),
    this ends the run: the trainer stops every rank together with `last.ckpt` at the last
    finished step, and `rlver fit` exits with this message.
    """


class StopRequested(Exception):
    """A stop was asked for (SIGTERM, Ctrl-C): the rest of this rollout or step is dropped.

    Raised by the rollout and the update, caught by the stop handling and the module: it lives
    here, below all of them, so that none has to import another's layer to name it.
    """


class UserSession(ABC):
    """One simulated user in one dialogue. Owns all of that dialogue's user state.

    `difficulty`: the level this user plays (a `Difficulty`, or its name), which the transcript
    records; None where the simulator has no levels.
    """

    profile: Profile
    difficulty: Difficulty | str | None = None

    @abstractmethod
    def opening(self) -> UserTurn:
        """The user's first message (the profile's `first_talk` when it has one)."""

    @abstractmethod
    def respond(self, reply: str) -> UserTurn:
        """React to the policy's visible reply: move the emotion and answer."""

    @property
    @abstractmethod
    def emotion(self) -> float:
        """The current emotion score, 0-100."""

    def adopt_opening(self, turn: UserTurn) -> None:
        """Start from `turn`, the opening another session of the same group wrote.

        GRPO compares the members of a group, so they must face the same user saying the
        same first line; the rollout asks the group's first session for its opening and
        hands it to the others. Sessions that cannot adopt one raise NotImplementedError
        and are asked for their own (with the group's shared seed).
        """
        raise NotImplementedError

    def follow(self, text: str, emotion: float | None = None) -> None:
        """Replace the user's latest message (the opening, or the answer to the last reply)
        with `text`, and the emotion with `emotion` when one is given.

        For replaying a recorded dialogue turn by turn (teacher forcing, as
        tools/simulator_agreement.py does): the session goes on from what the user
        actually said there (and, with `emotion`, from how they felt). Before `opening()`,
        `text` becomes the opening. Sessions that cannot raise NotImplementedError.
        """
        raise NotImplementedError


class UserSimulator(Component):
    """Creates user sessions and answers a whole batch of them per turn.

    The rollout loop only calls `open`, `opening_batch` and `respond_batch`; simulators backed
    by a remote LLM override them to run the sessions concurrently.

    `waits_on_io`: True when a call mostly waits on something outside this process (an LLM
    endpoint) and calls for different sessions may run at once from different threads. The
    dialogue-level rollout then asks for each dialogue's answer on its own, as soon as its
    reply is sampled, and the dialogue goes on when its user has answered. False (in-process
    users): the replies sampled together are answered together, in one batched call.
    """

    waits_on_io: bool = False

    @abstractmethod
    def open(self, profile: Profile, *, seed: int) -> UserSession:
        """Start a dialogue with `profile`; `seed` makes the session reproducible."""

    def opening_batch(self, sessions: Sequence[UserSession]) -> list[UserTurn]:
        """The opening lines of new sessions (LLM-played users write them concurrently)."""
        return [session.opening() for session in sessions]

    def respond_batch(self, sessions: Sequence[UserSession], replies: Sequence[str]) -> list[UserTurn]:
        return [session.respond(reply) for session, reply in zip(sessions, replies, strict=True)]

    def policy_system_prompt(self, profile: Profile, *, thinking: bool) -> str | None:
        """The system prompt the protocol this user belongs to gives the policy, if it has one.

        A benchmark's or reference's own simulator code comes with its own prompt for the
        model under test; the prompt format then uses it (adding its thinking instructions
        where the prompt has none), unless the format sets `system_prompt` explicitly.
        None: the format's own prompt.
        """
        return None

    def drain_metrics(self) -> dict[str, float]:
        """Counters since the last call (requests, retries, ...), logged under `simulator/`."""
        return {}

    def worst_case_seconds(self) -> float | None:
        """How long a dead endpoint can keep a rank waiting before this simulator gives up on it
        (raises SimulatorUnavailable); None: no endpoint, or it never gives up. Multi-process
        training keeps its collectives' timeout above it, so a dead endpoint ends in the clean
        stop with `last.ckpt`, not in a collective timing out."""
        return None

    def worst_request_seconds(self) -> float | None:
        """The longest one of its requests can take, every retry included: the longest a healthy
        rollout goes without finishing a turn. HangWatchdog's default timeout covers it. None: no
        endpoint (or no bound)."""
        return None

    def close(self) -> None:
        """Release connections and threads; the simulator is not used afterwards."""


# --------------------------------------------------------------------------- prompt formats
class PromptFormat(Component):
    """How the policy is asked to answer and how its raw text is parsed."""

    thinking: bool = False  # whether the policy reasons before its reply (`<think>`)
    custom_prompt: str | None = None  # a system prompt the config set explicitly

    @abstractmethod
    def system_prompt(self, profile: Profile) -> str:
        """The system message for a dialogue with `profile`."""

    def adapt_system_prompt(self, prompt: str, profile: Profile) -> str:
        """`prompt` (a simulator protocol's own) made fit for this format; unchanged by default."""
        return prompt

    @abstractmethod
    def parse(self, completion: str) -> ParsedReply:
        """Split a completion into visible reply and thinking."""


# --------------------------------------------------------------------------- rollout engines
@dataclass(frozen=True)
class SamplingSettings:
    """Per-call sampling controls, identical across engines.

    temperature 0 means greedy decoding. Log-probabilities are always those of
    the sampled token under softmax(logits / temperature) (raw logits when
    greedy), without top-p renormalisation, i.e. what the trainer recomputes.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    # One seed per prompt: a prompt's sample then depends on its own seed and the weights only,
    # never on which other prompts share the call (the rollout passes them, so scheduling cannot
    # change a dialogue). None: the engine derives them from `seed` and the prompt's index.
    prompt_seeds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens ({self.max_new_tokens}) must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature ({self.temperature}) must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p ({self.top_p}) must be within (0, 1]")


@dataclass(frozen=True)
class Generation:
    """What an engine sampled for one prompt: exact ids and their log-probs.

    finish_reason: "stop" (an end-of-turn token was sampled, and is the last
    id) or "length" (the per-turn token limit was hit).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str


class RolloutEngine(Component):
    """Generates completions for a batch of token-id prompts.

    `samples_from_training_module`: True when the engine generates with the very module being
    trained (no copy of its own): the overlapped mode then gives it a snapshot to sample from.
    """

    samples_from_training_module: bool = False
    # True when a fresh engine already holds the policy's weights (it read the policy's own
    # files): training then skips the first sync, which would only hold memory.
    starts_with_policy_weights: bool = False
    # An engine that plays fixed strategies instead of sampling the policy names them here, each
    # chosen with its `strategy` option; `rlver probe` runs every one (the `scripted` engine's).
    scripted_strategies: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[Generation]:
        """One completion per prompt; deterministic for the same inputs and seed. Given
        `sampling.prompt_seeds`, prompt i samples with seed prompt_seeds[i] alone."""

    def sync_weights(self) -> None:
        """Make the engine sample from the policy's current weights.

        Engines that share the training module (hf) have nothing to do. It may defer the
        work (an engine asleep keeps it for `prepare_for_rollout`), but never into `generate`.
        """

    def prepare_for_rollout(self) -> None:
        """Get ready to generate; every rank calls it at the start of every rollout (training,
        validation, test), before any dialogue begins, whatever its dialogues will do.

        The place for work that is a collective across ranks, such as a deferred weight reload
        that gathers FSDP shards: a rank whose dialogues end before the policy speaks, or that
        stops at the first turn, never calls `generate`, and a collective there would hang its peers.
        """

    def release_memory(self) -> None:
        """Give the device memory the engine holds back to training until the next rollout
        (called after every rollout, the ones a stop cuts short included); local to the rank."""


# --------------------------------------------------------------------------- rewards and advantages
class RewardFunction(Component):
    """Scores finished dialogues: one entry per trajectory.

    An entry is either one float, the dialogue's reward (it sits on the last token the policy
    sampled), or a sequence of one float per policy turn (`trajectory.num_turns` of them), each
    on that turn's last sampled token. A per-turn reward that should also pay at the end adds
    it to its last turn's value: token rewards are summed either way.
    """

    # True for a reward made of per-turn differences of a potential, phi(E_t) - phi(E_t-1): it sums
    # to the final potential only undiscounted, so rlver refuses it beside an estimator with gamma < 1.
    potential_based: bool = False

    @abstractmethod
    def __call__(self, trajectories: Sequence[Trajectory]) -> Sequence[float | Sequence[float]]: ...


@dataclass
class AdvantageBatch:
    """What an advantage estimator sees, on per-dialogue timelines (see rlver.modeling.batch).

    token_rewards: (D, T) rewards per policy token: each turn's reward on that turn's last
        token (a dialogue-level reward on the last turn's), minus the KL penalty on every token
        when KL is in the reward.
    values: (D, T) critic values, or None when no critic is trained.
    mask: (D, T) 1 on real timeline positions.
    group_ids: (D,) dialogues sharing a profile and opening share an id.
    valid: (D,) bool, False for dialogues that must not shape the estimate (ended by a
        simulator error, or a placeholder on a rank with nothing to train); None: all valid.
        Their advantages are ignored by the loss, and they must stay out of any statistic.
    reduce_sum: sums a tensor over every rank of the step (identity in one process). A
        statistic over "the batch" (e.g. whitening) must be computed with it, so that it is
        the statistic of the whole step and every rank agrees; all ranks call it equally often.
    turn_ids: (D, T) the policy turn (0-based) of each timeline position; None: one turn.
    """

    token_rewards: Tensor
    values: Tensor | None
    mask: Tensor
    group_ids: Tensor
    valid: Tensor | None = None
    reduce_sum: Callable[[Tensor], Tensor] | None = None
    turn_ids: Tensor | None = None

    def valid_mask(self) -> Tensor:
        """(D, T) mask of the positions that count: `mask` on valid dialogues only."""
        if self.valid is None:
            return self.mask
        return self.mask * self.valid[:, None].to(self.mask.dtype)

    def global_sum(self, tensor: Tensor) -> Tensor:
        return tensor if self.reduce_sum is None else self.reduce_sum(tensor)


@dataclass
class AdvantageResult:
    """advantages: (D, T); returns: (D, T) value targets, or None without a critic."""

    advantages: Tensor
    returns: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class AdvantageEstimator(Component):
    """Turns rewards (and values, for critics) into per-token advantages.

    `requires_critic` tells the trainer whether to build and train a value model;
    `requires_groups` that its baseline compares the dialogues of a group (`group_size` >= 2);
    `gamma` is the discount it applies between timeline positions (1: none): an estimator that
    discounts must say so here, since a potential-based reward is exact only undiscounted.
    """

    requires_critic: bool = False
    requires_groups: bool = False
    gamma: float = 1.0

    @abstractmethod
    def __call__(self, batch: AdvantageBatch) -> AdvantageResult: ...


# --------------------------------------------------------------------------- judges
class DialogueJudge(Component):
    """Scores finished dialogues on named dimensions, each 0-10 (higher is better).

    Unlike the simulated user's emotion, which is the reward, a judge only describes: how much
    empathy, insight or practical help the policy's replies showed. A dimension the judge could
    not score for a dialogue (a malformed answer after its retries, a timeout) is None, never a
    guess, so a mean over the scored dialogues stays honest about how many there were.
    """

    dimensions: tuple[str, ...]

    @abstractmethod
    def judge(self, dialogues: Sequence[Sequence[dict[str, str]]]) -> list[dict[str, float | None]]:
        """One dict per dialogue (messages with `role` user/assistant and `content`), every
        dimension a key: its score, or None where the judge gave no usable one."""

    def drain_metrics(self) -> dict[str, float]:
        """Counters since the last call (requests, re-asks, missing scores, ...)."""
        return {}

    def close(self) -> None:
        """Release connections."""
