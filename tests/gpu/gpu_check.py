"""GPU check: the paper recipes' numerics and memory, on random models of the real architectures.

For two model shapes (Qwen2.5-0.5B-Instruct whole, Qwen2.5-7B-Instruct with 4 of its 28 layers:
the real hidden size and vocabulary) and both algorithms (PPO with critic + GAE, GRPO), it runs
one step of the real `python -m rlver.cli fit` with a config made from recipes/ppo_think.yaml and
grpo_think.yaml, changing only the model, devices, steps, rollout lengths, data, batch size,
checkpoint callback and simulator (the embedded user, `judge: rubric`: no network). So the step
runs at the recipes' numerics: FSDP FULL_SHARD on one GPU, `precision: bf16-mixed` over float32
master weights, actor lr 1e-6, critic lr 5e-6, gradient checkpointing, micro-batches of 2, and
the `hf` engine. The weights are random, the tokenizer a word-level one built here (benchmarks/
gpu_check_parts.py): nothing is downloaded, no model needs to be on the machine.

A probe callback in the run (gpu_check_parts.PhaseProbe) records what the table shows:

- changed: the fraction of the policy's trained weights (those with a nonzero gradient) that
  the first lr 1e-6 step changed: about 1.0 with float32 masters, about 0.02 with bf16 ones (in
  the GRPO run each dialogue's reward gets its position in the batch added, so the group's
  rewards never tie and the step follows nonzero advantages, not the entropy term alone);
- inv_freq: the RoPE buffer's dtype after the step's forwards (float32: rlver keeps FSDP buffers
  float32);
- gap: max |engine - trainer| log-prob of the sampled tokens, per position bucket;
- GiB per phase: peak torch.cuda.max_memory_allocated of rollout, scoring, update, sync and
  checkpoint (reset at each phase's start), next to `rlver plan`'s prediction for the same config
  and GPU (rlver.plan.memory_plan), as "measured / planned".

Then, where `import vllm` works on CUDA, a vLLM check over the 0.5B folder: greedy generation,
sleep (level 2), wake (weights, then KV cache), generation, a streamed weight sync, generation;
outputs must be identical. Elsewhere one line says it was skipped.

    python3 tests/gpu/gpu_check.py --out gpu_check.md   # one CUDA GPU; runs sized by `run_seconds`
    .venv/bin/python tests/gpu/gpu_check.py --device cpu --smoke   # tiny shapes, CPU, 32-true, ~35 s

Exits 1 when a check fails (changed < 0.9, an inv_freq not float32, a run failing); the table
still shows what was measured. tools/gpu_bundle.sh prepares the wheels a machine without
rlver's dependencies needs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RECIPES = {"ppo": REPO / "recipes" / "ppo_think.yaml", "grpo": REPO / "recipes" / "grpo_think.yaml"}
PHASES = ("rollout", "scoring", "update", "sync", "checkpoint")
GAP_BUCKETS = ("0-511", "512-2047", "2048+")
MIN_CHANGED = 0.9
CHECKPOINT_BYTES_PER_PARAMETER = 12  # float32 weights + AdamW's two states
# Sizes from the first GPU run (docs/gpu.md, one H200): the hf engine is host-bound, about 68 ms a
# decode step for 4 rows of the 0.5B model; the 0.5B GRPO step at 256-token replies took 37.3 s
# (rollout 34.9, update 2.2, checkpoint 13.4 of it) and a fit's start (imports, model, FSDP) the rest.
DECODE_STEP_SECONDS = 0.068
STEP_SECONDS_BESIDES_ROLLOUT = 16.0  # scoring, update and checkpoint of the 0.5B GRPO step
FIT_START_SECONDS = 45.0  # estimate: process start, imports, model load and FSDP wrap
DEFAULT_REPLY_TOKENS = 256


@dataclass(frozen=True)
class Shape:
    """A model shape: a shipped architecture with some of its sizes changed."""

    label: str
    architecture: str
    overrides: dict = field(default_factory=dict)


GPU_SHAPES = (
    Shape("Qwen2.5-0.5B (24 layers)", "Qwen2.5-0.5B-Instruct"),
    Shape("Qwen2.5-7B (4 of 28 layers)", "Qwen2.5-7B-Instruct", {"num_hidden_layers": 4}),
)
# Smoke shapes: the same architectures at toy sizes, a 512-word vocabulary.
_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 512,
}
SMOKE_SHAPES = (
    Shape("tiny Qwen2.5-0.5B-like (2 layers)", "Qwen2.5-0.5B-Instruct", {**_TINY, "num_hidden_layers": 2}),
    Shape("tiny Qwen2.5-7B-like (1 layer)", "Qwen2.5-7B-Instruct", {**_TINY, "num_hidden_layers": 1}),
)


# --------------------------------------------------------------------------- configs
def run_config(
    algorithm: str, model: Path, root: Path, *, smoke: bool, checkpoint: bool, steps: int, reply_tokens: int
) -> dict:
    """The recipe as `rlver fit` reads it, with only what a one-GPU check must change."""
    config = yaml.safe_load(RECIPES[algorithm].read_text())
    trainer, model_section, data = config["trainer"], config["model"], config["data"]
    trainer.update(devices=1, num_nodes=1, max_steps=steps, limit_val_batches=0, enable_progress_bar=False)
    trainer["default_root_dir"] = str(root)
    if smoke:  # FSDP on CPU (gloo) at 32-true: a smoke test of the script, not of the numerics
        trainer.update(accelerator="cpu", precision="32-true")
        trainer["strategy"]["class_path"] = "rlver.parallel.sharding.AnyDeviceFSDPStrategy"
    checkpoints = []
    if checkpoint:
        checkpoints.append(
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {
                    "dirpath": str(root / "checkpoints"),
                    "save_last": True,
                    "save_top_k": 0,
                    "every_n_train_steps": steps,
                },
            }
        )
    else:
        trainer["enable_checkpointing"] = False
    # GRPO: rewards that differ inside the group, so the update has nonzero advantages to follow.
    probe_args = {"out": str(root / "probe.json"), "tie_break": algorithm == "grpo"}
    probe = {"class_path": "gpu_check_parts.PhaseProbe", "init_args": probe_args}
    trainer["callbacks"] = [*checkpoints, probe]
    model_section["policy"] = str(model)
    model_section["engine"] = {"name": "hf", "batch_size": 16}
    model_section["simulator"] = {"name": "embedded", "judge": "rubric"}
    rollout = model_section["rollout"]
    if smoke:
        rollout.update(max_turns=2, max_new_tokens=8, max_context_tokens=128)
    else:  # two turns of reply_tokens (1024: the second turn's sequence passes position 2048)
        rollout.update(max_turns=2, max_new_tokens=reply_tokens, max_context_tokens=3 * reply_tokens)
    data["train_files"] = ["builtin:en_train"]
    data["val_files"] = data["test_files"] = ["builtin:en_test"]
    # PPO: 2 dialogues (4 sequences, 2 micro-batches); GRPO: one group of 4.
    data.pop("profiles_per_step", None)  # one GPU: the step's profiles, not the paper's 32
    data["batch_size"] = 2 if algorithm == "ppo" else 1
    return config


def checkpoint_gib(shape_config: dict, algorithm: str) -> float:
    """What one checkpoint of the run writes: policy (+ critic) weights and AdamW states, float32."""
    from rlver.plan.architectures import Architecture

    arch = Architecture.from_config(shape_config, name="check", source="check")
    parameters = arch.parameter_count() + (arch.critic_parameter_count() if algorithm == "ppo" else 0)
    return parameters * CHECKPOINT_BYTES_PER_PARAMETER / 2**30


# --------------------------------------------------------------------------- subprocesses
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(smoke: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if smoke:  # on a shared CPU, spinning OpenMP threads slow small models several times
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_logged(cmd: list[str], log: Path, timeout: float, smoke: bool) -> tuple[int | None, float]:
    """Run `cmd` into `log`; kill its process group at the timeout. (exit code or None, seconds)."""
    started = time.perf_counter()
    with log.open("w") as handle:
        process = subprocess.Popen(
            cmd,
            cwd=log.parent,
            env=child_env(smoke),
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = process.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    return code, time.perf_counter() - started


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def build_worker(spec: Path) -> int:
    """In its own process (so the parent never holds a CUDA context): one random model folder."""
    import torch
    from gpu_check_parts import build_model_folder

    job = json.loads(spec.read_text())
    device = "cuda" if torch.cuda.is_available() and not job["smoke"] else "cpu"
    build_model_folder(Path(job["folder"]), job["config"], device)
    return 0


# --------------------------------------------------------------------------- one run
def plan_for(config_path: Path, gpu_memory_gib: float) -> dict[str, float]:
    """`rlver plan`'s GiB per phase for the config, on a GPU of `gpu_memory_gib`."""
    import warnings

    from rlver.cli import parse_recipe
    from rlver.plan.memory_plan import plan_recipe

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        config = parse_recipe(str(config_path))
    _, _, phases = plan_recipe(config, gpu_memory_gib=gpu_memory_gib)
    return {phase.name: phase.total / 2**30 for phase in phases}


