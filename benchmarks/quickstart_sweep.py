"""Which quickstart settings learn on every seed? Train arms x seeds, evaluate each on held-out users.

Each arm is the quickstart recipe with some `rlver fit` flags; each run trains it at one seed
(`--seed_everything S --model.rollout.seed S`). Then the untrained policy and every run's
`last.ckpt` talk, greedily, with the same held-out users at the same evaluation seed (the
`BeforeAfter` callback's own function, so these are the figures `make quickstart` prints), and the
table gives, per run, the paired change with its 95% interval over users and the training
reward's first and last quarter; per arm, the mean change over seeds with its 95% interval over
seeds. A finished run is not trained again: rerun the command to add arms or seeds.

    .venv/bin/python benchmarks/quickstart_sweep.py --work-dir /tmp/sweep \
        --arm shipped= --arm lr1e-4="--model.actor_lr 1.0e-4" --seeds 0 1 2

Figures go in docs/results.md by hand, with the date, the commit and the machine.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STEP_LINE = re.compile(r"^step (\d+)/\d+\s+reward \S+\s+emotion (-?[\d.]+)", re.MULTILINE)


def train(recipe: str, run_dir: Path, seed: int, flags: list[str]) -> None:
    if (run_dir / "train_seconds").exists():
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [str(REPO / ".venv/bin/rlver"), "fit", "--config", recipe, "--seed_everything", str(seed)]
    command += ["--model.rollout.seed", str(seed), "--trainer.default_root_dir", str(run_dir), *flags]
    print(f"training {run_dir}: {shlex.join(command[1:])}", flush=True)
    started = time.perf_counter()
    with (run_dir / "log.txt").open("w") as log:
        subprocess.run(command, check=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    (run_dir / "train_seconds").write_text(f"{time.perf_counter() - started:.0f}\n")


def training_curve(run_dir: Path) -> list[float]:
    """The mean final emotion of each step's training dialogues, as `rlver fit` printed it."""
    steps = {
        int(step): float(emotion) for step, emotion in STEP_LINE.findall((run_dir / "log.txt").read_text())
    }
    return [steps[k] for k in sorted(steps)]


def quarters(curve: list[float]) -> tuple[float, float]:
    quarter = max(len(curve) // 4, 1)
    return sum(curve[:quarter]) / quarter, sum(curve[-quarter:]) / quarter


def evaluate(recipe: str, checkpoints: dict[str, Path | None], seed: int, samples: int, limit: int) -> dict:
    """Per-user scores of each checkpoint (None: the untrained policy), one engine for all."""
    from rlver.checkpoint.export import load_policy_weights
    from rlver.cli import build_runner, rollout_parser
    from rlver.data.datamodule import ProfileDataModule
    from rlver.train.callbacks import heldout_scores
    from rlver.train.evaluation import evaluation_settings

    cfg = rollout_parser().parse_args(["--config", recipe, "--out", "/dev/null"])
    profiles = ProfileDataModule(**cfg.data.as_dict()).profiles("test")
    profiles = profiles[:limit] if limit else profiles
    runner = build_runner(cfg.model, "cpu")
    runner.settings = evaluation_settings(runner.settings, cfg.model.eval_temperature)
    original = {k: v.clone() for k, v in runner.policy.model.state_dict().items()}
    scores = {}
    for name, checkpoint in checkpoints.items():
        model = runner.policy.model
        if checkpoint is None:
            model.load_state_dict(original)
        else:
            load_policy_weights(model, checkpoint)
        runner.engine.sync_weights()
        scores[name] = heldout_scores(runner.run, profiles, seed, samples)
        print(f"evaluated {name}: {sum(scores[name].values()) / len(scores[name]):.1f}", flush=True)
    runner.simulator.close()
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("--arm", action="append", required=True, help="NAME=FLAGS (flags for rlver fit)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--eval-seed", type=int, default=0)
    parser.add_argument("--eval-samples", type=int, default=1, help="Greedy dialogues per user.")
    parser.add_argument("--eval-limit", type=int, default=0, help="The first N test users (0: all).")
    parser.add_argument("--no-train", action="store_true", help="Only evaluate the runs already trained.")
    parser.add_argument("--train-only", action="store_true", help="Train the missing runs, evaluate none.")
    args = parser.parse_args()
    arms = dict(arm.split("=", 1) for arm in args.arm)

    runs = {}
    for name, flags in arms.items():
        for seed in args.seeds:
            run_dir = args.work_dir / name / f"seed{seed}"
            if not args.no_train:
                train(args.recipe, run_dir, seed, shlex.split(flags))
            if (run_dir / "train_seconds").exists():
                runs[(name, seed)] = run_dir

    if args.train_only:
        return
    from rlver.evaluate.intervals import Interval, mean_interval, paired_by_key

    checkpoints = {"untrained": None} | {
        f"{n}/{s}": d / "checkpoints" / "last.ckpt" for (n, s), d in runs.items()
    }
    scores = evaluate(args.recipe, checkpoints, args.eval_seed, args.eval_samples, args.eval_limit)
    before = scores["untrained"]
    users = len(before)
    print(
        f"\n{users} held-out users x {args.eval_samples} greedy dialogues, evaluation seed {args.eval_seed}; "
        f"untrained {sum(before.values()) / users:.1f}\n"
    )
    print(
        "| arm | seed | greedy after | change [95% interval over users] | users happier | "
        "training reward, first -> last quarter | training s |"
    )
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for name in arms:
        gains, lifts = [], []
        for seed in args.seeds:
            if (name, seed) not in runs:
                continue
            change = paired_by_key(before, scores[f"{name}/{seed}"])
            first, last = quarters(training_curve(runs[(name, seed)]))
            gains.append(change.change.mean)
            lifts.append(last - first)
            seconds = (runs[(name, seed)] / "train_seconds").read_text().strip()
            print(
                f"| {name} | {seed} | {change.after:.1f} | {change.change.format(signed=True)} | "
                f"{change.better}/{users} | {first:.1f} -> {last:.1f} ({last - first:+.1f}) | {seconds} |"
            )
        if gains:
            summary[name] = {
                "gain": mean_interval(gains).as_dict(),
                "min_gain": min(gains),
                "training_lift": mean_interval(lifts).as_dict(),
                "min_training_lift": min(lifts),
            }
    print("\n| arm | mean change over seeds [95% interval] | lowest seed | training lift (mean, lowest) |")
    print("|---|---|---|---|")
    for name, row in summary.items():
        gain = Interval(**row["gain"])
        print(
            f"| {name} | {gain.format(signed=True)} | {row['min_gain']:+.1f} | "
            f"{row['training_lift']['mean']:+.1f}, {row['min_training_lift']:+.1f} |"
        )
    out = args.work_dir / "sweep.json"
    out.write_text(
        json.dumps(
            {
                "scores": scores,
                "summary": summary,
                "eval_seed": args.eval_seed,
                "eval_samples": args.eval_samples,
            },
            indent=1,
        )
    )
    print(f"\nper-user scores: {out}")


if __name__ == "__main__":
    main()
