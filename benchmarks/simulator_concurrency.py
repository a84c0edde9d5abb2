"""How much the `sage` user gains from running all dialogues' calls concurrently.

B dialogues talk to a local OpenAI-compatible endpoint (the scripted server on
127.0.0.1, real sockets) that answers every request after a fixed latency, as
a remote LLM would. Each dialogue runs `--turns` turns of two calls (planning,
reply). "One at a time" allows one request in flight (the reference's
sequential calls); "concurrent" allows all of them. Target: speedup >= 0.7 x B.

    python benchmarks/simulator_concurrency.py [--latency 0.2] [--turns 2] [--sizes 1 8 32]
"""

from __future__ import annotations

import argparse
import time

from rlver_plugins.sage_user import SageUserSimulator
from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

from rlver.core.types import Profile


def profile(index: int) -> Profile:
    return Profile(
        f"bench-{index}",
        f"* Name: User{index}",
        "Their bakery is failing.",
        "passive",
        ("a", "b", "c"),
        "You want deep empathy, not shallow comfort.",
        first_talk="Hi, got a minute?",
    )


def run(url: str, dialogues: int, turns: int, concurrency: int) -> tuple[float, int]:
    """Seconds for `turns` turns of `dialogues` dialogues, and the requests made."""
    simulator = SageUserSimulator(url, "scripted-user", max_concurrency=concurrency, timeout=30)
    sessions = [simulator.open(profile(i), seed=i) for i in range(dialogues)]
    simulator.opening_batch(sessions)
    started = time.perf_counter()
    for _ in range(turns):
        simulator.respond_batch(sessions, ["I hear you; that sounds really hard."] * dialogues)
    seconds = time.perf_counter() - started
    requests = int(simulator.drain_metrics().get("requests", 0))
    simulator.close()
    return seconds, requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency", type=float, default=0.2, help="seconds the endpoint takes per request")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    print(f"latency {args.latency:.2f} s per request, {args.turns} turns (2 requests a turn)\n")
    print("| B | requests | one at a time (s) | concurrent (s) | speedup | target (0.7 x B) |")
    print("| --- | --- | --- | --- | --- | --- |")
    with ScriptedServer(Script(latency=args.latency)) as server:
        for size in args.sizes:
            sequential, requests = run(server.url, size, args.turns, concurrency=1)
            concurrent, _ = run(server.url, size, args.turns, concurrency=max(size, 1))
            speedup = sequential / concurrent
            verdict = "met" if speedup >= 0.7 * size else "MISSED"
            print(
                f"| {size} | {requests} | {sequential:.2f} | {concurrent:.2f} | {speedup:.2f}x "
                f"| {0.7 * size:.1f}x {verdict} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
