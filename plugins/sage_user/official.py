"""SAGE's and the RLVER reference's own simulator code, driven by rlver.

Two simulators that run the published code itself rather than rlver's rewording of it,
so their numbers can stand next to the Sentient leaderboard and the RLVER paper:

- `sage_official`: SAGE's `simulator_response.py` (`chat_player`: planning, then reply)
  and, for the model under test, the system prompt of SAGE's `npc_response.py`.
- `rlver_reference`: the RLVER reference's training user, `hard_player_simulator_dsv3.py`
  (`PlayerSimulator.reply`), and the policy system prompts of its `system_prompt.py`.

rlver ships none of their text: `code` points at the user's checkout (the folder that
holds the files, or any folder above it). What rlver supplies, and nothing else:

- their `call_llm` / `call_api`: one chat request with their prompt as the user message,
  through rlver's client (concurrent dialogues, bounded transport retries, rate limit,
  cache). Where their code would retry forever (an answer it cannot parse, a failing
  endpoint), rlver stops after `max_reasks` calls of one step beyond the first and ends the dialogue
  with termination "simulator_error"; their `time.sleep(3)` between attempts is skipped
  (the client already backs off) and their `print(e)` is counted instead of printed;
- the player state, built from rlver's profiles exactly as their loaders build it from
  their own files;
- the dialogue loop around their functions: the user opens (the profile's `first_talk`
  when it has one), each policy reply is appended as an `assistant` message and their
  function is called; SAGE's dialogue ends at their Emotion-S (success) or Emotion-F
  (failure) state, the reference's at emotion <= 0 or >= 100; either ends at a goodbye.

The RLVER reference file cannot be imported as published: its `call_api` is a stub with a
misplaced docstring (a syntax error) and it imports its system prompts from inside verl.
rlver replaces exactly those two things when loading it (the stub, as the file asks its
user to; the import, with the sibling `system_prompt.py`); nothing else is changed.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import re
import threading
import types
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlver.core.emotion import DIFFICULTIES, termination
from rlver.core.interfaces import SimulatorUnavailable, UserSession, UserSimulator
from rlver.core.seeding import stable_hash
from rlver.core.types import Profile, UserTurn

from .client import ChatClient, EndpointError, LoopThread, open_client
from .endpoint import OFFICIAL_RENAMES, accepts_renamed_options, endpoint_settings

SIMULATOR_ERROR = "simulator_error"
_GOODBYE = re.compile(r"\b(good\s?bye|bye)\b|再见|拜拜", re.IGNORECASE)

# What an answer must look like for their parsers, as regular expressions for servers with
# structured outputs (`response_format: regex`): a small user model then always answers readably.
_FIELD = r"[^\n]{1,%d}"
ANSWER_PATTERNS = {
    "sage_planning": ("Content", "TargetCompletion", "Activity", "Analyse"),
    "reference_planning": ("Content", "Reason", "Activity", "Analyse"),
    "reply": ("Thinking", "Origin", "Change"),
}


def answer_regex(kind: str, field_chars: int) -> str:
    """A regex of the text format their parser reads for `kind` ("...planning" or "reply")."""
    field = _FIELD % field_chars
    body = "".join(rf"{name}:\n{field}\n" for name in ANSWER_PATTERNS[kind])
    if kind == "reply":
        return body + rf"Response:\n{field}"
    return body + r"Change:\n[+-]?[0-9]{1,2}"


class SimulatorCodeError(ValueError):
    """The `code` option does not lead to loadable simulator files."""


class _GaveUp(BaseException):
    """Ends one step of their code from inside their `call_llm`.

    A BaseException, not an Exception: their retry loops catch every Exception and try again
    forever; this one passes through them.
    """

    def __init__(self, reason: str, fatal: BaseException | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fatal = fatal


# --------------------------------------------------------------------------- loading their files
def find_file(code: str | Path, name: str) -> Path:
    """`name` in the folder `code`, or the one file of that name below it."""
    root = Path(code).expanduser()
    if root.is_file() and root.name == name:
        return root
    if not root.is_dir():
        raise SimulatorCodeError(f"code ({str(code)!r}) is not a folder")
    direct = root / name
    if direct.is_file():
        return direct
    found = sorted(p for p in root.rglob(name) if p.is_file())
    if not found:
        raise SimulatorCodeError(f"code ({str(code)!r}): no {name} in it or below it")
    if len(found) > 1:
        listed = ", ".join(str(p) for p in found[:4])
        raise SimulatorCodeError(f"code ({str(code)!r}): several {name} ({listed}); point code at one folder")
    return found[0]


def load_module(
    path: Path, source: str | None = None, extra: dict[str, Any] | None = None
) -> types.ModuleType:
    """Their file as a fresh module of its own (never put in sys.modules, so each simulator
    patches its own copy); `source` replaces the file's text, `extra` is set before it runs."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    module = types.ModuleType(f"rlver_protocol_{path.stem}_{digest}")
    module.__file__ = str(path)
    module.__dict__.update(extra or {})
    text = path.read_text(encoding="utf-8") if source is None else source
    try:
        code = compile(text, str(path), "exec")
        exec(code, module.__dict__)
    except SyntaxError as error:
        raise SimulatorCodeError(f"{path}:{error.lineno}: cannot load: {error.msg}") from None
    except ImportError as error:
        raise SimulatorCodeError(f"{path}: cannot load: {error}") from None
    return module


