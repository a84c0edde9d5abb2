"""What a training step costs, arm against arm, in the same hour.

A shared VM's speed drifts by tens of percent from one hour to the next (docs/results.md: the
quickstart's native step took 6 s in one hour and 10 s in another), so two step times measured
apart compare the hours, not the settings. This runs each arm's `rlver fit` for a few steps,
alternating the arms (A B, then B A, ...), and reports each run's median step, generation and
update (from its TensorBoard `perf/` scalars, the first step left out: it warms the engine), the
evaluations' times, and every arm's ratio to the first arm within each round. The arms are
`rlver ablate`'s: an arms file, or `--config` with `--arm NAME=FLAGS`.

    .venv/bin/python benchmarks/step_cost.py --arms recipes/ablations/quickstart_three_turns.yaml \
        --steps 8 --rounds 2 --avx2

`--avx2` sets ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 for the runs: this CPU without
its AVX-512 and bf16 kernels, which understates a real AVX2 CPU (about 2.3x slower there on the
quickstart's step; README). Checkpoints of the runs are deleted as each ends.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from rlver.commands.ablate import ablate_parser, build_plan
from rlver.commands.ablation_runs import training_curve

AVX2_FLAGS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
STEP_LINE = re.compile(r"^step (\d+)/\d+ .*\((\d+(?:\.\d+)?) s\)\s*$", re.M)
DONE_LINE = re.compile(r"\.\.\. done in (\d+(?:\.\d+)?) s")


def step_seconds(log: str) -> list[float]:
    """The steps' wall times from `rlver fit`'s console (whole seconds), the first step left out."""
    return [float(seconds) for number, seconds in STEP_LINE.findall(log) if int(number) > 1]


def logged_seconds(run_folder: Path, tag: str) -> list[float]:
    """A `perf/` scalar of every step after the first, from the run's TensorBoard events."""
    values = training_curve(run_folder / "tensorboard", tag)
    return [value for step, value in sorted(values.items()) if step > 0]


def evaluation_seconds(log: str) -> list[float]:
    """The `... done in N s` lines after the model's load: the evaluations before and after."""
    return [float(seconds) for seconds in DONE_LINE.findall(log)[1:]]


def run_order(arms: list[str], rounds: int) -> list[tuple[int, list[str]]]:
    """Each round runs every arm once; every other round reverses the order, so drift cancels."""
    return [(r + 1, arms if r % 2 == 0 else arms[::-1]) for r in range(rounds)]


def ratios(medians: dict[tuple[int, str], float], reference: str) -> dict[str, list[float]]:
    """Each arm's median step over the reference arm's, round by round (same hour)."""
    out: dict[str, list[float]] = {}
    for (round_number, arm), median in sorted(medians.items()):
        base = medians.get((round_number, reference))
        if base:
            out.setdefault(arm, []).append(median / base)
    return out


def table(rows: list[dict], ratio_by_arm: dict[str, list[float]]) -> str:
    lines = [
        "| round | arm | steps timed | median step | generation | update | evaluations | over the first |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        ratio = row["median"] / row["reference_median"] if row["reference_median"] else float("nan")
        evaluations = " / ".join(f"{s:.0f} s" for s in row["evaluations"]) or "-"
        lines.append(
            f"| {row['round']} | {row['arm']} | {row['steps']} | {row['median']:.2f} s"
            f" | {row['generation']:.2f} s | {row['update']:.2f} s | {evaluations} | {ratio:.2f}x |"
        )
    lines.append("")
    for arm, values in ratio_by_arm.items():
        by_round = ", ".join(f"{value:.2f}x" for value in values)
        lines.append(f"{arm}: median step over the first arm's, round by round: {by_round}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int | str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", help="an `rlver ablate` arms file")
    parser.add_argument("--config", help="the base recipe (or `config:` in the arms file)")
    parser.add_argument("--arm", action="append", default=[], help="NAME=FLAGS, as `rlver ablate --arm`")
    parser.add_argument("--steps", type=int, default=8, help="steps a run (default 8: 7 timed)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all arms (default 2: A B, then B A)")
    parser.add_argument("--avx2", action="store_true", help="run with the AVX2 emulation flags")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/step_cost"))
    args = parser.parse_args(argv)
    if args.steps < 2 or args.rounds < 1:
        parser.error(f"--steps ({args.steps}) must be >= 2 and --rounds ({args.rounds}) >= 1")
    ablate_args = ["--arms", args.arms] if args.arms else []
    ablate_args += ["--config", args.config] if args.config else []
    ablate_args += [word for item in args.arm for word in ("--arm", item)]
    try:
        plan = build_plan(ablate_parser().parse_args(ablate_args))
    except ValueError as error:
        parser.error(str(error))
    arms = {arm.name: arm for arm in plan.arms}
    env = {**os.environ, **(AVX2_FLAGS if args.avx2 else {})}
    rlver = str(Path(sys.executable).with_name("rlver"))
    medians: dict[tuple[int, str], float] = {}
    rows = []
    for round_number, order in run_order(list(arms), args.rounds):
        # `rlver ablate`'s own command line at seed 0: the same layering of recipes and flags.
        out = args.out / f"round-{round_number}"
        round_plan = dataclasses.replace(plan, out=out, steps=args.steps, seeds=(0,))
        for name in order:
            arguments = round_plan.fit_arguments(arms[name], 0)
            print(f"round {round_number}, {name}: rlver {' '.join(arguments)}", flush=True)
            done = subprocess.run([rlver, *arguments], env=env, capture_output=True, text=True)
            shutil.rmtree(round_plan.folder(arms[name], 0) / "checkpoints", ignore_errors=True)
            console = done.stdout + done.stderr
            if done.returncode != 0:
                print(console[-3000:], file=sys.stderr)
                return f"round {round_number}, arm {name}: rlver fit exited {done.returncode}"
            folder = round_plan.folder(arms[name], 0)
            steps = logged_seconds(folder, "perf/step_seconds") or step_seconds(console)
            if not steps:
                return f"round {round_number}, arm {name}: no step after the first was timed"
            median = medians[(round_number, name)] = statistics.median(steps)
            row = {"round": round_number, "arm": name, "steps": len(steps), "median": median}
            parts = {part: logged_seconds(folder, f"perf/{part}_seconds") for part in ("generate", "update")}
            row |= {"generation": statistics.median(parts["generate"] or [math.nan])}
            row |= {"update": statistics.median(parts["update"] or [math.nan])}
            rows.append(row | {"evaluations": evaluation_seconds(console)})
    reference = plan.arms[0].name
    for row in rows:
        row["reference_median"] = medians.get((row["round"], reference))
    print(table(rows, ratios(medians, reference)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
