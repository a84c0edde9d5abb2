"""An LLM judge over any OpenAI-compatible endpoint: a finished dialogue in, a score per dimension out.

It talks through the `sage` user's client (rlver_plugins.sage_user.client): the same bounded
concurrency, bounded retries with jittered backoff for timeouts / 429 / 5xx, and SQLite response
cache, so a judged file can be judged again without the endpoint. What the client cannot retry
is the answer itself: an answer that is not JSON, lacks a dimension or scores outside 0-10 is
asked again (a new seed, so neither a cache nor a deterministic server replays it) at most
`max_reasks` times; then the dimensions it never scored are recorded as None. A request
that fails every transport retry records the whole dialogue as None. Only a wrong endpoint
configuration (401/403/404) or an endpoint that is down stops the run, with the client's message.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

from rlver_plugins.sage_user.client import EndpointError, LoopThread, open_client
from rlver_plugins.sage_user.endpoint import JUDGE_RENAMES, accepts_renamed_options, endpoint_settings

from rlver.core.interfaces import DialogueJudge

from .parsing import parse_judge_answer
from .rubrics import DIMENSIONS, SCORE_MAX, SCORE_MIN


def judge_system_prompt(dimensions: Sequence[str]) -> str:
    rubrics = "\n".join(
        f"- {name} ({DIMENSIONS[name].title}): {DIMENSIONS[name].rubric}" for name in dimensions
    )
    example = ", ".join(f'"{name}": <{SCORE_MIN:g}-{SCORE_MAX:g}>' for name in dimensions)
    return (
        "You evaluate an AI assistant's replies in a finished emotional-support conversation. "
        "Judge only the assistant's messages, in the light of what the user said. Rate each "
        f"dimension with an integer from {SCORE_MIN:g} to {SCORE_MAX:g}:\n{rubrics}\n\n"
        f"Answer with only one JSON object and no other text: {{{example}}}"
    )


def transcript_text(messages: Sequence[dict[str, str]]) -> str:
    speakers = {"user": "User", "assistant": "Assistant"}
    lines = [f"{speakers[m['role']]}: {m['content']}" for m in messages if m.get("role") in speakers]
    return "The conversation:\n\n" + "\n\n".join(lines)


# What `response_format` may be: free text with a JSON object in it, or OpenAI's JSON mode.
RESPONSE_FORMATS = ("text", "json_object")


@accepts_renamed_options(JUDGE_RENAMES)
class DimensionJudge(DialogueJudge):
    """Scores dialogues on `dimensions` (default: all of rubrics.DIMENSIONS) with one request each."""

    def __init__(
        self,
        base_url: str,
        model: str,
        dimensions: list[str] | None = None,
        api_key_env: str | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_tokens: int = 200,
        seed: int = 0,
        timeout: float = 60.0,
        max_retries: int = 3,
        backoff_seconds: float = 1.0,
        backoff_max_seconds: float = 30.0,
        max_failures_in_a_row: int = 8,
        max_reasks: int = 2,
        max_concurrency: int = 16,
        requests_per_second: float | None = None,
        cache: str | None = None,
        cache_only: bool = False,
        response_format: str = "text",
    ) -> None:
        """
        Args:
            base_url: the OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1.
            model: the judge model's name at that endpoint.
            dimensions: which to score (empathy, insight, action, guidance, style).
            api_key_env: the environment variable holding the API key (None: no key).
            temperature: sampling temperature of the judge model (0: its most likely scores).
            top_p: nucleus sampling mass of the judge model.
            max_tokens: token limit of one answer.
            seed: base seed; each re-ask adds one.
            timeout: seconds before a request counts as timed out (then retried).
            max_retries: transport retries per request (timeouts, 429, 5xx), as the sage user's.
            backoff_seconds: base of the exponential backoff between transport retries.
            backoff_max_seconds: longest wait between two transport retries.
            max_failures_in_a_row: requests failing all their retries one after another that
                mean the endpoint is down: judging stops with one error (0: never).
            max_reasks: re-asks after an unusable answer (bad JSON, a dimension missing or out
                of range) before its missing dimensions are recorded as None (formerly
                `max_answer_retries`).
            max_concurrency: requests in flight at most.
            requests_per_second: optional rate limit across all dialogues.
            cache: a SQLite file of answers (a rerun replays them).
            cache_only: never call out: answer only from the cache; needs cache.
            response_format: "text", or "json_object" to ask for OpenAI's JSON mode (servers
                that support it; formerly `json_mode: true`).
        """
        chosen = list(dimensions) if dimensions is not None else list(DIMENSIONS)
        unknown = [name for name in chosen if name not in DIMENSIONS]
        if unknown or not chosen:
            raise ValueError(
                f"judge.dimensions: unknown {unknown or 'empty list'}; known: {', '.join(DIMENSIONS)}"
            )
        settings = endpoint_settings(locals())
        settings.check("judge", RESPONSE_FORMATS)
        self.dimensions = tuple(chosen)
        self.max_reasks = max_reasks
        self.seed = seed
        self.response_format = {"type": "json_object"} if response_format == "json_object" else None
        self.system_prompt = judge_system_prompt(self.dimensions)
        self.counters: Counter[str] = Counter()
        self._loop = LoopThread("rlver-judge")
        self._client = open_client(self._loop, settings)

    def judge(self, dialogues: Sequence[Sequence[dict[str, str]]]) -> list[dict[str, float | None]]:
        async def all_of_them() -> list[dict[str, float | None]]:
            return list(await asyncio.gather(*(self._judge_one(messages) for messages in dialogues)))

        return self._loop.run(all_of_them())

    async def _judge_one(self, messages: Sequence[dict[str, str]]) -> dict[str, float | None]:
        request = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": transcript_text(messages)},
        ]
        best: dict[str, float] = {}
        for attempt in range(self.max_reasks + 1):
            self.counters["requests"] += 1
            try:
                text = await self._client.complete(
                    request, seed=self.seed + attempt, response_format=self.response_format
                )
            except EndpointError:
                self.counters["failed_requests"] += 1
                break  # the client already retried the transport; re-asking would do it again
            answer = parse_judge_answer(text, self.dimensions)
            best.update(answer.scores)
            if answer.complete:
                break
            self.counters["unusable_answers"] += 1
            if attempt < self.max_reasks:
                self.counters["re_asks"] += 1
        scores: dict[str, float | None] = {name: best.get(name) for name in self.dimensions}
        self.counters["missing_scores"] += sum(value is None for value in scores.values())
        return scores

    def drain_metrics(self) -> dict[str, float]:
        metrics = {f"judge/{key}": float(value) for key, value in self.counters.items()}
        metrics.update({f"judge/http_{k}": float(v) for k, v in self._client.counters.items()})
        self.counters.clear()
        self._client.counters.clear()
        return metrics

    def close(self) -> None:
        self._client.close()
        self._loop.stop()

    def __repr__(self) -> str:
        return f"DimensionJudge({self._client.settings.model!r}, dimensions={list(self.dimensions)})"