def _module_strings(path: Path) -> dict[str, str]:
    """The string constants a file defines (RLVER's system_prompt.py holds only those)."""
    module = load_module(path)
    return {
        name: value
        for name, value in vars(module).items()
        if isinstance(value, str) and not name.startswith("__")
    }


_VERL_IMPORT = re.compile(r"^from\s+verl\.[\w.]*system_prompt\s+import\s+\*\s*$", re.MULTILINE)
_CALL_API_STUB = re.compile(r"^def call_api\(.*?(?=^(?:class|def)\s)", re.MULTILINE | re.DOTALL)


def reference_source(text: str) -> str:
    """The reference file with its two loading blockers replaced (see the module docstring)."""
    text, _imports = _VERL_IMPORT.subn("# (system prompts: injected by rlver from system_prompt.py)", text)
    text, stubs = _CALL_API_STUB.subn(
        "def call_api(prompt, mode=None):\n    raise NotImplementedError\n\n\n", text
    )
    if stubs != 1:
        raise SimulatorCodeError("the reference file has no `def call_api(...)` where rlver expects it")
    return text


# --------------------------------------------------------------------------- the two protocols
class _Protocol:
    """How one published simulator is driven: its state per dialogue and its steps."""

    name: str
    start_emotion: float

    def new_state(self, profile: Profile) -> Any:
        raise NotImplementedError

    def open(self, state: Any, first_talk: str | None) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def respond(self, state: Any, reply: str) -> tuple[str, float, dict[str, Any]]:
        raise NotImplementedError

    def emotion(self, state: Any) -> float:
        raise NotImplementedError

    def ending(self, state: Any) -> str | None:
        raise NotImplementedError

    def policy_system_prompt(self, thinking: bool) -> str | None:
        raise NotImplementedError


def _planning_record(raw: Any) -> dict[str, Any]:
    return {str(k): v for k, v in raw.items()} if isinstance(raw, dict) else {}


