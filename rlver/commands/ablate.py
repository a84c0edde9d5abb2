"""`rlver ablate`: arms x seeds of `rlver fit`, resumable, with per-arm and paired statistics.

    rlver ablate --config BASE.yaml --arm ref= --arm lr="--model.actor_lr 5e-5" --seeds 0 1 2 --out DIR
    rlver ablate --arms recipes/ablations/turn_credit.yaml --out DIR [--parallel 2]
    rlver ablate ... --launcher print      # one `rlver fit` command a line, for a cluster's scheduler
    rlver ablate --collect DIR             # the tables from run folders made anywhere

Each run is an ordinary `rlver fit` (rlver.commands.ablation_runs says which folder and flags);
a finished run is skipped and a killed one resumes from its `last.ckpt`, so the command is rerun
until it is done. The numbers (rlver.evaluate.ablation) go to DIR/results.json, DIR/results.md
and DIR/curves.png.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlver.commands.ablation_runs import (
    DONE_FILE,
    LOG_FILE,
    Arm,
    Plan,
    before_after,
    collect,
    is_finished,
)
from rlver.evaluate.ablation import TRAINING_SIMULATOR, evaluation_matrix, summarize
from rlver.evaluate.ablation_report import markdown, plot_curves

STEP_LINE = re.compile(r"^step (\d+)(?:/(\d+))?\s")


def ablate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlver ablate",
        description="Train arms x seeds with `rlver fit`; tables with paired 95%% intervals.",
    )
    parser.add_argument("--config", help="the base recipe every arm starts from")
    parser.add_argument(
        "--arms",
        metavar="FILE",
        help="a YAML file of {config, arms: {name: spec}, seeds, steps}; flags given here win",
    )
    parser.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="an arm: a recipe file over the base and/or `rlver fit` flags; the first is the reference",
    )
    parser.add_argument("--seeds", type=int, nargs="+", help="training seeds (default 0 1 2)")
    parser.add_argument("--steps", type=int, help="training steps of every run (default: the recipe's)")
    parser.add_argument("--out", type=Path, help="the ablation's folder (default runs/ablations/<name>)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once, the cores shared (default 1)")
    parser.add_argument("--launcher", choices=("local", "print"), default="local")
    parser.add_argument("--collect", type=Path, metavar="DIR", help="only build the tables from DIR's runs")
    parser.add_argument(
        "--drop-checkpoints",
        action="store_true",
        help="delete each finished run's checkpoints/ (its scores stay; a longer rerun starts it afresh);"
        " with --launcher print, each line ends with `&& rm -rf <run>/checkpoints`",
    )
    return parser


def _arms_file(path: str) -> dict[str, Any]:
    import yaml

    if not Path(path).is_file():
        raise ValueError(f"--arms: {path} not found")
    try:
        content = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"--arms: {path}: not YAML ({error})") from None
    if not isinstance(content, dict) or not isinstance(content.get("arms"), dict) or not content["arms"]:
        raise ValueError(f"--arms: {path}: expected a mapping with `arms: {{name: spec, ...}}`")
    unknown = set(content) - {"config", "arms", "seeds", "steps"}
    if unknown:
        raise ValueError(f"--arms: {path}: unknown key(s) {', '.join(sorted(unknown))}")
    return content


def build_plan(args: argparse.Namespace) -> Plan:
    """The arms, seeds, steps and folder from the flags and the arms file; one error per bad input."""
    content = _arms_file(args.arms) if args.arms else {}
    where = f"--arms {args.arms}" if args.arms else "--arm"
    config = args.config or content.get("config")
    if not config:
        raise ValueError("--config: the base recipe is required (or `config:` in the --arms file)")
    if not Path(config).is_file():
        raise ValueError(f"--config: {config} not found")
    arms = [Arm.parse(str(name), str(spec or ""), where) for name, spec in content.get("arms", {}).items()]
    for item in args.arm:
        name, separator, spec = item.partition("=")
        if not separator:
            raise ValueError(f"--arm {item!r}: expected NAME=SPEC (SPEC may be empty: the base as it is)")
        arms.append(Arm.parse(name, spec, "--arm"))
    names = [arm.name for arm in arms]
    if not arms:
        raise ValueError("--arm: at least one arm (NAME=SPEC), or --arms FILE")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"--arm: arm name(s) given twice: {', '.join(duplicates)}")
    seeds = args.seeds if args.seeds is not None else content.get("seeds", [0, 1, 2])
    if not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds ({seeds}) must be distinct integers >= 0")
    steps = args.steps if args.steps is not None else content.get("steps")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"--steps ({steps}) must be an integer >= 1")
    if args.parallel < 1:
        raise ValueError(f"--parallel ({args.parallel}) must be >= 1")
    name = Path(args.arms or config).stem
    out = args.out or Path("runs") / "ablations" / name
    return Plan(config=config, arms=tuple(arms), seeds=tuple(seeds), steps=steps, out=out)


def write_results(out: Path, arms: list[str] | None = None) -> dict[str, Any]:
    """results.json, results.md and curves.png from the finished runs under `out`."""
    arms, runs = collect(out, arms)
    if not runs:
        raise ValueError(
            f"{out}: no finished run (each needs before_after.json with its after-training scores)"
        )
    summary = summarize(runs, arms)
    if any(r.evaluator != TRAINING_SIMULATOR for r in runs):  # BeforeAfter had other evaluators
        summary["evaluation_matrix"] = evaluation_matrix(runs, arms)
    summary["runs"] = [
        {
            "arm": r.arm,
            "seed": r.seed,
            "evaluator": r.evaluator,
            "before": r.before,
            "after": r.after,
            "curve": r.curve,
            "seconds": r.seconds,
        }
        for r in runs
    ]
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "results.md").write_text(markdown(summary, title=f"Ablation: {out.name}"))
    plot_curves(summary, out / "curves.png")
    return summary


class Progress:
    """One line per training step of any run: which run, its step, its ETA and the ablation's."""

    def __init__(self, total: int) -> None:
        self.total, self.started, self.lock = total, time.monotonic(), threading.Lock()
        self.finished_seconds: list[float] = []
        self.remaining = total

    def step(self, label: str, step: int, of: int | None, run_started: float, first_step: int) -> None:
        elapsed = time.monotonic() - run_started
        per_step = elapsed / max(step - first_step, 1)  # start-up included: an ETA errs late, not early
        run_left = (of - step) * per_step if of else 0.0
        with self.lock:
            finished = self.finished_seconds
            typical = sum(finished) / len(finished) if finished else per_step * (of or step)
            left = run_left + (self.remaining - 1) * typical
            total = f"/{of}" if of else ""
            print(
                f"rlver ablate: {label} step {step}{total}, run ETA {run_left / 60:.0f} min, "
                f"all ETA {left / 60:.0f} min",
                flush=True,
            )

    def done(self, seconds: float) -> None:
        with self.lock:
            self.finished_seconds.append(seconds)
            self.remaining -= 1


