"""Does the quickstart learn? Evaluate, train, evaluate again, and plot.

1. the untrained SmolLM2 talks (greedy) with the 16 English test users;
2. `rlver fit --config recipes/quickstart.yaml` trains it (timed);
3. the trained checkpoint talks with the same users, same settings;
4. prints before/after mean final emotion, success and failure, and writes a plot of the
   training reward per step plus the before/after comparison.

    .venv/bin/python benchmarks/learning_curve.py [--recipe recipes/quickstart.yaml] [--skip-train]

Figures go in docs/results.md by hand, with the date and the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(command: list[str]) -> float:
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=REPO)
    return time.perf_counter() - started


def evaluate(recipe: str, out: Path, ckpt: Path | None, turns: int | None) -> dict[str, float]:
    command = [
        sys.executable,
        "-m",
        "rlver.cli",
        "rollout",
        "--config",
        recipe,
        "--out",
        str(out),
        "--split",
        "test",
        "--model.rollout.temperature",
        "0",
    ]
    if turns is not None:
        command += ["--model.rollout.max_turns", str(turns)]
    if ckpt is not None:
        command += ["--ckpt", str(ckpt)]
    run(command)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    finals = [r["final_emotion"] for r in records]
    return {
        "dialogues": len(records),
        "mean_final_emotion": sum(finals) / len(finals),
        "success": sum(r["termination"] == "success" for r in records),
        "failure": sum(r["termination"] == "failure" for r in records),
        "mean_turns": sum(r["num_turns"] for r in records) / len(records),
    }


def training_curve(log_dir: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars("rollout/final_emotion")]


def plot(curve: list[tuple[int, float]], before: dict, after: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5), gridspec_kw={"width_ratios": [3, 1]})
    steps = [s for s, _ in curve]
    values = [v for _, v in curve]
    window = 5
    smooth = [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]
    left.plot(steps, values, alpha=0.35, label="per step (8 sampled dialogues)")
    left.plot(steps, smooth, label=f"moving mean ({window})")
    left.set_xlabel("training step")
    left.set_ylabel("mean final emotion")
    left.set_title("training rollouts")
    left.legend()
    scores = [before["mean_final_emotion"], after["mean_final_emotion"]]
    bars = right.bar(["before", "after"], scores, color=["grey", "tab:green"])
    right.bar_label(bars, labels=[f"{v:.1f}" for v in scores])
    right.set_title(f"{before['dialogues']} test users, greedy")
    right.set_ylabel("mean final emotion")
    right.set_ylim(0, 100)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("--run-dir", default="runs/quickstart", help="the recipe's default_root_dir")
    parser.add_argument(
        "--eval-turns", type=int, default=None, help="turns per evaluation dialogue (default: recipe)"
    )
    parser.add_argument("--skip-train", action="store_true", help="reuse the run dir's last checkpoint")
    parser.add_argument("--plot", default="docs/learning_curve.png")
    args = parser.parse_args()

    out = REPO / "runs" / "learning_curve"
    out.mkdir(parents=True, exist_ok=True)
    before = evaluate(args.recipe, out / "before.jsonl", None, args.eval_turns)
    train_seconds = None
    if not args.skip_train:
        train_seconds = run([sys.executable, "-m", "rlver.cli", "fit", "--config", args.recipe])
    run_dir = REPO / args.run_dir
    after = evaluate(args.recipe, out / "after.jsonl", run_dir / "checkpoints" / "last.ckpt", args.eval_turns)
    curve = training_curve(run_dir / "tensorboard")
    plot(curve, before, after, REPO / args.plot)

    print()
    print(f"{'':24s}{'before':>10s}{'after':>10s}")
    for key in ("mean_final_emotion", "success", "failure", "mean_turns"):
        print(f"{key:24s}{before[key]:>10.2f}{after[key]:>10.2f}")
    if train_seconds is not None:
        print(f"training wall time: {train_seconds / 60:.1f} min")
    first, last = curve[: len(curve) // 4], curve[-(len(curve) // 4) :]
    if first and last:
        mean = lambda xs: sum(v for _, v in xs) / len(xs)  # noqa: E731
        print(
            f"training reward, first quarter {mean(first):.2f} -> last quarter {mean(last):.2f} "
            f"(mean final emotion of the sampled dialogues)"
        )
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