class SageProtocol(_Protocol):
    """SAGE's simulator_response.py and npc_response.py."""

    name = "sage_official"

    def __init__(
        self, code: str | Path, call_llm: Callable[[str], str], on_print: Callable[..., None]
    ) -> None:
        shim = {"print": on_print, "time": _NoSleep()}
        self.simulator_path = find_file(code, "simulator_response.py")
        self.npc_path = find_file(code, "npc_response.py")
        self.module = load_module(self.simulator_path, extra={})
        self.module.__dict__.update(shim, call_llm=call_llm)
        missing = [
            n
            for n in ("chat_player", "planning_reply", "player_reply")
            if not callable(getattr(self.module, n, None))
        ]
        if missing:
            raise SimulatorCodeError(f"{self.simulator_path}: no {', '.join(missing)}")
        self._system_prompt = self._read_npc_system_prompt()
        self.start_emotion = 40.0  # as their player_init sets it

    def _read_npc_system_prompt(self) -> str:
        """The system message SAGE's call_npc builds for the model under test (its own text)."""
        npc = load_module(self.npc_path)
        seen: list[Any] = []

        def capture(messages: Any) -> str:
            seen.append(messages)
            return ""

        npc.call_llm = capture
        npc.call_npc([])
        messages = seen[0] if seen else None
        if not (isinstance(messages, list) and messages and messages[0].get("role") == "system"):
            raise SimulatorCodeError(f"{self.npc_path}: call_npc did not build a system message")
        return str(messages[0]["content"])

    def new_state(self, profile: Profile) -> dict[str, Any]:
        # Their player_init, field for field, from an rlver profile instead of their file.
        # `target`: their planning_reply indexes the target prompt with it after the prompt is
        # already filled in, so any valid index leaves the prompt as it is; the recorded
        # dialogues say "eq", which only works where the prompt is a dict.
        target_prompt = getattr(self.module, "target_prompt", "")
        return {
            "id": profile.id,
            "emo_point": int(self.start_emotion),
            "emo_state": "Emotion-B",
            "target": "eq" if isinstance(target_prompt, dict) else 0,
            "player": profile.player,
            "scene": profile.scene,
            "character": profile.main_cha,
            "topic": str(profile.extra.get("topic", "")),
            "task": profile.task,
            "history": [],
        }

    def open(self, state: dict[str, Any], first_talk: str | None) -> tuple[str, dict[str, Any]]:
        if first_talk:
            state["history"] = [{"role": "user", "content": first_talk, "emotion-point": state["emo_point"]}]
            return first_talk, {"source": "first_talk"}
        updated = self.module.chat_player(state)
        state.update(updated)
        message = state["history"][-1]
        return str(message["content"]), {"source": "generated", "thinking": message.get("thinking")}

    def respond(self, state: dict[str, Any], reply: str) -> tuple[str, float, dict[str, Any]]:
        before = float(state["emo_point"])
        state["history"] = [*state["history"], {"role": "assistant", "content": reply}]
        updated = self.module.chat_player(state)
        state.update(updated)
        message = state["history"][-1]
        reason = {"planning": _planning_record(message.get("planning")), "thinking": message.get("thinking")}
        return str(message["content"]), float(state["emo_point"]) - before, reason

    def emotion(self, state: dict[str, Any]) -> float:
        return float(state["emo_point"])

    def ending(self, state: dict[str, Any]) -> str | None:
        return {"Emotion-S": "success", "Emotion-F": "failure"}.get(state["emo_state"])

    def policy_system_prompt(self, thinking: bool) -> str:
        return self._system_prompt


class ReferenceProtocol(_Protocol):
    """The RLVER reference's training user (hard_player_simulator_dsv3.py) and system prompts."""

    name = "rlver_reference"
    _ENDS = DIFFICULTIES["hard"]  # its rollout stops at emotion <= 0; its cap is 100

    def __init__(self, code: str | Path, call_api: Callable[..., str], on_print: Callable[..., None]) -> None:
        self.simulator_path = find_file(code, "hard_player_simulator_dsv3.py")
        beside = self.simulator_path.parent / "system_prompt.py"
        self.prompts_path = beside if beside.is_file() else find_file(code, "system_prompt.py")
        self.prompts = _module_strings(self.prompts_path)
        source = reference_source(self.simulator_path.read_text(encoding="utf-8"))
        self.module = load_module(self.simulator_path, source, extra=dict(self.prompts))
        self.module.__dict__.update(print=on_print, time=_NoSleep(), call_api=call_api)
        base = getattr(self.module, "PlayerSimulator", None)
        if not isinstance(base, type):
            raise SimulatorCodeError(f"{self.simulator_path}: no class PlayerSimulator")
        self.player_class = _driven_player_class(base)
        probe = self.player_class(None)
        self.start_emotion = float(probe.emo_point)

    def new_state(self, profile: Profile) -> Any:
        player = self.player_class(profile)
        return player

    def open(self, state: Any, first_talk: str | None) -> tuple[str, dict[str, Any]]:
        if first_talk:
            state.role["history"].append({"role": "user", "content": first_talk})
            return first_talk, {"source": "first_talk"}
        answer = state.reply(None)
        message = state.role["history"][-1]
        return str(answer["content"]), {"source": "generated", "thinking": message.get("thinking")}

    def respond(self, state: Any, reply: str) -> tuple[str, float, dict[str, Any]]:
        before = float(state.emo_point)
        answer = state.reply(reply)
        message = state.role["history"][-1]
        reason = {"planning": _planning_record(message.get("planning")), "thinking": message.get("thinking")}
        return str(answer["content"]), float(state.emo_point) - before, reason

    def emotion(self, state: Any) -> float:
        return float(state.emo_point)

    def ending(self, state: Any) -> str | None:
        return termination(float(state.emo_point), self._ENDS)

    def policy_system_prompt(self, thinking: bool) -> str | None:
        name = "system_prompt_train_think" if thinking else "system_prompt_train_unthink"
        return self.prompts.get(name)


