"""Rollout throughput: the multi-turn loop with `hf` and with `vllm`, and raw vLLM as the ceiling.

The same 16 test profiles, embedded simulator, seed and token budgets go through the
multi-turn loop with each engine. The ceiling is one raw vLLM call that generates exactly the
tokens the vLLM loop generated (its recorded prompts, each forced to the same length), with no
turn barriers and no simulator. Tokens per second count sampled policy tokens.

    .venv/bin/python benchmarks/rollout_throughput.py [--turns 3] [--tokens 64] [--dtype auto]

Targets on the 2-core CPU: vllm >= 1.5x hf; the vllm loop >= 0.85x the raw ceiling.
"""

from __future__ import annotations

import argparse
import time

from rlver_plugins.embedded_user import EmbeddedUserSimulator
from rlver_plugins.formats import NoThinkFormat
from rlver_plugins.hf_engine import HFEngine
from rlver_plugins.vllm_engine import VLLMEngine

from rlver.data.profiles import load_profiles
from rlver.modeling.models import load_policy
from rlver.rollout.runner import RolloutRunner, RolloutSettings, Trajectory


def sampled_tokens(trajectories: list[Trajectory]) -> int:
    return sum(len(turn.response_ids) for t in trajectories for turn in t.policy_turns)


def run_loop(policy, engine, profiles, settings: RolloutSettings) -> tuple[list[Trajectory], float]:
    runner = RolloutRunner(policy, engine, EmbeddedUserSimulator(), NoThinkFormat(), settings)
    runner.run(profiles[:2], seed=99)  # warm-up: first-call allocations are not throughput
    started = time.perf_counter()
    trajectories = runner.run(profiles, seed=settings.seed)
    return trajectories, time.perf_counter() - started


def raw_ceiling(engine: VLLMEngine, trajectories: list[Trajectory]) -> tuple[int, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, params = [], []
    for trajectory in trajectories:
        for turn in trajectory.policy_turns:
            prompts.append(TokensPrompt(prompt_token_ids=turn.prompt_ids))
            length = len(turn.response_ids)
            params.append(
                SamplingParams(
                    temperature=1.0,
                    max_tokens=length,
                    min_tokens=length,
                    ignore_eos=True,
                    seed=len(params),
                    logprobs=0,
                    detokenize=False,
                )
            )
    # the loop's prompts are cached; the ceiling must not start warm (on the engine's thread)
    engine.on_engine_thread(engine.llm.reset_prefix_cache)
    started = time.perf_counter()
    outputs = engine.on_engine_thread(engine.llm.generate, prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", default="builtin:en_test")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="max new tokens per reply")
    parser.add_argument("--dtype", default="auto", help="vLLM weights: auto (bfloat16) or float32")
    parser.add_argument("--hf-dtype", default="float32", help="transformers weights")
    args = parser.parse_args()

    profiles = load_profiles(args.profiles)
    settings = RolloutSettings(max_turns=args.turns, max_new_tokens=args.tokens, temperature=1.0, seed=0)
    policy = load_policy("smollm2-135m-instruct", dtype=args.hf_dtype)

    hf_trajectories, hf_seconds = run_loop(
        policy, HFEngine(policy, batch_size=len(profiles)), profiles, settings
    )
    started = time.perf_counter()
    vllm_engine = VLLMEngine(policy, dtype=args.dtype)
    startup = time.perf_counter() - started
    vllm_trajectories, vllm_seconds = run_loop(policy, vllm_engine, profiles, settings)
    raw_tokens, raw_seconds = raw_ceiling(vllm_engine, vllm_trajectories)

    hf_rate = sampled_tokens(hf_trajectories) / hf_seconds
    vllm_rate = sampled_tokens(vllm_trajectories) / vllm_seconds
    raw_rate = raw_tokens / raw_seconds
    print(f"{len(profiles)} dialogues x {args.turns} turns x <= {args.tokens} tokens, embedded simulator")
    rows = [
        ("hf loop", sampled_tokens(hf_trajectories), hf_seconds, hf_rate, ""),
        ("vllm loop", sampled_tokens(vllm_trajectories), vllm_seconds, vllm_rate, ""),
        ("vllm raw", raw_tokens, raw_seconds, raw_rate, " (ceiling)"),
    ]
    for name, tokens, seconds, rate, note in rows:
        print(f"{name:10s} {tokens:6d} tokens {seconds:7.1f} s {rate:7.1f} tokens/s{note}")
    print(f"vllm / hf        {vllm_rate / hf_rate:.2f}x   (target >= 1.5x)")
    print(f"loop / ceiling   {vllm_rate / raw_rate:.2f}x   (target >= 0.85x)")
    print(f"vllm engine start {startup:.1f} s (not counted above)")


if __name__ == "__main__":
    main()
