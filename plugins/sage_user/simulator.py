"""The LLM-played user ("sage"): SAGE's two calls per turn against an OpenAI-compatible endpoint.

Per turn and dialogue: a planning call judges the policy's reply as the persona
and yields a signed change; the shared mechanics (`rlver.core.emotion`) scale, clamp
and cap it and decide success or failure; a reply call answers in character
from the band label and the planning's fit, inner reaction and feeling (never
its content summary or number, as in SAGE). All active dialogues' calls run
concurrently on the client's event loop.

A dialogue never hangs and never gets a made-up emotion: an answer that does
not parse is re-asked up to `max_reasks` times, a request that keeps failing
is retried up to `max_retries` times, and after that the dialogue ends with
termination "simulator_error" at its last real emotion (the trainer leaves it
out of the loss and counts it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rlver.core.emotion import (
    Difficulty,
    apply_change,
    band,
    profile_difficulty,
    resolve_difficulty,
    termination,
)
from rlver.core.interfaces import UserSession, UserSimulator
from rlver.core.seeding import stable_hash
from rlver.core.types import Profile, UserTurn

from .client import ChatClient, EndpointError, LoopThread, open_client
from .endpoint import CACHE_PATH, accepts_renamed_options, endpoint_settings
from .parsing import ParseFailure, Planning, UserReply, parse_planning, parse_reply
from .prompts import (
    PROMPT_SETS,
    PromptSet,
    opening_messages,
    opening_schema,
    planning_messages,
    planning_schema,
    reply_messages,
    reply_schema,
    with_json_hint,
)

LANGUAGES = ("auto", "en", "zh")
RESPONSE_FORMATS = ("text", "json_schema")
SIMULATOR_ERROR = "simulator_error"
GOODBYE = "goodbye"
_GOODBYE = re.compile(r"\b(good\s?bye|bye)\b|再见|拜拜", re.IGNORECASE)


def says_goodbye(text: str) -> bool:
    """Whether the user's message takes leave (English or Chinese)."""
    return _GOODBYE.search(text) is not None


class _TurnFailed(Exception):
    """The call for this turn gave up; the message says why (for the transcript)."""