def _driven_player_class(base: type) -> type:
    """PlayerSimulator with its role from an rlver profile and no work at construction.

    Their __init__ sets the emotion rules, then picks a random role from a file and calls the
    simulator once, discarding the answer; here the role is the dialogue's profile and that
    discarded call is not made. Everything after construction is their code.
    """

    class DrivenPlayer(base):  # type: ignore[misc, valid-type]
        def __init__(self, profile: Profile | None) -> None:
            self._profile = profile
            self._constructing = True
            super().__init__(save_dir=None)
            self._constructing = False

        def generate_role(self, target: str, topic: Any = None, seed: Any = None) -> dict[str, Any]:
            profile = self._profile
            if profile is None:
                return {"history": []}
            return {  # their generate_role's fields, from the profile
                "id": profile.id,
                "emo_point": self.emo_point,
                "emo_state": self.emo_state,
                "target": target,
                "player": profile.player,
                "scene": profile.scene,
                "character": profile.main_cha,
                "topic": str(profile.extra.get("topic", "")),
                "history": [],
            }

        def chat_player(self, player_data: dict[str, Any]) -> dict[str, Any]:
            if self._constructing:
                return player_data
            return super().chat_player(player_data)

    return DrivenPlayer


class _NoSleep:
    """Their module's `time`: the clock as it is, without their 3 s waits between attempts."""

    def __getattr__(self, name: str) -> Any:
        import time

        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        return None


# --------------------------------------------------------------------------- the simulators
class _Step(threading.local):
    """What the worker thread running one step of their code is doing (read by call_llm)."""

    session: CodeDrivenSession | None = None
    attempts: Counter[str] | None = None  # calls so far in this step, by answer kind
    stats: Counter[str] | None = None


# What `response_format` may be: their text as it is, or held to their format by a regex.
RESPONSE_FORMATS = ("text", "regex")

# Seeds of different calls of one turn stay 1000 apart; attempts add 1.
_SEED_OFFSETS = {None: 0, "sage_planning": 1, "reference_planning": 1, "reply": 2}