def check_run(record: dict | None, code: int | None, seconds: float, log: Path) -> tuple[dict, list[str]]:
    """The table's cells for one run, and what failed."""
    failures: list[str] = []
    if code != 0 or record is None or "weights" not in record:
        why = "timed out" if code is None else f"exit {code}"
        failures.append(f"run failed ({why} after {seconds:.0f} s; log {log}):\n\n```\n{tail(log)}\n```")
    record = record or {}
    weights = record.get("weights") or {}
    denominator = weights.get("with_gradient") or weights.get("trained")
    numerator = (
        weights.get("changed_with_gradient") if weights.get("with_gradient") else weights.get("changed")
    )
    changed = numerator / denominator if denominator else None
    if weights and (changed is None or changed < MIN_CHANGED):
        failures.append(f"changed {changed} < {MIN_CHANGED} of the trained weights")
    dtypes = record.get("inv_freq_dtypes")
    if weights and dtypes != ["torch.float32"]:
        failures.append(f"inv_freq dtype {dtypes}, not torch.float32")
    return {"changed": changed, "inv_freq": dtypes, "weights": weights}, failures


# --------------------------------------------------------------------------- the table
def fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if value != 0 and abs(value) < 10 ** (-digits):
        return f"{value:.1e}"
    return f"{value:.{digits}f}"