@accepts_renamed_options(CACHE_PATH)
class SageUserSimulator(UserSimulator):
    """SAGE's LLM-played user over any OpenAI-compatible chat endpoint."""

    waits_on_io = True  # each answer is an HTTP call; dialogues go on as their users answer

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str | None = None,
        difficulty: str | dict[str, Any] = "normal",
        language: str = "auto",
        temperature: float = 0.7,
        top_p: float = 1.0,
        max_tokens: int = 512,
        seed: int = 0,
        timeout: float = 60.0,
        max_retries: int = 4,
        backoff_seconds: float = 1.0,
        backoff_max_seconds: float = 30.0,
        max_failures_in_a_row: int = 8,
        max_reasks: int = 2,
        max_concurrency: int = 32,
        requests_per_second: float | None = None,
        cache: str | None = None,
        cache_only: bool = False,
        response_format: str = "text",
        field_max_chars: int = 400,
        strict_parsing: bool = False,
        scale_changes: bool = False,
    ) -> None:
        """Configure the LLM-played user.

        Args:
            base_url: The endpoint's OpenAI-compatible root, e.g. http://127.0.0.1:8000/v1.
            model: The served model name to ask.
            api_key_env: Name of the environment variable holding the API key (never the key
                itself); None for endpoints without authentication.
            difficulty: "easy", "normal" or "hard", or a dict overriding a preset: start emotion,
                clamp, end conditions and the persona's judging wording. A profile's own
                `difficulty` field wins.
            language: Prompt set: "en", "zh", or "auto" (each profile's own language).
            temperature: Sampling temperature of the user model.
            top_p: Nucleus sampling mass of the user model.
            max_tokens: Token limit of one simulator answer.
            seed: Base seed; each request's seed mixes it with the dialogue, turn and attempt.
            timeout: Seconds before a request counts as timed out (then retried).
            max_retries: Retries of a request after a timeout, connection error, 429 or 5xx.
            backoff_seconds: Base of the exponential backoff (with full jitter) between retries.
            backoff_max_seconds: Longest wait between two retries.
            max_failures_in_a_row: Requests failing all their retries one after another that
                mean the endpoint is down: the run stops (last.ckpt at the last finished step)
                with one error instead of failing every dialogue (0: never).
            max_reasks: How often an answer that does not parse is asked for again.
            max_concurrency: Requests in flight at most.
            requests_per_second: Optional rate limit across all dialogues.
            cache: Optional SQLite file caching answers by request, for replays (formerly
                `cache_path`, still read).
            cache_only: Answer only from the cache (a miss ends that dialogue with a
                simulator error); needs cache.
            response_format: "text" (SAGE's `Field:` lines) or "json_schema": the endpoint's
                structured outputs force a JSON object with the same fields (OpenAI, vLLM and
                SGLang servers support it), so even a small user model answers readably.
            field_max_chars: With json_schema, the longest each text field may be.
            strict_parsing: Re-ask any change not written exactly as `Change: <signed integer>`
                (the reference parser's expectation). By default readable variants (full-width
                colons and digits, brackets, Markdown bold, the value on the next line) are read
                as they are, saving a call; a missing field or words instead of a number are
                re-asked either way.
            scale_changes: Also multiply the model's change by the level's gain / loss scales
                (as the embedded user does). Off by default: as in SAGE and the reference, the
                LLM's change is taken as given and a level acts through its start, clamp, end
                conditions and the persona's wording.
        """
        # The options, for pickling: a copy in another process rebuilds its own client and
        # loop and reads the key from its own environment (the key is never pickled).
        self._options = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        # The endpoint's options are checked with the user's own, in one error.
        settings = endpoint_settings(self._options)
        problems = []
        if language not in LANGUAGES:
            problems.append(f"language ({language!r}) must be one of {', '.join(LANGUAGES)}")
        if field_max_chars < 1:
            problems.append(f"field_max_chars ({field_max_chars}) must be >= 1")
        try:
            self.difficulty: Difficulty = resolve_difficulty(difficulty)
        except (ValueError, TypeError) as error:
            problems.append(f"difficulty: {error}")
        settings.check("sage simulator", RESPONSE_FORMATS, problems)
        self.language = language
        self.json_fields = response_format == "json_schema"
        self.parse_planning = functools.partial(parse_planning, strict=strict_parsing)
        self.scale_changes = scale_changes
        self.field_max_chars = field_max_chars
        self.seed = seed
        self.max_reasks = max_reasks
        self.counters: Counter[str] = Counter()
        self._loop = LoopThread("rlver-sage-user")
        self.client = open_client(self._loop, settings)
        self._finalizer = weakref.finalize(self, _shutdown, self.client, self._loop)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self._options,))

    def worst_case_seconds(self) -> float | None:
        return self.client.settings.seconds_until_given_up()

    def worst_request_seconds(self) -> float | None:
        return self.client.settings.worst_request_seconds()

    def __repr__(self) -> str:  # never shows the key: it lives only in the HTTP client's headers
        settings = self.client.settings
        return f"SageUserSimulator(base_url={settings.base_url!r}, model={settings.model!r})"

    # ------------------------------------------------------------------ UserSimulator
    def open(self, profile: Profile, *, seed: int) -> SageUserSession:
        language = self.language if self.language != "auto" else profile.language
        prompts = PROMPT_SETS.get(language, PROMPT_SETS["en"])
        difficulty = profile_difficulty(profile, self.difficulty)
        return SageUserSession(
            self, profile, difficulty, prompts, stable_hash(self.seed, seed, profile.id) >> 33
        )  # 31 bits: every server takes it

    def opening_batch(self, sessions: Sequence[UserSession]) -> list[UserTurn]:
        return self._loop.run(_gather([self._session(s).opening_async() for s in sessions]))

    def respond_batch(self, sessions: Sequence[UserSession], replies: Sequence[str]) -> list[UserTurn]:
        coroutines = [self._session(s).respond_async(r) for s, r in zip(sessions, replies, strict=True)]
        return self._loop.run(_gather(coroutines))

    def drain_metrics(self) -> dict[str, float]:
        totals = self.counters + self.client.counters
        self.counters.clear()
        self.client.counters.clear()
        return {name: float(value) for name, value in sorted(totals.items())}

    def close(self) -> None:
        self._finalizer()

    def _session(self, session: UserSession) -> SageUserSession:
        if not isinstance(session, SageUserSession) or session.simulator is not self:
            raise TypeError("the sage simulator can only drive sessions it opened")
        return session

    # ------------------------------------------------------------------ one structured call
    async def ask(
        self,
        messages: list[dict[str, str]],
        parse: Any,
        seed: int,
        stats: Counter[str],
        prompts: PromptSet,
        response_format: dict[str, Any],
    ) -> Any:
        """Call the endpoint and parse the answer, re-asking on parse failures (bounded).

        `response_format` (a JSON schema) is sent only when the simulator uses json_schema.
        """
        if self.json_fields:
            messages = with_json_hint(messages, response_format, prompts)
        conversation = list(messages)
        for attempt in range(self.max_reasks + 1):
            try:
                answer = await self.client.complete(
                    conversation,
                    seed=seed + attempt,
                    stats=stats,
                    response_format=response_format if self.json_fields else None,
                )
            except EndpointError as error:
                raise _TurnFailed(str(error)) from None
            try:
                return parse(answer)
            except ParseFailure as failure:
                problem = str(failure)
                if attempt == self.max_reasks:
                    self.counters["unparsed_answers"] += 1
                    raise _TurnFailed(
                        f"unreadable answer after {self.max_reasks + 1} tries: {problem}; "
                        f"last answer: {answer[:200]!r}"
                    ) from None
                self.counters["reasks"] += 1
                stats["reasks"] += 1
                conversation = [
                    *messages,
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": prompts.reask.format(problem=problem)},
                ]
        raise AssertionError("unreachable")