@accepts_renamed_options(OFFICIAL_RENAMES)
class _CodeDrivenSimulator(UserSimulator):
    protocol_class: type[_Protocol]
    waits_on_io = True  # their code calls the endpoint; sessions run in threads of their own

    def __init__(
        self,
        code: str,
        base_url: str,
        model: str,
        api_key_env: str | None = None,
        temperature: float = 0.7,
        top_p: float = 1.0,
        max_tokens: int = 2048,
        seed: int = 0,
        timeout: float = 120.0,
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
        field_max_chars: int = 200,
    ) -> None:
        self._options = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        settings = endpoint_settings(self._options)
        problems = [] if field_max_chars >= 1 else [f"field_max_chars ({field_max_chars}) must be >= 1"]
        settings.check(f"{self.protocol_class.name} simulator", RESPONSE_FORMATS, problems)
        self.counters: Counter[str] = Counter()
        self.seed = seed
        self.max_reasks = max_reasks
        self.structured = response_format == "regex"
        self.field_max_chars = field_max_chars
        self._step = _Step()
        try:
            self.protocol = self.protocol_class(code, self._call_llm, self._on_print)  # type: ignore[call-arg]
        except SimulatorCodeError as error:
            raise ValueError(f"{self.protocol_class.name} simulator: {error}") from None
        self._loop = LoopThread(f"rlver-{self.protocol_class.name}")
        self.client = open_client(self._loop, settings)
        self._pool = ThreadPoolExecutor(
            max_workers=max_concurrency, thread_name_prefix=self.protocol_class.name
        )
        self._finalizer = weakref.finalize(self, _shutdown, self.client, self._loop, self._pool)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self._options))

    def worst_case_seconds(self) -> float | None:
        return self.client.settings.seconds_until_given_up()

    def worst_request_seconds(self) -> float | None:
        return self.client.settings.worst_request_seconds()

    def __repr__(self) -> str:  # never shows the key: it lives only in the HTTP client's headers
        settings = self.client.settings
        return f"{type(self).__name__}(base_url={settings.base_url!r}, model={settings.model!r})"

    # ------------------------------------------------------------------ their call_llm
    def _call_llm(self, prompt: Any, *args: Any, **kwargs: Any) -> str:
        step = self._step
        session, attempts, stats = step.session, step.attempts, step.stats
        if session is None or attempts is None or stats is None:
            raise _GaveUp("their code called the LLM outside a dialogue step")
        kind = self._answer_kind(str(prompt))
        attempts[kind or "other"] += 1
        attempt = attempts[kind or "other"]
        if attempt > self.max_reasks + 1:
            self.counters["unparsed_answers"] += 1
            raise _GaveUp(f"{kind or 'call'}: no usable answer after {self.max_reasks + 1} attempts")
        if attempt > 1:  # their loop is asking again: the last answer did not parse
            self.counters["reasks"] += 1
            stats["reasks"] += 1
        extra = None
        if self.structured and kind:
            extra = {"structured_outputs": {"regex": answer_regex(kind, self.field_max_chars)}}
        seed = (session.seed + 1000 * (3 * session.turn + _SEED_OFFSETS[kind]) + attempt - 1) % (2**31)
        messages = [{"role": "user", "content": str(prompt)}]
        try:
            return self._loop.run(self.client.complete(messages, seed=seed, stats=stats, extra_body=extra))
        except SimulatorUnavailable as error:  # a rejected key / URL / model, or the endpoint is down
            raise _GaveUp(str(error), fatal=error) from None
        except EndpointError as error:
            raise _GaveUp(str(error)) from None

    def _answer_kind(self, prompt: str) -> str | None:
        # Which of their parsers will read the answer: the reply format ends in `Response:`.
        if "Response:" in prompt:
            return "reply"
        if "Reason:" in prompt and "Change:" in prompt:
            return "reference_planning"
        if "Change:" in prompt:
            return "sage_planning"
        return None

    def _on_print(self, *args: Any, **kwargs: Any) -> None:
        self.counters["their_errors"] += 1  # their code prints an exception before retrying

    # ------------------------------------------------------------------ UserSimulator
    def open(self, profile: Profile, *, seed: int) -> CodeDrivenSession:
        return CodeDrivenSession(self, profile, stable_hash(self.seed, seed, profile.id) >> 33)

    def opening_batch(self, sessions: Sequence[UserSession]) -> list[UserTurn]:
        return self._run_all([self._session(s).opening for s in sessions])

    def respond_batch(self, sessions: Sequence[UserSession], replies: Sequence[str]) -> list[UserTurn]:
        owned = [self._session(s) for s in sessions]
        steps = [functools.partial(s.respond, r) for s, r in zip(owned, replies, strict=True)]
        return self._run_all(steps)

    def _run_all(self, steps: list[Callable[[], UserTurn]]) -> list[UserTurn]:
        if len(steps) == 1:
            return [steps[0]()]
        return list(self._pool.map(lambda step: step(), steps))

    def policy_system_prompt(self, profile: Profile, *, thinking: bool) -> str | None:
        return self.protocol.policy_system_prompt(thinking)

    def drain_metrics(self) -> dict[str, float]:
        totals = self.counters + self.client.counters
        self.counters.clear()
        self.client.counters.clear()
        return {name: float(value) for name, value in sorted(totals.items())}

    def close(self) -> None:
        self._finalizer()

    def _session(self, session: UserSession) -> CodeDrivenSession:
        if not isinstance(session, CodeDrivenSession) or session.simulator is not self:
            raise TypeError(f"the {self.protocol.name} simulator can only drive sessions it opened")
        return session