def core_slots(parallel: int) -> queue.Queue[list[int]]:
    """`parallel` disjoint sets of this process's cores (shared round-robin when there are fewer)."""
    cores = sorted(os.sched_getaffinity(0))
    slots: queue.Queue[list[int]] = queue.Queue()
    for slot in range(parallel):
        slots.put(cores[slot::parallel] or [cores[slot % len(cores)]])
    return slots


def _fit(
    arguments: list[str],
    environment: dict[str, str],
    cores: list[int] | None,
    log_path: Path,
    label: str,
    progress: Progress,
    started: float,
) -> int:
    """`rlver fit` in a child process, its output to `log_path`, a progress line per step; its status."""
    first_step = None
    with log_path.open("a") as log:
        log.write(f"$ rlver {shlex.join(arguments)}\n")
        process = subprocess.Popen(
            [sys.executable, "-m", "rlver.cli", *arguments],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environment,
        )
        if cores is not None:  # set while it is still importing: every thread and rank it starts inherits it
            os.sched_setaffinity(process.pid, cores)
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            log.flush()
            match = STEP_LINE.match(line)
            if match:
                step = int(match.group(1))
                first_step = step - 1 if first_step is None else first_step
                total = int(match.group(2)) if match.group(2) else None
                progress.step(label, step, total, started, first_step)
        return process.wait()


def drop_checkpoints(folder: Path) -> int:
    """Delete a finished run's `checkpoints/` (a 7B policy's float32 weights and AdamW state:
    ~90 GB, twice that with PPO's critic; the laptop quickstart's: 1.5 GB); the bytes freed."""
    checkpoints = folder / "checkpoints"
    if not checkpoints.is_dir():
        return 0
    size = sum(path.stat().st_size for path in checkpoints.rglob("*") if path.is_file())
    shutil.rmtree(checkpoints)
    return size


