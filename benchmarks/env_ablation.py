"""The paper's environment ablation at laptop scale: train against a normal or a hard user,
then evaluate both policies (and the untrained one) against normal and hard test users.

    .venv/bin/python benchmarks/env_ablation.py                 # trains both (about 20 min on 2 cores)
    .venv/bin/python benchmarks/env_ablation.py --skip-train \\
        --normal-ckpt runs/quickstart/checkpoints/last.ckpt \\
        --hard-ckpt runs/quickstart_hard/checkpoints/last.ckpt \\
        --policy "curriculum=runs/curriculum/checkpoints/last.ckpt"

Evaluation: greedy, the 16 English test users, the quickstart's rollout settings, with the
user's difficulty set per run. Prints a Markdown table for docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rlver(*args: str) -> None:
    print("$ rlver", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "rlver.cli", *args], check=True, cwd=REPO)


def evaluate(ckpt: str | None, difficulty: str, out: Path) -> dict[str, float]:
    args = [
        "rollout",
        "--config",
        "recipes/quickstart.yaml",
        "--split",
        "test",
        "--model.rollout.temperature",
        "0",
        "--model.simulator",
        json.dumps({"name": "embedded", "difficulty": difficulty}),
        "--out",
        str(out),
    ]
    if ckpt:
        args += ["--ckpt", ckpt]
    rlver(*args)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    finals = [r["final_emotion"] for r in records]
    gains = [r["final_emotion"] - r["start_emotion"] for r in records]
    return {"final": sum(finals) / len(finals), "gain": sum(gains) / len(gains)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--normal-ckpt", default="runs/quickstart/checkpoints/last.ckpt")
    parser.add_argument("--hard-ckpt", default="runs/quickstart_hard/checkpoints/last.ckpt")
    parser.add_argument(
        "--policy", action="append", default=[], metavar="LABEL=CKPT", help="evaluate another checkpoint too"
    )
    args = parser.parse_args()
    if not args.skip_train:
        rlver("fit", "--config", "recipes/quickstart.yaml")
        rlver("fit", "--config", "recipes/quickstart_hard.yaml")
    policies = {"untrained": None, "trained on normal": args.normal_ckpt, "trained on hard": args.hard_ckpt}
    policies.update(dict(item.split("=", 1) for item in args.policy))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for label, ckpt in policies.items():
            scores = {
                level: evaluate(ckpt, level, Path(folder) / f"{label}_{level}.jsonl")
                for level in ("normal", "hard")
            }
            rows.append((label, scores))
    print("\n| policy | normal users: final (gain) | hard users: final (gain) |")
    print("| --- | --- | --- |")
    for label, scores in rows:
        cells = [
            f"{scores[level]['final']:.1f} ({scores[level]['gain']:+.1f})" for level in ("normal", "hard")
        ]
        print(f"| {label} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