class CodeDrivenSession(UserSession):
    """One dialogue whose user is their code; rlver keeps only the loop around it."""

    def __init__(self, simulator: _CodeDrivenSimulator, profile: Profile, seed: int) -> None:
        self.simulator = simulator
        self.profile = profile
        self.seed = seed
        self.difficulty = simulator.protocol.name
        self.state = simulator.protocol.new_state(profile)
        self.turn = 0
        self._opening: UserTurn | None = None
        self._ended: str | None = None

    @property
    def emotion(self) -> float:
        return self.simulator.protocol.emotion(self.state)

    def _run_step(self, step: Callable[[], Any], *, restore: bool) -> tuple[Any, str | None, Counter[str]]:
        """(what `step` returned, None, stats), or (None, why it gave up, stats)."""
        context = self.simulator._step
        stats: Counter[str] = Counter()
        context.session, context.attempts, context.stats = self, Counter(), stats
        snapshot = copy.deepcopy(self.state) if restore else None
        try:
            return step(), None, stats
        except _GaveUp as gave_up:
            if gave_up.fatal is not None:
                raise gave_up.fatal from None  # a wrong key, URL or model: no dialogue can run
            if snapshot is not None:
                self.state = snapshot  # their state as it was before this step
            return None, gave_up.reason, stats
        finally:
            context.session, context.attempts, context.stats = None, None, None

    def opening(self) -> UserTurn:
        if self._opening is not None:
            return self._opening
        opened, error, stats = self._run_step(
            lambda: self.simulator.protocol.open(self.state, self.profile.first_talk), restore=False
        )
        if error is not None:
            return self._fail(error, stats, opening=True)
        text, reason = opened
        self._opening = UserTurn(text=text, emotion=self.emotion, reason={**reason, **stats})
        return self._opening

    def adopt_opening(self, turn: UserTurn) -> None:
        if self._opening is not None:
            raise RuntimeError(f"profile {self.profile.id}: this session already has its opening")
        if turn.termination == SIMULATOR_ERROR:
            self._opening, self._ended = turn, SIMULATOR_ERROR
            return
        # Their state as if they had said it: the same first message, then the same history.
        self.simulator.protocol.open(self.state, turn.text)
        self._opening = turn

    def respond(self, reply: str) -> UserTurn:
        if self._ended:
            raise RuntimeError(f"profile {self.profile.id}: the dialogue already ended ({self._ended})")
        if self._opening is None:
            self.opening()
        self.turn += 1
        protocol = self.simulator.protocol
        answered, error, stats = self._run_step(lambda: protocol.respond(self.state, reply), restore=True)
        if error is not None:
            return self._fail(error, stats)
        text, change, reason = answered
        ending = protocol.ending(self.state)
        if ending is None and _GOODBYE.search(text):
            ending = "goodbye"
        self._ended = ending
        return UserTurn(
            text=text, emotion=self.emotion, change=change, reason={**reason, **stats}, termination=ending
        )

    def _fail(self, why: str, stats: Counter[str], *, opening: bool = False) -> UserTurn:
        self.simulator.counters["dialogue_errors"] += 1
        self._ended = SIMULATOR_ERROR
        turn = UserTurn(
            text="", emotion=self.emotion, reason={"error": why, **stats}, termination=SIMULATOR_ERROR
        )
        if opening:
            self._opening = turn
        return turn