def run_one(
    plan: Plan,
    arm: Arm,
    seed: int,
    slots: queue.Queue[list[int]] | None,
    progress: Progress,
    index: int,
    drop: bool = False,
) -> str | None:
    """One `rlver fit` (resumed if it left a checkpoint); None if it finished, else why not."""
    folder = plan.folder(arm, seed)
    label = f"[{index}/{progress.total}] {arm.name} seed {seed}:"
    arguments = plan.fit_arguments(arm, seed)
    folder.mkdir(parents=True, exist_ok=True)
    resumed = "--ckpt_path" in arguments[-2:]
    print(
        f"rlver ablate: {label} {'resuming from last.ckpt' if resumed else 'starting'} ({folder})", flush=True
    )
    environment = dict(os.environ)
    cores = slots.get() if slots is not None else None
    if cores is not None:  # K runs share the cores: each its own share, not all of them each
        threads, listed = str(len(cores)), ",".join(map(str, cores))
        environment.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, VLLM_CPU_OMP_THREADS_BIND=listed)
    started = time.monotonic()
    try:
        code = _fit(arguments, environment, cores, folder / LOG_FILE, label, progress, started)
    finally:
        if slots is not None and cores is not None:
            slots.put(cores)
    seconds = time.monotonic() - started
    progress.done(seconds)
    record = before_after(folder)
    problem = None
    if code != 0:
        problem = f"{label} rlver fit {_exit_reason(code)}; see {folder / LOG_FILE} (rerun to resume)"
    elif not record or record.get("after") is None or not is_finished(folder, plan.steps):
        step = record.get("step") if record else "?"
        problem = f"{label} stopped at step {step} (rerun to resume); see {folder / LOG_FILE}"
    if problem is not None:  # said now, not only at the end: the next run starts meanwhile
        print(f"rlver ablate: {problem}", flush=True)
        return problem
    done = {"arm": arm.name, "seed": seed, "seconds": round(seconds, 1), "step": record.get("step")}
    done["command"] = shlex.join(["rlver", *arguments])
    (folder / DONE_FILE).write_text(json.dumps(done, indent=1) + "\n")
    freed = f"; checkpoints deleted ({drop_checkpoints(folder) / 1e9:.1f} GB)" if drop else ""
    print(f"rlver ablate: {label} finished in {seconds / 60:.1f} min{freed}", flush=True)
    return None


def _exit_reason(code: int) -> str:
    """A child's exit status in words: a negative one is the signal that ended it."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = " (the kernel's out-of-memory killer sends it too)" if name == "SIGKILL" else ""
    return f"was killed by {name}{hint}"


def ablate_command(argv: list[str]) -> int:
    args = ablate_parser().parse_args(argv)
    if args.collect is not None:
        if not args.collect.is_dir():
            raise ValueError(f"--collect: {args.collect} is not a folder")
        summary = write_results(args.collect)
        _report(args.collect, summary)
        return 0
    plan = build_plan(args)
    plan.write()
    pending = [(a, s) for a, s in plan.runs() if not is_finished(plan.folder(a, s), plan.steps)]
    if args.launcher == "print":
        for arm, seed in pending:
            line = shlex.join(["rlver", *plan.fit_arguments(arm, seed)])
            if args.drop_checkpoints:  # only after a run that ended well: a failed one resumes from them
                line += " && " + shlex.join(["rm", "-rf", str(plan.folder(arm, seed) / "checkpoints")])
            print(line)
        return 0
    skipped = len(plan.runs()) - len(pending)
    if skipped:
        print(f"rlver ablate: {skipped} run(s) already finished under {plan.out}", flush=True)
    if skipped and args.drop_checkpoints:  # an ablation run before without the flag: tidied now
        finished = [plan.folder(a, s) for a, s in plan.runs() if (a, s) not in pending]
        freed = sum(drop_checkpoints(folder) for folder in finished)
        print(f"rlver ablate: their checkpoints deleted ({freed / 1e9:.1f} GB)", flush=True)
    slots = core_slots(args.parallel) if args.parallel > 1 else None
    progress = Progress(len(pending))
    pool = ThreadPoolExecutor(max_workers=args.parallel)
    jobs = [
        pool.submit(run_one, plan, arm, seed, slots, progress, index, args.drop_checkpoints)
        for index, (arm, seed) in enumerate(pending, start=1)
    ]
    try:
        problems = [problem for job in jobs if (problem := job.result()) is not None]
    except KeyboardInterrupt:  # the runs got it too: each stops with its last.ckpt; start no other
        pool.shutdown(wait=True, cancel_futures=True)
        print("rlver ablate: interrupted; the same command resumes where the runs stopped", file=sys.stderr)
        return 130
    pool.shutdown()
    try:
        summary = write_results(plan.out, [arm.name for arm in plan.arms])
        _report(plan.out, summary)
    except ValueError as error:
        problems.append(str(error))
    for problem in problems:
        print(f"rlver ablate: error: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _report(out: Path, summary: dict[str, Any]) -> None:
    runs = sum(row["runs"] for row in summary["arms"].values())
    files = ", ".join(str(out / name) for name in ("results.md", "results.json", "curves.png"))
    print(f"rlver ablate: {runs} finished run(s); {files}")
    print((out / "results.md").read_text(), flush=True)