class SageUserSession(UserSession):
    """One dialogue with the LLM-played user; holds its emotion and history."""

    def __init__(
        self,
        simulator: SageUserSimulator,
        profile: Profile,
        difficulty: Difficulty,
        prompts: PromptSet,
        seed: int,
    ) -> None:
        self.simulator = simulator
        self.profile = profile
        self.difficulty = difficulty
        self.prompts = prompts
        self.seed = seed
        self.history: list[tuple[str, str]] = []  # ("user" | "partner", text)
        self._emotion = difficulty.start
        self._opening: UserTurn | None = None
        self._ended: str | None = None
        self._turn = 0

    @property
    def emotion(self) -> float:
        return self._emotion

    def opening(self) -> UserTurn:
        return self.simulator.opening_batch([self])[0]

    def respond(self, reply: str) -> UserTurn:
        return self.simulator.respond_batch([self], [reply])[0]

    async def opening_async(self) -> UserTurn:
        if self._opening is not None:
            return self._opening
        stats: Counter[str] = Counter()
        if self.profile.first_talk:
            text, reason = self.profile.first_talk, {"source": "first_talk"}
        else:
            messages = opening_messages(self.profile, self.difficulty, self.prompts)
            try:
                reply: UserReply = await self.simulator.ask(
                    messages,
                    parse_reply,
                    self._seed("open"),
                    stats,
                    self.prompts,
                    opening_schema(self.simulator.field_max_chars),
                )
            except _TurnFailed as failure:
                return self._fail(str(failure), stats, opening=True)
            text, reason = reply.response, {"source": "generated", "thinking": reply.thinking}
        self.history.append(("user", text))
        self._opening = UserTurn(text=text, emotion=self._emotion, reason={**reason, **stats})
        return self._opening

    def adopt_opening(self, turn: UserTurn) -> None:
        if self._opening is not None:
            raise RuntimeError(f"profile {self.profile.id}: this session already has its opening")
        self._opening = turn
        if turn.termination == SIMULATOR_ERROR:
            self._ended = SIMULATOR_ERROR
        else:
            self.history.append(("user", turn.text))

    def follow(self, text: str, emotion: float | None = None) -> None:
        if emotion is not None:  # the recorded user felt this and went on talking
            self._emotion = float(emotion)
            self._ended = None
        if self._opening is None:
            self.adopt_opening(UserTurn(text=text, emotion=self._emotion, reason={"source": "recorded"}))
            return
        if not self.history or self.history[-1][0] != "user":
            raise RuntimeError(f"profile {self.profile.id}: no user message to replace")
        self.history[-1] = ("user", text)

    async def respond_async(self, reply: str) -> UserTurn:
        if self._ended:
            raise RuntimeError(f"profile {self.profile.id}: the dialogue already ended ({self._ended})")
        if self._opening is None:
            await self.opening_async()
        self._turn += 1
        stats: Counter[str] = Counter()
        self.history.append(("partner", reply))
        try:
            planning: Planning = await self.simulator.ask(
                planning_messages(self.profile, self.difficulty, self.prompts, self._emotion, self.history),
                self.simulator.parse_planning,
                self._seed("plan"),
                stats,
                self.prompts,
                planning_schema(self.difficulty, self.simulator.field_max_chars),
            )
            mechanics = self.difficulty
            if not self.simulator.scale_changes:
                mechanics = dataclasses.replace(mechanics, positive_scale=1.0, negative_scale=1.0)
            emotion, applied = apply_change(self._emotion, planning.change, mechanics)
            emotion, applied = round(emotion, 2), round(applied, 2)
            ending = termination(emotion, self.difficulty)
            answer: UserReply = await self.simulator.ask(
                reply_messages(
                    self.profile,
                    self.difficulty,
                    self.prompts,
                    band(emotion),
                    planning.feedback(self.prompts.feedback),
                    self.history,
                    ending,
                ),
                parse_reply,
                self._seed("reply"),
                stats,
                self.prompts,
                reply_schema(self.simulator.field_max_chars),
            )
        except _TurnFailed as failure:
            return self._fail(str(failure), stats)
        self._emotion = emotion
        self.history.append(("user", answer.response))
        if ending is None and says_goodbye(answer.response):
            ending = GOODBYE
        self._ended = ending
        return UserTurn(
            text=answer.response,
            emotion=emotion,
            change=applied,
            reason={"planning": planning.record(applied), "thinking": answer.thinking, **stats},
            termination=ending,
        )

    def _seed(self, call: str) -> int:
        # Re-asks add their attempt number; 1000 apart keeps the seeds of different calls apart.
        offset = {"open": 0, "plan": 1, "reply": 2}[call]
        return (self.seed + 1000 * (3 * self._turn + offset)) % (2**31)

    def _fail(self, why: str, stats: Counter[str], *, opening: bool = False) -> UserTurn:
        self.simulator.counters["dialogue_errors"] += 1
        self._ended = SIMULATOR_ERROR
        turn = UserTurn(
            text="",
            emotion=self._emotion,
            reason={"error": why, **stats},
            termination=SIMULATOR_ERROR,
        )
        if opening:
            self._opening = turn
        return turn


async def _gather(coroutines: list[Any]) -> list[UserTurn]:
    return list(await asyncio.gather(*coroutines))


def _shutdown(client: ChatClient, loop: LoopThread) -> None:
    try:
        client.close()
    finally:
        loop.stop()


def _rebuild(options: dict[str, Any]) -> SageUserSimulator:
    return SageUserSimulator(**options)
