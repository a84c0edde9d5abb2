"""An async client for OpenAI-compatible chat endpoints, built for many parallel dialogues.

- Concurrency: a semaphore bounds requests in flight; an optional rate limiter
  (aiolimiter) bounds requests per second.
- Failures: timeouts, connection errors, 429 and 5xx are retried with
  exponential backoff and full jitter (tenacity), a bounded number of times,
  then raised as `EndpointError`. Errors that retrying cannot fix (401, 403,
  404: a wrong key, URL or model name) raise `EndpointConfigError` at once.
- Cache: an optional SQLite file maps a request (model, messages, sampling) to
  its answer, so a rerun or an evaluation replays without the endpoint.
- The API key is read from the environment when the client is built and only
  ever sent in the Authorization header; it is never stored elsewhere.

All coroutines run on one event loop in a daemon thread (`LoopThread`), so the
synchronous training loop can hand a whole turn's calls over and wait.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import threading
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
from aiolimiter import AsyncLimiter
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from rlver.core.interfaces import SimulatorUnavailable

from .endpoint import EndpointSettings

T = TypeVar("T")

__all__ = [
    "ChatClient",
    "EndpointConfigError",
    "EndpointDown",
    "EndpointError",
    "EndpointSettings",
    "LoopThread",
    "ResponseCache",
    "open_client",
]


class EndpointError(RuntimeError):
    """A request failed after every retry (or cannot be answered from a replay-only cache)."""


class EndpointConfigError(SimulatorUnavailable):
    """The endpoint rejects the configuration itself (key, URL, model); retrying cannot help."""


class EndpointDown(SimulatorUnavailable):
    """Request after request failed after all its retries: the endpoint is down, not flaky."""


class _Transient(Exception):
    """An HTTP status worth retrying (429, 5xx)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status = status


def _is_transient(error: BaseException) -> bool:
    return isinstance(error, _Transient | httpx.TimeoutException | httpx.TransportError)


def open_client(loop: LoopThread, settings: EndpointSettings) -> ChatClient:
    """A ChatClient on `loop` for `settings` (checked by the caller), with its response cache if
    `settings.cache` names one; the key is read from `settings.api_key_env` here, and only here."""
    cache = ResponseCache(settings.cache) if settings.cache else None
    return ChatClient(settings, settings.api_key(), loop, cache=cache, cache_only=settings.cache_only)