HEADER = [
    "shape",
    "algorithm",
    "run",
    "changed",
    "inv_freq",
    "longest",
    *(f"gap {bucket}" for bucket in GAP_BUCKETS),
    "resident GiB",
    *(f"{phase} GiB" for phase in PHASES),
]


def table_row(shape: str, algorithm: str, cells: dict, record: dict, plan: dict, failed: bool) -> list[str]:
    gaps = record.get("logprob_gap") or {}
    phases = record.get("phases") or {}

    def memory(measured: float | None, planned: float | None) -> str:
        if measured is None and planned is None:
            return "-"
        return f"{fmt(measured, 1)} / {fmt(planned, 1)}"

    def phase_cell(phase: str) -> str:
        if phase == "checkpoint" and phase not in phases and record.get("checkpoint_skipped"):
            return f"not written ({record['checkpoint_skipped']})"
        return memory(phases.get(phase, {}).get("peak_gib"), plan.get(phase))

    dtypes = cells["inv_freq"]
    return [
        shape,
        algorithm.upper(),
        "FAILED" if failed else "ok",
        fmt(cells["changed"], 3),
        ", ".join(d.replace("torch.", "") for d in dtypes) if dtypes else "-",
        str(record.get("sequence_tokens", "-")),
        *(fmt((gaps.get(bucket) or {}).get("max"), 4) for bucket in GAP_BUCKETS),
        memory(record.get("resident_gib"), plan.get("trainer resident")),
        *(phase_cell(phase) for phase in PHASES),
    ]


