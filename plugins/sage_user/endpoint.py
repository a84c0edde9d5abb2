"""One settings object for an OpenAI-compatible endpoint, shared by every client that calls one.

The `sage` user, SAGE's and the reference's own simulators (`sage_official`, `rlver_reference`)
and the `dimensions` judge all talk to an endpoint through `client.ChatClient`. Their options
for it carry the same names everywhere (`base_url`, `model`, `api_key_env`, sampling, `timeout`,
`max_retries`, `max_concurrency`, `cache`, `cache_only`, `max_reasks`, `response_format`, ...),
are gathered into one `EndpointSettings` and checked by one `EndpointSettings.check`, which
names every problem in one error. Configs stay flat: a plugin's options are its constructor's
keyword arguments (`simulator: {name: sage, base_url: ..., cache: ...}`), each client with
defaults of its own (a judge samples at temperature 0, a user at 0.7).

Names used before the options were shared still work for a while: `renamed_options` maps them
to today's name (and value), with one FutureWarning per name and process.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rlver.core.interfaces import Component

# What `response_format` may ask the server for. Each client accepts the ones it can read.
RESPONSE_FORMATS = {
    "text": "plain text, read by the client's own parser",
    "json_object": "OpenAI's JSON mode: any one JSON object",
    "json_schema": "structured outputs: a JSON object with the client's fields",
    "regex": "vLLM's structured outputs: text matching the format the parser reads",
}


@dataclass(frozen=True)
class EndpointSettings:
    """How to reach one OpenAI-compatible endpoint and how hard to try.

    It holds the name of the API key's environment variable, never the key (`api_key()` reads it),
    so its repr, a pickled client and a saved config are safe to show.
    """

    base_url: str
    model: str
    api_key_env: str | None = None
    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 512
    seed: int = 0
    timeout: float = 60.0
    max_retries: int = 4
    backoff_seconds: float = 1.0
    backoff_max_seconds: float = 30.0
    max_failures_in_a_row: int = 8
    max_concurrency: int = 32
    requests_per_second: float | None = None
    cache: str | None = None
    cache_only: bool = False
    max_reasks: int = 2
    response_format: str = "text"

    def problems(self, response_formats: Sequence[str] = ("text",)) -> list[str]:
        """Everything wrong with these settings, each naming its option; `response_formats` are
        the formats the client using them can read."""
        found = []
        if not self.base_url.startswith(("http://", "https://")):
            found.append(f"base_url ({self.base_url!r}) must start with http:// or https://")
        if not self.model:
            found.append("model must be a model name the endpoint serves")
        if self.api_key_env and not os.environ.get(self.api_key_env):
            found.append(f"api_key_env: the environment variable {self.api_key_env} is not set")
        if self.timeout <= 0:
            found.append(f"timeout ({self.timeout}) must be > 0")
        if self.max_tokens < 1:
            found.append(f"max_tokens ({self.max_tokens}) must be >= 1")
        for name in ("max_retries", "max_reasks", "max_failures_in_a_row"):
            if getattr(self, name) < 0:
                found.append(f"{name} ({getattr(self, name)}) must be >= 0")
        if self.backoff_seconds < 0 or self.backoff_max_seconds < 0:
            found.append("backoff_seconds and backoff_max_seconds must be >= 0")
        if self.max_concurrency < 1:
            found.append(f"max_concurrency ({self.max_concurrency}) must be >= 1")
        if self.requests_per_second is not None and self.requests_per_second <= 0:
            found.append(f"requests_per_second ({self.requests_per_second}) must be > 0")
        if self.cache_only and not self.cache:
            found.append("cache_only needs cache")
        if self.response_format not in response_formats:
            found.append(
                f"response_format ({self.response_format!r}) must be one of {', '.join(response_formats)}"
            )
        return found

    def check(
        self, owner: str, response_formats: Sequence[str] = ("text",), more_problems: Sequence[str] = ()
    ) -> None:
        """Raise one ValueError naming `owner` (e.g. "sage simulator") and every problem: these
        settings' and the client's own (`more_problems`, e.g. an unknown language)."""
        found = [*self.problems(response_formats), *more_problems]
        if found:
            raise ValueError(f"{owner}: " + "; ".join(found))

    def api_key(self) -> str | None:
        """The key from the environment variable `api_key_env` names (None without one)."""
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    def worst_request_seconds(self) -> float:
        """One request's longest life: every attempt timing out, the longest backoff between them."""
        return (self.max_retries + 1) * self.timeout + self.max_retries * self.backoff_max_seconds

    def seconds_until_given_up(self) -> float | None:
        """A dead endpoint: requests fail one after another (one dialogue per rank: in sequence)
        until `max_failures_in_a_row` of them have; None when that limit is off (0)."""
        if self.max_failures_in_a_row <= 0:
            return None
        return self.max_failures_in_a_row * self.worst_request_seconds()