class SageOfficialSimulator(_CodeDrivenSimulator):
    """The Sentient benchmark's user: SAGE's own `simulator_response.py`, driven by rlver.

    Leaderboard-comparable: the prompts, parsing and emotion rules are SAGE's code as
    published; the model under test gets SAGE's `npc_response.py` system prompt (a
    format's explicit `system_prompt` overrides it).

    Args:
        code: A SAGE checkout, or the folder holding simulator_response.py and npc_response.py.
        base_url: The user model's OpenAI-compatible root, e.g. http://127.0.0.1:8000/v1.
        model: The served model name (the paper: DeepSeek-V3).
        api_key_env: Name of the environment variable holding the API key (never the key).
        temperature: Sampling temperature of the user model.
        top_p: Nucleus sampling mass of the user model.
        max_tokens: Token limit of one answer (their answers carry several analysis fields).
        seed: Base seed; each request's seed mixes it with the dialogue, turn and attempt.
        timeout: Seconds before a request counts as timed out (then retried).
        max_retries: Transport retries of one request (timeouts, connection errors, 429, 5xx).
        backoff_seconds: Base of the exponential backoff between transport retries.
        backoff_max_seconds: Longest wait between two transport retries.
        max_failures_in_a_row: Requests failing all their retries one after another that mean
            the endpoint is down: the run stops (last.ckpt at the last finished step) with one
            error instead of failing every dialogue (0: never).
        max_reasks: Calls one step of their code may make again after the first (their loops
            would retry forever; formerly `max_attempts`, which counted the first call too);
            then the dialogue ends with termination "simulator_error".
        max_concurrency: Dialogues (and requests) in flight at once.
        requests_per_second: Optional rate limit across all dialogues.
        cache: Optional SQLite file caching answers by request, for replays (formerly
            `cache_path`).
        cache_only: Answer only from the cache; needs cache.
        response_format: "text" (their answers as they come) or "regex": send their answer
            format as a regex (vLLM structured outputs), so a small user model still answers in
            the format their parser reads (formerly `structured: true`). Changes what the user
            model may say: for smoke tests, not for scores.
        field_max_chars: With regex, the longest each answer field may be.
    """

    protocol_class = SageProtocol


class ReferenceUserSimulator(_CodeDrivenSimulator):
    """The RLVER paper's training user: the reference's `hard_player_simulator_dsv3.py`, driven by rlver.

    Starts at emotion 30 with unclamped changes (their code); the dialogue ends at emotion
    <= 0 or >= 100 or a goodbye. With this simulator the policy's system prompt is the
    reference's `system_prompt_train_think` / `_unthink` for think / nothink formats.

    Args:
        code: An RLVER checkout, or the folder holding hard_player_simulator_dsv3.py and
            system_prompt.py.
        base_url: The user model's OpenAI-compatible root.
        model: The served model name (the paper: DeepSeek-V3).
        api_key_env: Name of the environment variable holding the API key (never the key).
        temperature: Sampling temperature of the user model.
        top_p: Nucleus sampling mass of the user model.
        max_tokens: Token limit of one answer.
        seed: Base seed; each request's seed mixes it with the dialogue, turn and attempt.
        timeout: Seconds before a request counts as timed out (then retried).
        max_retries: Transport retries of one request.
        backoff_seconds: Base of the exponential backoff between transport retries.
        backoff_max_seconds: Longest wait between two transport retries.
        max_failures_in_a_row: Requests failing all their retries one after another that mean
            the endpoint is down: the run stops (last.ckpt at the last finished step) with one
            error instead of failing every dialogue (0: never).
        max_reasks: Calls one step of their code may make again after the first (formerly
            `max_attempts`, which counted the first call too); then "simulator_error".
        max_concurrency: Dialogues (and requests) in flight at once.
        requests_per_second: Optional rate limit across all dialogues.
        cache: Optional SQLite file caching answers by request, for replays (formerly
            `cache_path`).
        cache_only: Answer only from the cache; needs cache.
        response_format: "text", or "regex": their answer format as a regex (vLLM structured
            outputs; formerly `structured: true`).
        field_max_chars: With regex, the longest each answer field may be.
    """

    protocol_class = ReferenceProtocol


def _shutdown(client: ChatClient, loop: LoopThread, pool: ThreadPoolExecutor) -> None:
    try:
        pool.shutdown(wait=False, cancel_futures=True)
        client.close()
    finally:
        loop.stop()


def _rebuild(cls: type, options: dict[str, Any]) -> _CodeDrivenSimulator:
    return cls(**options)


__all__ = [
    "CodeDrivenSession",
    "ReferenceUserSimulator",
    "SageOfficialSimulator",
    "SimulatorCodeError",
    "answer_regex",
    "reference_source",
]
