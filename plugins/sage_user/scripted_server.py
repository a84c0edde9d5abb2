"""A scripted OpenAI-compatible chat server, for tests, benchmarks and offline dry runs.

It listens on a real socket and answers `POST /v1/chat/completions` the way
the `sage` prompts ask, with deterministic content: the planning answer's
change grows with the empathy cues in the partner's reply, and the reply
answer is a short line in the format. It can also inject faults on a
schedule (HTTP 429 / 500, delays past the client's timeout, malformed
answers) and add a latency to every answer (fixed, or drawn per request).

    python -m rlver_plugins.sage_user.scripted_server --port 8011 --latency 0.2

Faults are keyed by a marker (any text that appears in one dialogue's system
prompt, e.g. the persona's name), the call kind ("open", "plan", "reply") and
the 1-based count of that kind of call for that marker, re-asks included.
Or at random: `fault_rate` of all requests get one of RANDOM_FAULTS, drawn from
the request's content and how often it was sent (so a retry draws afresh, and
the same run draws the same faults whatever order requests arrive in).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .parsing import split_fields

# Fault actions: an HTTP status, a delay past the timeout, a malformed answer, a body that is
# not a chat completion ("garbage"), or a slow but valid answer ("slow").
FAULTS = ("429", "500", "503", "timeout", "no_change", "words", "fullwidth", "no_response", "garbage", "slow")
# What `fault_rate` draws from: every kind of failure a real endpoint shows.
RANDOM_FAULTS = ("429", "500", "503", "timeout", "no_change", "words", "garbage", "slow")

_EMPATHY = re.compile(
    r"understand|sorry|hear you|feel|sounds|must be|that's hard|理解|感受|难过|辛苦|心疼|不容易",
    re.IGNORECASE,
)


def call_kind(messages: list[dict[str, str]]) -> str:
    """Which sage call a request is: "plan", "reply" or "open" (re-asks keep their kind)."""
    task = next((m["content"] for m in messages if m["role"] == "user"), "")
    if "Origin:" in task:  # checked first: the reply prompt quotes the planning answer
        return "reply"
    # SAGE's and rlver's planning ask for TargetCompletion:, the RLVER reference's for Reason:.
    if "TargetCompletion:" in task or ("Reason:" in task and "Change:" in task):
        return "plan"
    return "open"


def planning_answer(messages: list[dict[str, str]]) -> str:
    task = next((m["content"] for m in messages if m["role"] == "user"), "")
    latest = task.rsplit("Partner: ", 1)[-1] if "Partner: " in task else task.rsplit("对方: ", 1)[-1]
    latest = latest.split("\n\n#", 1)[0]
    cues = len(_EMPATHY.findall(latest))
    change = min(3 * cues, 9) if cues else -4
    return (
        "Content: the partner responds to my story.\n"
        f"TargetCompletion: {'partly' if cues else 'not'} what I need.\n"
        "Activity: I weigh whether they get me.\n"
        f"Analyse: {'somewhat understood' if cues else 'brushed off'}.\n"
        f"Change: {change:+d}"
    )


def reply_answer(messages: list[dict[str, str]]) -> str:
    task = next((m["content"] for m in messages if m["role"] == "user"), "")
    leaving = "say goodbye" in task or "说再见" in task
    text = "Thanks, that helps. Goodbye." if leaving else "Hm, maybe. What would you do in my place?"
    return f"Thinking: stay in character.\nOrigin: {text}\nChange: keep it short.\nResponse: {text}"


def opening_answer(messages: list[dict[str, str]]) -> str:
    text = "Something happened this week and I can't stop thinking about it."
    return f"Thinking: open up a little.\nResponse: {text}"


def malformed(kind: str, fault: str) -> str:
    if fault == "no_change":
        return "Content: hmm.\nAnalyse: I am not sure how I feel."
    if fault == "words":
        return "Content: hmm.\nChange: slightly negative"
    if fault == "fullwidth":  # readable: full-width colon and digits, brackets
        return "Content: ok.\n**Change：** 【＋３】"
    return "Thinking: hm.\nOrigin: no final field here."  # no_response


def as_json(text: str, keys: list[str]) -> str:
    labels = {"target_completion": "TargetCompletion", "revision": "Change"}
    fields = split_fields(text, tuple(labels.get(key, key.capitalize()) for key in keys))
    record: dict[str, Any] = {key: fields.get(labels.get(key, key.capitalize()), "") for key in keys}
    if "change" in record:
        record["change"] = int(record["change"])
    return json.dumps(record)


@dataclass
class Script:
    """What the server does. `faults[(marker, kind, n)]` is one of FAULTS."""

    faults: dict[tuple[str, str, int], str] = field(default_factory=dict)
    # Answers every request instead of the built-in user (e.g. recorded answers in a replay);
    # None from it means "no answer for this request": HTTP 400, and the client gives up.
    responder: Callable[[dict[str, Any]], str | None] | None = None
    latency: float = 0.0
    # A latency drawn per request instead: "fixed:S", "uniform:LO:HI" or "lognormal:MEDIAN:SIGMA"
    # (seconds), from the request's content and how often it was sent, as `fault_rate` draws.
    latency_spec: str | None = None
    # What `fault_rate` draws from (e.g. ("500",): a failed request the client retries).
    fault_kinds: tuple[str, ...] = RANDOM_FAULTS
    timeout_delay: float = 3.0
    fault_rate: float = 0.0
    fault_seed: int = 0
    slow_delay: float = 0.3
    api_key: str | None = None
    calls: Counter[tuple[str, str]] = field(default_factory=Counter)
    served: Counter[str] = field(default_factory=Counter)  # faults actually injected, and "ok"
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0  # the most requests the server was handling at once
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: Counter[str] = field(default_factory=Counter)  # how often each request body arrived
    sent_for_latency: Counter[str] = field(default_factory=Counter)

    def enter(self, headers: dict[str, str]) -> None:
        with self.lock:
            self.headers.append(headers)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def __post_init__(self) -> None:
        if self.latency_spec is not None:
            draw_latency(self.latency_spec, random.Random(0))  # a bad spec fails here, not per request
        unknown = set(self.fault_kinds) - set(FAULTS)
        if unknown:
            raise ValueError(f"fault_kinds: unknown {sorted(unknown)}; known: {', '.join(FAULTS)}")

    def latency_for(self, payload: dict[str, Any]) -> float:
        if self.latency_spec is None:
            return self.latency
        body = json.dumps(payload, sort_keys=True)
        with self.lock:
            self.sent_for_latency[body] += 1
            count = self.sent_for_latency[body]
        return draw_latency(self.latency_spec, random.Random(f"latency:{self.fault_seed}:{count}:{body}"))

    def decide(self, payload: dict[str, Any]) -> tuple[str, str | None]:
        messages = payload.get("messages") or []
        kind = call_kind(messages)
        system = next((m["content"] for m in messages if m["role"] == "system"), "")
        markers = sorted({marker for marker, _, _ in self.faults if marker in system})
        fault = None
        with self.lock:
            self.requests.append(payload)
            for marker in markers:
                self.calls[(marker, kind)] += 1
                fault = fault or self.faults.get((marker, kind, self.calls[(marker, kind)]))
            if fault is None and self.fault_rate > 0:
                body = json.dumps(payload, sort_keys=True)
                self.sent[body] += 1
                draw = random.Random(f"{self.fault_seed}:{self.sent[body]}:{body}")
                if draw.random() < self.fault_rate:
                    fault = draw.choice(self.fault_kinds)
            self.served[fault or "ok"] += 1
        return kind, fault


def draw_latency(spec: str, draw: random.Random) -> float:
    """Seconds for one answer from a "fixed:S", "uniform:LO:HI" or "lognormal:MEDIAN:SIGMA" spec."""
    name, _, numbers = spec.partition(":")
    try:
        values = [float(v) for v in numbers.split(":")] if numbers else []
    except ValueError:
        values = []
    shapes = {"fixed": 1, "uniform": 2, "lognormal": 2}
    if shapes.get(name) != len(values) or any(v < 0 for v in values):
        raise ValueError(
            f"latency {spec!r}: expected fixed:S, uniform:LO:HI or lognormal:MEDIAN:SIGMA (seconds >= 0)"
        )
    if name == "fixed":
        return values[0]
    if name == "uniform":
        return draw.uniform(values[0], values[1])
    return values[0] * math.exp(values[1] * draw.gauss(0.0, 1.0))


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read counters instead
        pass

    def _answered(self) -> None:
        """The request stops counting as in flight before its answer is written: the client may
        send its next request the moment it reads this one, before this thread runs again."""
        if getattr(self, "_counted", False):
            self._counted = False
            self.server.script.leave()

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self._answered()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a timeout we injected)

    def do_GET(self) -> None:
        if self.path.rstrip("/").endswith("/models"):
            self._send(200, {"object": "list", "data": [{"id": "scripted-user", "object": "model"}]})
        else:
            self._send(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        self.server.script.enter(dict(self.headers))
        self._counted = True
        try:
            self._answer()
        finally:
            self._answered()

    def _answer(self) -> None:
        script = self.server.script
        length = int(self.headers.get("Content-Length") or 0)
        payload = json.loads(self.rfile.read(length) or b"{}")
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self._send(404, {"error": {"message": f"no route {self.path}"}})
            return
        if script.api_key is not None and self.headers.get("Authorization") != f"Bearer {script.api_key}":
            # Echoes what it got, as some real APIs do: the client must not repeat it.
            provided = self.headers.get("Authorization", "")
            self._send(401, {"error": {"message": f"invalid API key: {provided}"}})
            return
        kind, fault = script.decide(payload)
        latency = script.latency_for(payload)
        if latency:
            time.sleep(latency)
        if fault in ("429", "500", "503"):
            self._send(int(fault), {"error": {"message": f"injected {fault}"}})
            return
        if fault == "timeout":
            time.sleep(script.timeout_delay)
        if fault == "slow":
            time.sleep(script.slow_delay)
            fault = None  # then a valid answer
        if fault == "garbage":  # HTTP 200 with a body that is not a chat completion
            data = b"<html>502 Bad Gateway</html>"
            self._answered()
            try:
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass
            return
        messages = payload.get("messages") or []
        if script.responder is not None and fault is None:
            answer = script.responder(payload)
            if answer is None:
                self._send(400, {"error": {"message": "the responder has no answer for this request"}})
                return
            content = answer
        elif fault in ("no_change", "words", "fullwidth", "no_response"):
            content = malformed(kind, fault)
        else:
            content = {"plan": planning_answer, "reply": reply_answer, "open": opening_answer}[kind](messages)
            schema = (payload.get("response_format") or {}).get("json_schema", {}).get("schema")
            if schema:  # structured outputs: the same fields as one JSON object
                content = as_json(content, list(schema["properties"]))
        self._send(
            200,
            {
                "id": "scripted",
                "object": "chat.completion",
                "model": payload.get("model", "scripted-user"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": len(content.split())},
            },
        )


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], script: Script) -> None:
        super().__init__(address, _Handler)
        self.script = script


class ScriptedServer:
    """Runs the server in a background thread: `with ScriptedServer(Script()) as server: server.url`."""

    def __init__(self, script: Script | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.script = script or Script()
        self._server = _Server((host, port), self.script)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument(
        "--latency",
        default="0",
        help="seconds added to every answer, or per request: fixed:S, uniform:LO:HI, lognormal:MEDIAN:SIGMA",
    )
    args = parser.parse_args()
    spec = args.latency if ":" in args.latency else None
    script = Script(latency=0.0 if spec else float(args.latency), latency_spec=spec)
    server = ScriptedServer(script, args.host, args.port)
    print(f"scripted user endpoint at {server.url}", flush=True)
    server._server.serve_forever()


if __name__ == "__main__":
    main()