def endpoint_settings(options: Mapping[str, Any]) -> EndpointSettings:
    """The EndpointSettings among a constructor's options (the others are the client's own)."""
    names = EndpointSettings.__dataclass_fields__
    return EndpointSettings(**{name: value for name, value in options.items() if name in names})


# --------------------------------------------------------------------------- names of the past
@dataclass(frozen=True)
class Renamed:
    """An option's old name: what it is called now and how an old value reads under that name."""

    new: str
    convert: Callable[[Any], Any] | None = None
    meaning: str = ""  # said in the warning when the value changes too

    def value(self, old_value: Any) -> Any:
        return old_value if self.convert is None else self.convert(old_value)


CACHE_PATH = {"cache_path": Renamed("cache")}
JUDGE_RENAMES = {
    "max_answer_retries": Renamed("max_reasks"),
    "json_mode": Renamed(
        "response_format",
        lambda on: "json_object" if on else "text",
        "json_mode: true is response_format: json_object",
    ),
}
OFFICIAL_RENAMES = {
    **CACHE_PATH,
    "max_attempts": Renamed(
        "max_reasks", lambda attempts: int(attempts) - 1, "max_attempts: N calls is max_reasks: N - 1"
    ),
    "structured": Renamed(
        "response_format", lambda on: "regex" if on else "text", "structured: true is response_format: regex"
    ),
}

_warned: set[tuple[str, str]] = set()  # (class, old name): each warns once per process
C = TypeVar("C", bound=type[Component])


def accepts_renamed_options(renames: Mapping[str, Renamed]) -> Callable[[C], C]:
    """A class decorator: the constructor also takes the old names in `renames`, maps each to
    its new name (and value) and warns once per name. The class's `renamed_options` tells the
    plugin registry to accept them in configs too; the signature stays today's, for the docs."""

    def decorate(cls: C) -> C:
        init = cls.__init__
        signature = inspect.signature(init)

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **options: Any) -> None:
            old = [name for name in options if name in renames and name not in signature.parameters]
            if old:
                given = signature.bind_partial(
                    self, *args, **{k: v for k, v in options.items() if k not in old}
                )
                options = _with_new_names(type(self).__name__, old, options, set(given.arguments), renames)
            init(self, *args, **options)

        cls.__init__ = __init__  # type: ignore[misc]
        cls.renamed_options = {**cls.renamed_options, **renames}
        return cls

    return decorate


def _with_new_names(
    owner: str, old: list[str], options: dict[str, Any], given: set[str], renames: Mapping[str, Renamed]
) -> dict[str, Any]:
    mapped = {name: value for name, value in options.items() if name not in old}
    for name in old:
        renamed = renames[name]
        if renamed.new in given or renamed.new in mapped:
            raise ValueError(f"{owner}: {name} is the old name of {renamed.new}; give only {renamed.new}")
        mapped[renamed.new] = renamed.value(options[name])
        if (owner, name) not in _warned:
            _warned.add((owner, name))
            how = f" ({renamed.meaning})" if renamed.meaning else ""
            warnings.warn(
                f"{owner}: the option {name} is now called {renamed.new}{how}; the old name will go",
                FutureWarning,
                stacklevel=3,
            )
    return mapped