class LoopThread:
    """An asyncio event loop running in a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


class ResponseCache:
    """Request -> answer, in a SQLite file; only used from the client's loop thread."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False)
        self._db.execute("CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, answer TEXT NOT NULL)")
        self._db.commit()

    @staticmethod
    def key(payload: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    def get(self, key: str) -> str | None:
        row = self._db.execute("SELECT answer FROM answers WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def put(self, key: str, answer: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO answers (key, answer) VALUES (?, ?)", (key, answer))
        self._db.commit()

    def close(self) -> None:
        self._db.close()


class ChatClient:
    """Chat completions against one OpenAI-compatible endpoint, with counters.

    `counters` (requests, retries, timeouts, http_errors, cache_hits, ...) keep
    running totals; the simulator drains them into metrics.
    """

    def __init__(
        self,
        settings: EndpointSettings,
        api_key: str | None,
        loop: LoopThread,
        cache: ResponseCache | None = None,
        cache_only: bool = False,
    ) -> None:
        self.settings = settings
        self.cache = cache
        self.cache_only = cache_only
        self.counters: Counter[str] = Counter()
        self._loop = loop
        self._failures_in_a_row = 0  # requests that failed every retry, since the last answer
        self._down: EndpointDown | None = None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Some servers echo the key they rejected; nothing they say reaches a message unredacted.
        self._redact = (lambda text: text.replace(api_key, "***")) if api_key else (lambda text: text)

        async def build() -> tuple[httpx.AsyncClient, asyncio.Semaphore, AsyncLimiter | None]:
            limits = httpx.Limits(max_connections=settings.max_concurrency)
            client = httpx.AsyncClient(
                base_url=settings.base_url.rstrip("/") + "/",
                headers=headers,
                timeout=httpx.Timeout(settings.timeout),
                limits=limits,
            )
            rate = settings.requests_per_second
            limiter = AsyncLimiter(rate, 1.0) if rate else None
            return client, asyncio.Semaphore(settings.max_concurrency), limiter

        # Loop-bound objects are created on the loop that will use them.
        self._http, self._slots, self._limiter = loop.run(build())

    async def complete(
        self,
        messages: list[dict[str, str]],
        *,
        seed: int,
        stats: Counter[str] | None = None,
        response_format: dict[str, Any] | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> str:
        """The assistant text for `messages`; raises EndpointError / EndpointConfigError.

        `stats`, when given, also counts this call's retries (for the transcript);
        `extra_body` adds server-specific fields (e.g. vLLM's `structured_outputs`).
        """
        payload = {
            "model": self.settings.model,
            "messages": messages,
            "temperature": self.settings.temperature,
            "top_p": self.settings.top_p,
            "max_tokens": self.settings.max_tokens,
            "seed": seed,
        }
        if response_format is not None:
            payload["response_format"] = response_format
        if extra_body:
            payload.update(extra_body)
        key = ResponseCache.key(payload) if self.cache is not None else ""
        if self.cache is not None:
            cached = self.cache.get(key)
            if cached is not None:
                self.counters["cache_hits"] += 1
                return cached
            if self.cache_only:
                self.counters["cache_misses"] += 1
                raise EndpointError("no cached answer for this request (cache_only is set)")
        if self._down is not None:
            raise self._down  # the endpoint was judged down: fail fast, the run is stopping
        answer = await self._post_with_retries(payload, stats if stats is not None else Counter())
        if self.cache is not None:
            self.cache.put(key, answer)
        return answer

    async def _post_with_retries(self, payload: dict[str, Any], stats: Counter[str]) -> str:
        settings = self.settings

        def count_retry(state: Any) -> None:
            self.counters["retries"] += 1
            stats["retries"] += 1
            error = state.outcome.exception() if state.outcome else None
            if isinstance(error, httpx.TimeoutException):
                self.counters["timeouts"] += 1
            elif isinstance(error, _Transient):
                self.counters[f"http_{error.status}"] += 1
            else:
                self.counters["connection_errors"] += 1

        retrying = AsyncRetrying(
            stop=stop_after_attempt(settings.max_retries + 1),
            wait=wait_random_exponential(
                multiplier=settings.backoff_seconds, max=settings.backoff_max_seconds
            ),
            retry=retry_if_exception(_is_transient),
            before_sleep=count_retry,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    answer = await self._post(payload)
                    self._failures_in_a_row = 0
                    return answer
        except (_Transient, httpx.TimeoutException, httpx.TransportError) as error:
            self.counters["failed_requests"] += 1
            kind = (
                "timed out"
                if isinstance(error, httpx.TimeoutException)
                else str(error) or type(error).__name__
            )
            self._failures_in_a_row += 1
            limit = settings.max_failures_in_a_row
            if limit and self._failures_in_a_row >= limit and self._down is None:
                self._down = EndpointDown(
                    f"{settings.base_url}: {self._failures_in_a_row} requests in a row failed after "
                    f"{settings.max_retries + 1} attempts each (last: {kind}); the simulator endpoint "
                    f"looks down (max_failures_in_a_row: {limit})"
                )
            if self._down is not None:
                raise self._down from None
            raise EndpointError(
                f"{settings.base_url}: request failed after {settings.max_retries + 1} attempts ({kind})"
            ) from None
        raise AssertionError("unreachable: tenacity either returns or raises")

    async def _post(self, payload: dict[str, Any]) -> str:
        async with self._slots:
            if self._limiter is not None:
                await self._limiter.acquire()
            self.counters["requests"] += 1
            # httpx's timeout bounds each read; this bounds the whole answer, so a server
            # that trickles bytes cannot hold a dialogue forever.
            try:
                response = await asyncio.wait_for(
                    self._http.post("chat/completions", json=payload), timeout=self.settings.timeout
                )
            except asyncio.TimeoutError:
                raise httpx.ReadTimeout(f"no complete answer within {self.settings.timeout} s") from None
        status = response.status_code
        if status == 429 or status >= 500:
            raise _Transient(status, self._redact(response.text))
        if status in (401, 403, 404):
            raise EndpointConfigError(
                f"{self.settings.base_url} answered HTTP {status} for model {self.settings.model!r}: "
                f"{self._redact(response.text)[:200]} (check base_url, model and the API key variable)"
            )
        if status >= 400:
            self.counters["failed_requests"] += 1
            raise EndpointError(
                f"{self.settings.base_url} answered HTTP {status}: {self._redact(response.text)[:200]}"
            )
        try:
            body = response.json()
            content = body["choices"][0]["message"]["content"]
            usage = body.get("usage") or {}
        except (ValueError, KeyError, IndexError, TypeError):
            self.counters["failed_requests"] += 1
            raise EndpointError(
                f"{self.settings.base_url}: not a chat completion: {self._redact(response.text)[:200]!r}"
            ) from None
        self.counters["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
        self.counters["completion_tokens"] += int(usage.get("completion_tokens") or 0)
        return str(content or "")

    def close(self) -> None:
        self._loop.run(self._http.aclose())
        if self.cache is not None:
            self.cache.close()