LEGEND = (
    "changed: fraction of the policy's trained weights with a nonzero gradient that the first lr 1e-6 "
    "step changed (>= 0.9 required). longest: tokens of the longest trained sequence. gap: max |engine - "
    "trainer| log-prob of the sampled tokens at those positions of the sequence. GiB: peak "
    "torch.cuda.max_memory_allocated in the phase (reset at its start) / `rlver plan`'s prediction (which "
    "adds 1 GiB of CUDA context and pads micro-batches to max_context_tokens); resident: allocated after "
    "the step; '-' where not measured or not planned (the hf engine has no sync)."
)


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join(" --- " for _ in HEADER) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--smoke", action="store_true", help="Tiny shapes, 8-token replies, 32-true (the only way on CPU)."
    )
    parser.add_argument("--out", type=Path, default=Path("gpu_check.md"), help="Markdown report to write.")
    parser.add_argument("--workdir", type=Path, default=None, help="Models, configs, logs (default: temp).")
    parser.add_argument("--steps", type=int, default=1, help="Training steps per run (default 1).")
    parser.add_argument("--runs", default="ppo,grpo", help="Comma-separated: ppo, grpo.")
    parser.add_argument(
        "--max-checkpoint-gib",
        type=float,
        default=16.0,
        help="Write the checkpoint (and measure it) only for runs whose weights + AdamW states are "
        "at most this many GiB (default 16: the 0.5B runs; the 7B-shaped ones write 24 and 42).",
    )
    parser.add_argument(
        "--reply-tokens",
        type=int,
        default=DEFAULT_REPLY_TOKENS,
        help=f"Tokens per reply, 2 turns (default {DEFAULT_REPLY_TOKENS}: what the hf engine generates "
        "in the run timeout on a GPU, docs/gpu.md; 1024 reaches position 2048 at about 140 s of rollout).",
    )
    parser.add_argument("--budget", type=float, default=None, help="Seconds for everything (default 450).")
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=None,
        help="Seconds for one fit (default: sized from the reply length, `run_seconds`, with a 1.5x margin).",
    )
    parser.add_argument(
        "--jobs", type=int, default=None, help="Runs at a time (default: 1 on CUDA, 2 in the CPU smoke run)."
    )
    parser.add_argument("--keep", action="store_true", help="Keep the work dir (default: removed if temp).")
    parser.add_argument("--vllm-worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--build-worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cpu" and not args.smoke and args.vllm_worker is None and args.build_worker is None:
        parser.error("--device cpu needs --smoke (the recipes' bf16-mixed numerics need a GPU)")
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or any(r not in RECIPES for r in runs):
        parser.error(f"--runs ({args.runs!r}) must list ppo and/or grpo")
    args.runs = runs
    if args.steps < 1:
        parser.error(f"--steps ({args.steps}) must be >= 1")
    if args.jobs is None:
        args.jobs = 2 if args.smoke else 1
    if args.jobs < 1 or (args.jobs > 1 and args.device == "cuda"):
        parser.error(f"--jobs ({args.jobs}) must be 1 on CUDA (each run measures the whole GPU), >= 1 on CPU")
    if args.budget is None:
        args.budget = 120.0 if args.smoke else 450.0
    if args.run_timeout is None:
        args.run_timeout = 180.0 if args.smoke else 1.5 * run_seconds(args.reply_tokens, args.steps)
    return args


def run_seconds(reply_tokens: int, steps: int) -> float:
    """What one fit takes on a GPU with the hf engine, from the first GPU run's figures: its
    start, then per step two turns of `reply_tokens` decode steps and the rest of the step."""
    return FIT_START_SECONDS + steps * (2 * reply_tokens * DECODE_STEP_SECONDS + STEP_SECONDS_BESIDES_ROLLOUT)


def not_checked(args: argparse.Namespace, runs: int) -> list[str]:
    """What this check, as configured, cannot show: said in its report, not left to be assumed."""
    lines = []
    if not args.smoke:
        import torch

        gpus = torch.cuda.device_count()
        lines.append(
            f"- not checked: sharding. FSDP FULL_SHARD at world size 1 runs NO_SHARD (torch switches it), "
            f"so no all-gather, reduce-scatter or gathered optimizer state was exercised ({gpus} GPU(s) here)"
        )
        longest = 3 * args.reply_tokens
        if longest < 2048:
            lines.append(
                f"- not checked: positions beyond {longest} (replies of {args.reply_tokens} tokens); "
                "the log-prob gap past 2048 needs --reply-tokens 1024 and about "
                f"{run_seconds(1024, args.steps):.0f} s a run"
            )
        planned = runs * run_seconds(args.reply_tokens, args.steps)
        if planned > args.budget:
            lines.append(
                f"- budget: {runs} runs need about {planned:.0f} s by docs/gpu.md's figures, more than "
                f"--budget {args.budget:.0f}: the last ones may not run"
            )
    return lines


@dataclass
class Run:
    """One `rlver fit` of the check: a shape, an algorithm, its folder and config."""

    shape: Shape
    algorithm: str
    root: Path
    checkpoint_gib: float
    writes_checkpoint: bool
    code: int | None = None
    seconds: float = 0.0

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def log(self) -> Path:
        return self.root / "fit.log"

    @property
    def name(self) -> str:
        return f"{self.shape.label}, {self.algorithm.upper()}"


def build_models(args: argparse.Namespace, workdir: Path, remaining) -> tuple[list, list[str]]:
    """(shape, its config dict, model folder) for each shape that built, and the failures."""
    from gpu_check_parts import architecture_config

    built, failures = [], []
    for shape in SMOKE_SHAPES if args.smoke else GPU_SHAPES:
        shape_config = architecture_config(shape.architecture, **shape.overrides)
        folder = workdir / shape.architecture
        spec = workdir / f"{shape.architecture}.build.json"
        spec.write_text(json.dumps({"folder": str(folder), "config": shape_config, "smoke": args.smoke}))
        log = workdir / f"{shape.architecture}.build.log"
        print(f"gpu_check: building random {shape.label}", flush=True)
        if args.smoke:  # tiny and on the CPU: no process of its own needed
            code = build_worker(spec)
        else:  # on the GPU, in a process of its own: this one never holds a CUDA context
            cmd = [sys.executable, str(Path(__file__).resolve()), "--build-worker", str(spec)]
            code, _ = run_logged(cmd, log, remaining(), args.smoke)
        if code == 0:
            built.append((shape, shape_config, folder))
        else:
            failures.append(f"{shape.label}: building the model failed (log {log}):\n\n```\n{tail(log)}\n```")
    return built, failures


def prepare_runs(args: argparse.Namespace, workdir: Path, built: list) -> list[Run]:
    runs = []
    for shape, shape_config, folder in built:
        for algorithm in args.runs:
            size = checkpoint_gib(shape_config, algorithm)
            run = Run(
                shape,
                algorithm,
                workdir / f"{shape.architecture}-{algorithm}",
                size,
                size <= args.max_checkpoint_gib,
            )
            run.root.mkdir(parents=True, exist_ok=True)
            config = run_config(
                algorithm,
                folder,
                run.root,
                smoke=args.smoke,
                checkpoint=run.writes_checkpoint,
                steps=args.steps,
                reply_tokens=args.reply_tokens,
            )
            run.config.write_text(yaml.safe_dump(config, sort_keys=False))
            runs.append(run)
    return runs


def report_run(run: Run) -> tuple[list[str], list[str], str | None]:
    """The run's table row, its failures, and a note where it measured more than the plan."""
    probe = run.root / "probe.json"
    record = json.loads(probe.read_text()) if probe.exists() else None
    cells, failed = check_run(record, run.code, run.seconds, run.log)
    record = record or {}
    if not run.writes_checkpoint:
        record["checkpoint_skipped"] = f"{run.checkpoint_gib:.0f} GiB > --max-checkpoint-gib"
    plan = plan_for(run.config, record.get("gpu_memory_gib", 80.0))
    row = table_row(run.shape.label, run.algorithm, cells, record, plan, bool(failed))
    measured = {phase: (record.get("phases", {}).get(phase) or {}).get("peak_gib") for phase in PHASES}
    over = [
        phase for phase, gib in measured.items() if gib is not None and gib > plan.get(phase, float("inf"))
    ]
    note = f"- {run.name}: measured above the plan in {', '.join(over)}" if over else None
    return row, [f"{run.name}: {why}" for why in failed], note


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.build_worker is not None:
        return build_worker(args.build_worker)
    if args.vllm_worker is not None:
        from gpu_check_parts import vllm_worker

        return vllm_worker(args.model, args.vllm_worker)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: CUDA is not available (torch {torch.__version__}); run it on a CUDA GPU, or "
            "`--device cpu --smoke` for the CPU smoke run",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    temporary = args.workdir is None
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="rlver-gpu-check-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check: {args.device}{' smoke' if args.smoke else ''}, work dir {workdir}", flush=True)

    def remaining() -> float:
        return args.budget - (time.perf_counter() - started)

    built, failures = build_models(args, workdir, remaining)
    runs = prepare_runs(args, workdir, built)

    def fit(run: Run) -> None:
        print(f"gpu_check: {run.name} (log {run.log})", flush=True)
        cmd = [sys.executable, "-m", "rlver.cli", "fit", "--config", str(run.config)]
        # A hung run (a collective that never returns) must leave time for the others.
        run.code, run.seconds = run_logged(cmd, run.log, min(remaining(), args.run_timeout), args.smoke)
        shutil.rmtree(run.root / "checkpoints", ignore_errors=True)  # 6 to 12 GiB each on the GPU

    # On a GPU one at a time (each measures the whole device); the CPU smoke run overlaps them.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(fit, runs))
    rows, notes = [], []
    for run in runs:
        row, failed, note = report_run(run)
        rows.append(row)
        failures += failed
        notes += [note] if note else []

    if args.smoke:
        vllm_line, vllm_ok = "- vLLM check: skipped (smoke run: sleep/wake need a GPU)", True
    elif built:
        from gpu_check_parts import vllm_check

        vllm_line, vllm_ok = vllm_check(built[0][2], workdir, min(180.0, remaining()), run_logged)
    else:
        vllm_line, vllm_ok = "- vLLM check: skipped (no model was built)", True
    if not vllm_ok:
        failures.append("vLLM check")
    print(vllm_line.splitlines()[0], flush=True)

    notes += not_checked(args, len(runs))
    if args.smoke:
        setup = (
            "SMOKE RUN on CPU: tiny shapes, 8-token replies, precision 32-true (allowed in smoke mode only: "
            "not the recipes' bf16-mixed numerics), FSDP over gloo, no GPU memory measured"
        )
    else:
        setup = (
            f"{torch.cuda.get_device_name(0)}: FSDP FULL_SHARD on 1 GPU, bf16-mixed over float32 master "
            f"weights, the hf engine, 2 turns of {args.reply_tokens} tokens, {args.steps} step(s)"
        )
    report = "\n\n".join(
        filter(
            None,
            [
                "## rlver GPU check",
                setup,
                markdown_table(rows) if rows else "(no run finished)",
                LEGEND,
                "\n".join(notes),
                vllm_line,
                "\n\n".join(f"- FAILED: {failure}" for failure in failures),
                f"Total {time.perf_counter() - started:.0f} s.",
            ],
        )
    )
    print("\n" + report)
    args.out.write_text(report + "\n")
    print(f"\ngpu_check: wrote {args.out}")
    if temporary and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    if failures:
        print(f"gpu_check: FAILED ({len(failures)} check(s))", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
