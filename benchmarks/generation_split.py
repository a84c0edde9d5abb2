"""Where the quickstart's generation time goes: prefill or decode, and what the prefix cache serves.

One quickstart step's rollout (SmolLM2 with the recipe's `vllm` engine, the embedded user, 2
profiles x group 4 = 8 dialogues x 2 turns, at most 40 tokens a reply, temperature 0.7). Each
engine call of the rollout is replayed from its recorded prompts three ways, on a fresh prefix
cache each time: prefill only (one token), the call as the rollout made it, and with the
group's shared prompt prefilled once first (what a group-aware submission would save). Printed
per call: prompt tokens, distinct prompt tokens, seconds, the prefix cache's hit share.

    .venv/bin/python benchmarks/generation_split.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from rlver_plugins.embedded_user import EmbeddedUserSimulator
from rlver_plugins.formats import NoThinkFormat
from rlver_plugins.vllm_engine import VLLMEngine
from rlver_plugins.vllm_engine import engine as vllm_engine_module

from rlver.core.interfaces import SamplingSettings
from rlver.data.profiles import load_profiles
from rlver.modeling.models import load_policy
from rlver.rollout.runner import RolloutRunner, RolloutSettings


class RecordingEngine:
    """The engine, recording each call's prompts and sampling settings."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, sampling):
        self.calls.append(([list(p) for p in prompts], sampling))
        return self.engine.generate(prompts, sampling)


def prefix_hits(engine: VLLMEngine) -> tuple[float, float]:
    """(queried, hit) prompt tokens of vLLM's prefix cache so far."""
    metrics = {m.name: m for m in engine.on_engine_thread(engine.llm.get_metrics)}
    queries = metrics.get("vllm:prefix_cache_queries")
    hits = metrics.get("vllm:prefix_cache_hits")
    return (getattr(queries, "value", 0.0), getattr(hits, "value", 0.0))


def timed(engine: VLLMEngine, prompts, sampling) -> tuple[float, float]:
    engine.on_engine_thread(engine.llm.reset_prefix_cache)
    before = prefix_hits(engine)
    started = time.perf_counter()
    engine.generate(prompts, sampling)
    seconds = time.perf_counter() - started
    after = prefix_hits(engine)
    queried, hit = after[0] - before[0], after[1] - before[1]
    return seconds, hit / queried if queried else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timings are medians of this many")
    args = parser.parse_args()
    policy = load_policy("smollm2-135m-instruct")
    options = vllm_engine_module.engine_options
    # vLLM's statistics (prefix cache hits) only for this measurement: the recipe's engine otherwise
    vllm_engine_module.engine_options = lambda *a, **k: {**options(*a, **k), "disable_log_stats": False}
    engine = VLLMEngine(policy, cpu_kv_cache_gib=2)
    recorder = RecordingEngine(engine)
    settings = RolloutSettings(max_turns=2, max_new_tokens=40, temperature=0.7, max_context_tokens=2048)
    runner = RolloutRunner(policy, recorder, EmbeddedUserSimulator(), NoThinkFormat(), settings)
    profiles = load_profiles("builtin:en_train")[:2]
    runner.run([p for p in profiles for _ in range(4)], seed=0, group_size=4)
    print(
        "| call | prompts | prompt tokens | distinct | prefill only | as made | hits | shared prefix first |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for index, (prompts, sampling) in enumerate(recorder.calls):
        distinct = {tuple(p) for p in prompts}
        one = SamplingSettings(1, sampling.temperature, sampling.top_p, sampling.seed, sampling.prompt_seeds)
        prefill = statistics.median(timed(engine, prompts, one)[0] for _ in range(args.repeats))
        runs = [timed(engine, prompts, sampling) for _ in range(args.repeats)]
        full, hit_share = statistics.median(r[0] for r in runs), runs[0][1]
        leaders = [list(p) for p in distinct]
        warm_runs = []
        for _ in range(args.repeats):
            engine.on_engine_thread(engine.llm.reset_prefix_cache)
            started = time.perf_counter()
            engine.generate(leaders, SamplingSettings(1, 0.0))  # the shared prompts, once each
            engine.generate(prompts, sampling)
            warm_runs.append(time.perf_counter() - started)
        warm = statistics.median(warm_runs)
        print(
            f"| {index + 1} | {len(prompts)} | {sum(map(len, prompts))} | {sum(map(len, distinct))} | "
            f"{prefill:.2f} s | {full:.2f} s | {100 * hit_share:.0f}% | {warm:.2f} s |"
        )


if __name__ == "__main__":
    main()
