"""The turn-credit ablation on the 4-turn quickstart: does per-turn credit from the user's emotion
learn faster or better than the paper's outcome-only reward?

Four arms, each trained from the same SmolLM2 against the embedded user, several seeds each:

    outcome GRPO      recipes/quickstart_turns.yaml           final emotion, group baseline
    turn-credit GRPO  recipes/quickstart_turns_credit.yaml    per-turn changes, leave-one-out turn credit
    PPO               recipes/quickstart_turns_ppo.yaml       per-turn changes, critic + token-level GAE
    turn-level PPO    recipes/quickstart_turns_turn_gae.yaml  per-turn changes, critic + turn-level GAE

Reported per arm, as mean +- standard error over seeds: the greedy held-out score before and
after training (the recipes' BeforeAfter callback: mean final emotion of 16 test users), the
training reward by step (the mean final emotion of the step's training dialogues: the one
measure every arm shares, whatever its own reward), and the steps each run needed to reach
outcome GRPO's final training reward (the mean of its seeds' last 3 steps; a 3-step moving
average must reach it). A seed changes the sampling and the users' draws, not the model.

    .venv/bin/python benchmarks/turn_credit.py [--steps 28] [--seeds 0 1 2] [--arms ...]
        [--work-dir runs/turn_credit] [--out runs/turn_credit/summary.json]

Figures go in docs/results.md by hand, with the date, the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARMS = {
    "outcome_grpo": "recipes/quickstart_turns.yaml",
    "turn_credit_grpo": "recipes/quickstart_turns_credit.yaml",
    "ppo": "recipes/quickstart_turns_ppo.yaml",
    "turn_ppo": "recipes/quickstart_turns_turn_gae.yaml",
}
BEFORE = re.compile(r"before training\s+(-?[\d.]+)")
AFTER = re.compile(r"after (\d+) steps\s+(-?[\d.]+)")


def train(arm: str, seed: int, steps: int, work_dir: Path, keep_checkpoints: bool) -> dict:
    """One `rlver fit` of `arm` at `seed`; its before/after scores and training curve."""
    root = work_dir / arm / f"seed{seed}"
    shutil.rmtree(root, ignore_errors=True)
    command = [
        sys.executable, "-m", "rlver.cli", "fit", "--config", ARMS[arm],
        "--seed_everything", str(seed), "--model.rollout.seed", str(seed),
        "--trainer.max_steps", str(steps), "--trainer.max_time", "null",
        "--trainer.default_root_dir", str(root),
    ]  # fmt: skip
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    (root / "stdout.txt").parent.mkdir(parents=True, exist_ok=True)
    (root / "stdout.txt").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"{arm} seed {seed} failed ({result.returncode}); see {root / 'stdout.txt'}")
    before, after = BEFORE.search(result.stdout), AFTER.search(result.stdout)
    if before is None or after is None:
        raise SystemExit(f"{arm} seed {seed}: no before/after scores in its output ({root / 'stdout.txt'})")
    curve = training_curve(root / "tensorboard")
    if not keep_checkpoints:
        shutil.rmtree(root / "checkpoints", ignore_errors=True)
    run = {
        "arm": arm, "seed": seed, "seconds": round(seconds, 1), "steps": int(after.group(1)),
        "before": float(before.group(1)), "after": float(after.group(2)), "train_final_emotion": curve,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in run.items() if k != "train_final_emotion"}), flush=True)
    return run


def training_curve(folder: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return [event.value for event in accumulator.Scalars("rollout/final_emotion")]


def mean_se(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, float("nan")
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


def steps_to_reach(curve: list[float], target: float, window: int = 3) -> int | None:
    """The first step (1-based) whose `window`-step moving average reaches `target`."""
    for end in range(window, len(curve) + 1):
        if sum(curve[end - window : end]) / window >= target:
            return end
    return None


def tail_mean(curve: list[float], window: int = 3) -> float:
    tail = curve[-window:]
    return sum(tail) / len(tail)


def summarize(runs: list[dict]) -> dict:
    by_arm: dict[str, list[dict]] = {}
    for run in runs:
        by_arm.setdefault(run["arm"], []).append(run)
    outcome = by_arm.get("outcome_grpo", [])
    target = mean_se([tail_mean(r["train_final_emotion"]) for r in outcome])[0] if outcome else None
    summary = {"target_train_final_emotion": target, "arms": {}}
    for arm, arm_runs in by_arm.items():
        reached = [steps_to_reach(r["train_final_emotion"], target) for r in arm_runs] if target else []
        length = min(len(r["train_final_emotion"]) for r in arm_runs)
        summary["arms"][arm] = {
            "seeds": [r["seed"] for r in arm_runs],
            "before": mean_se([r["before"] for r in arm_runs]),
            "after": mean_se([r["after"] for r in arm_runs]),
            "gain": mean_se([r["after"] - r["before"] for r in arm_runs]),
            "final_train_final_emotion": mean_se([tail_mean(r["train_final_emotion"]) for r in arm_runs]),
            "steps_to_target": reached,
            "steps_to_target_mean": mean_se([s for s in reached if s is not None]) if any(reached) else None,
            "curve": [mean_se([r["train_final_emotion"][i] for r in arm_runs]) for i in range(length)],
            "seconds_per_run": mean_se([r["seconds"] for r in arm_runs]),
        }
    return summary


def table(summary: dict) -> str:
    def cell(pair):
        return "n/a" if pair is None else f"{pair[0]:.1f} ± {pair[1]:.1f}"

    lines = [
        "| arm | greedy before | greedy after | gain | final training emotion "
        "| steps to outcome GRPO's final | s/run |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, row in summary["arms"].items():
        reached = row["steps_to_target"]
        count = sum(s is not None for s in reached)
        steps = f"{cell(row['steps_to_target_mean'])} ({count}/{len(reached)} reached)"
        lines.append(
            f"| {arm} | {cell(row['before'])} | {cell(row['after'])} | {cell(row['gain'])} | "
            f"{cell(row['final_train_final_emotion'])} | {steps} | {row['seconds_per_run'][0]:.0f} |"
        )
    arms = list(summary["arms"])
    lines += [
        "",
        "training final emotion by step (mean ± SE over seeds)",
        "",
        "| step | " + " | ".join(arms) + " |",
    ]
    lines.append("|---" * (len(arms) + 1) + "|")
    length = min(len(row["curve"]) for row in summary["arms"].values())
    for step in range(length):
        lines.append(
            f"| {step + 1} | " + " | ".join(cell(summary["arms"][a]["curve"][step]) for a in arms) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS))
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "turn_credit")
    parser.add_argument(
        "--out", type=Path, default=None, help="summary JSON (default: <work-dir>/summary.json)"
    )
    parser.add_argument("--keep-checkpoints", action="store_true")
    args = parser.parse_args()
    if len(args.seeds) < 2:
        parser.error("--seeds: at least 2 (standard errors need them; the ablation asks for 3)")
    runs = []
    for seed in args.seeds:  # seed-major: an interrupted run still has every arm at the first seeds
        for arm in args.arms:
            runs.append(train(arm, seed, args.steps, args.work_dir, args.keep_checkpoints))
            partial = {"runs": runs, "summary": summarize(runs), "steps": args.steps}
            out = args.out or args.work_dir / "summary.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(partial, indent=1))
    print(table(summarize(runs)))


if __name__ == "__main__":
    main()
