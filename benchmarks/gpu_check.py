"""GPU check: vLLM sleep/wake on CUDA, then 3 PPO and 3 GRPO steps through the real `rlver fit`.

On one CUDA GPU (sized for an H200, about 4-6 minutes in all):

1. vLLM alone: VLLMEngine over a Policy, greedy generation, sleep, wake, generation again,
   a weight sync, generation a third time; each timed, with the free GPU memory around the
   sleep, and the greedy outputs must be identical each time.
2. `python -m rlver.cli fit` with a generated config, once with PPO (critic + GAE) and once with
   GRPO: FSDP (FULL_SHARD) on 1 GPU, bf16-mixed, the vllm engine colocated with
   sleep_between_rollouts (weights pushed in after every update), the embedded user (no LLM).

It prints one Markdown table (per run and step: generate / update / weight-sync / step seconds
from the TensorBoard scalars the trainer logs, the peak GPU memory sampled with nvidia-smi
during the step, rollout/logprob_gap) and the vLLM check's results, and writes them to --out.

The policy: --model, else $RLVER_GPU_CHECK_MODEL, else Qwen/Qwen2.5-0.5B-Instruct if it is in
the local Hugging Face cache, else the embedded smollm2-135m-instruct. Nothing is downloaded.

    .venv/bin/python benchmarks/gpu_check.py [--out gpu_check.md] [--steps 3]
    .venv/bin/python benchmarks/gpu_check.py --dry-run            # write the configs, print the commands
    .venv/bin/python benchmarks/gpu_check.py --device cpu --steps 1  # CPU smoke run: hf engine, 32-true

Exits 1 when a run fails or a check does not hold (the table still shows what was measured).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QWEN = "Qwen/Qwen2.5-0.5B-Instruct"
EMBEDDED = "smollm2-135m-instruct"
MODEL_ENV = "RLVER_GPU_CHECK_MODEL"
# TensorBoard scalar -> table column (names from RLVERModule.training_step).
COLUMNS = {
    "perf/generate_seconds": "generate s",
    "perf/update_seconds": "update s",
    "perf/weight_sync_seconds": "sync s",
    "perf/step_seconds": "step s",
}
GAP = "rollout/logprob_gap"
VLLM_PROMPTS = [
    "I failed my driving test for the third time today and I feel like an idiot.",
    "My best friend forgot my birthday. Am I overreacting?",
    "Work has been crushing me and I can't sleep. Any advice?",
    "我最近和家人吵架了，心里很难受。",
]


# --------------------------------------------------------------------------- configs
def find_model(requested: str | None) -> str:
    """The policy to train: a path or name given, a cached Qwen2.5-0.5B-Instruct, or the embedded one."""
    if requested:
        return requested
    if os.environ.get(MODEL_ENV):
        return os.environ[MODEL_ENV]
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(QWEN, local_files_only=True)
    except Exception:  # not cached (or huggingface_hub missing): the embedded model
        return EMBEDDED


def run_settings(algorithm: str, device: str, steps: int) -> dict:
    """Sizes per algorithm and device: a few dialogues per step, short replies."""
    gpu = device == "cuda"
    if algorithm == "ppo":
        advantage, group_size, batch_size = "{name: gae, gamma: 1.0, lam: 1.0}", 1, 8 if gpu else 2
    else:
        advantage, group_size, batch_size = "grpo", 4 if gpu else 2, 2 if gpu else 1
    return {
        "advantage": advantage,
        "group_size": group_size,
        "batch_size": batch_size,
        "max_turns": 2,
        "max_new_tokens": 64 if gpu else 12,
        "steps": steps,
    }


def write_config(folder: Path, algorithm: str, device: str, model: str, steps: int, dtype: str) -> Path:
    """A minimal `rlver fit` config: the GPU recipe's trainer (FSDP, bf16-mixed) and vllm with
    sleep/wake on CUDA; on CPU the test suite's (32-true, hf engine)."""
    root = folder / algorithm
    s = run_settings(algorithm, device, steps)
    if device == "cuda":
        trainer = textwrap.dedent("""\
            accelerator: gpu
            devices: 1
            precision: bf16-mixed
            strategy:
              class_path: lightning.pytorch.strategies.FSDPStrategy
              init_args: {sharding_strategy: FULL_SHARD, state_dict_type: sharded}""")
        engine = (
            "{name: vllm, gpu_memory_utilization: 0.3, sleep_between_rollouts: true, max_model_len: 4096}"
        )
    else:
        trainer = "accelerator: cpu\ndevices: 1\nprecision: 32-true"
        engine = "{name: hf, batch_size: 16}"
    text = f"""\
seed_everything: 0
trainer:
{textwrap.indent(trainer, "  ")}
  max_steps: {steps}
  limit_val_batches: 0
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  enable_progress_bar: false
  default_root_dir: {root}
  logger:
    class_path: lightning.pytorch.loggers.TensorBoardLogger
    init_args: {{save_dir: {root}, name: tb, version: ""}}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: {root}/checkpoints, save_last: true, save_top_k: 0, every_n_train_steps: {steps}}}
model:
  policy: {json.dumps(model)}
  dtype: {dtype}
  engine: {engine}
  simulator: {{name: embedded, difficulty: normal}}
  prompt_format: {{name: nothink, language: en}}
  advantage: {s["advantage"]}
  group_size: {s["group_size"]}
  rewards: [final_emotion]
  rollout: {{max_turns: {s["max_turns"]}, max_new_tokens: {s["max_new_tokens"]}, temperature: 1.0, seed: 0}}
  ppo: {{micro_batch_size: 4}}
  actor_lr: 1.0e-6
  critic_lr: 5.0e-6
  actor_warmup_ratio: 0.0
  critic_warmup_ratio: 0.0
  log_samples_every_n_steps: 0
data:
  train_files: [builtin:en_train]
  val_files: [builtin:en_test]
  test_files: [builtin:en_test]
  batch_size: {s["batch_size"]}
"""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / f"{algorithm}.yaml"
    config.write_text(text)
    return config


# --------------------------------------------------------------------------- running
def child_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    if device == "cpu":
        # The smoke run: on a shared CPU, torch's spinning OpenMP threads slow generation ~8x.
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_logged(cmd: list[str], log: Path, timeout: float, device: str) -> tuple[int | None, float]:
    """Run `cmd` from the repo root into `log`; kill its whole process group at the timeout.
    Returns (exit code or None on timeout, seconds)."""
    started = time.perf_counter()
    with log.open("w") as handle:
        process = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=child_env(device),
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


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class GpuMemorySampler:
    """Device memory in use (MiB, all processes), sampled in a background thread with nvidia-smi."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (unix time, MiB)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        self.command = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        self.command += ["-i", visible or "0"]
        self.available = shutil.which("nvidia-smi") is not None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuMemorySampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(self.command, capture_output=True, text=True, timeout=5).stdout
                self.samples.append((time.time(), float(out.strip().splitlines()[0])))
            except (subprocess.SubprocessError, ValueError, IndexError, OSError):
                pass
            self._stop.wait(self.interval)

    def peak_gib(self, start: float, end: float) -> float | None:
        window = [mib for t, mib in self.samples if start <= t <= end]
        return max(window) / 1024 if window else None


def read_scalars(folder: Path) -> dict[str, dict[int, tuple[float, float]]]:
    """tag -> step -> (wall time, value) from the TensorBoard event files under `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not folder.exists():
        return {}
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {
        tag: {e.step: (e.wall_time, e.value) for e in accumulator.Scalars(tag)}
        for tag in accumulator.Tags()["scalars"]
    }


def fit_rows(name: str, root: Path, sampler: GpuMemorySampler | None) -> list[dict]:
    scalars = read_scalars(root / "tb")
    steps = sorted(scalars.get("perf/step_seconds", {}))
    rows = []
    for step in steps:
        row: dict = {"run": name, "step": step}
        for tag, column in COLUMNS.items():
            row[column] = scalars.get(tag, {}).get(step, (None, None))[1]
        row["logprob_gap"] = scalars.get(GAP, {}).get(step, (None, None))[1]
        logged_at, step_seconds = scalars["perf/step_seconds"][step]
        # The step ran during the step_seconds before its scalars were logged.
        row["peak GPU GiB"] = (
            sampler.peak_gib(logged_at - step_seconds - 0.5, logged_at + 0.5) if sampler else None
        )
        rows.append(row)
    return rows


def fmt(value: object, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 10 ** (-digits) or value == 0 else f"{value:.1e}"
    return str(value)


def markdown_table(rows: list[dict], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for row in rows:
        lines.append(
            "| "
            + " | ".join(fmt(row.get(column), 4 if column == "logprob_gap" else 2) for column in header)
            + " |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- the vLLM-only check
def vllm_worker(model: str, device: str, out: Path) -> int:
    """In its own process: engine start, generate, sleep, wake, generate, sync, generate."""
    import torch
    from rlver_plugins.vllm_engine.engine import VLLMEngine

    from rlver.interfaces import SamplingSettings
    from rlver.models import load_policy

    cuda = device == "cuda"
    result: dict = {"device": device, "model": model}

    def free_gib() -> float | None:
        return torch.cuda.mem_get_info()[0] / 2**30 if cuda else None

    def timed(label: str, function):
        started = time.perf_counter()
        value = function()
        if cuda:
            torch.cuda.synchronize()
        result[f"{label}_s"] = time.perf_counter() - started
        return value

    policy = load_policy(model, dtype="bfloat16" if cuda else "float32", device=device)
    options = {"gpu_memory_utilization": 0.3, "sleep_between_rollouts": True, "max_model_len": 4096}
    if not cuda:
        options.update(dtype="float32", cpu_kv_cache_gib=1, max_model_len=1024)
    engine = timed("engine_start", lambda: VLLMEngine(policy, **options))
    result["sleep_enabled"] = engine.sleep_between_rollouts
    tokenizer = policy.tokenizer
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )["input_ids"]
        for text in VLLM_PROMPTS
    ]
    greedy = SamplingSettings(max_new_tokens=48 if cuda else 16, temperature=0.0)

    def ids(generations) -> list[list[int]]:
        return [list(g.token_ids) for g in generations]

    first = ids(timed("generate_1", lambda: engine.generate(prompts, greedy)))
    result["free_gib_before_sleep"] = free_gib()
    timed("sleep", engine.release_memory)
    result["free_gib_asleep"] = free_gib()
    timed("wake", engine._wake)  # what generate() and sync_weights() call first
    result["free_gib_awake"] = free_gib()
    second = ids(timed("generate_2", lambda: engine.generate(prompts, greedy)))
    engine.release_memory()
    timed("sync_weights", engine.sync_weights)  # wakes, pushes the (unchanged) policy weights
    third = ids(timed("generate_3", lambda: engine.generate(prompts, greedy)))
    result["tokens"] = sum(map(len, first))
    result["identical_after_sleep"] = first == second
    result["identical_after_sync"] = first == third
    result["sample"] = tokenizer.decode(first[0], skip_special_tokens=True)[:120]
    out.write_text(json.dumps(result, indent=2))
    return 0 if result["identical_after_sleep"] and result["identical_after_sync"] else 1


def vllm_report(result: dict | None, error: str | None) -> tuple[str, bool]:
    if result is None:
        return f"- vLLM-only check FAILED: {error}", False
    gib = result.get("free_gib_before_sleep"), result.get("free_gib_asleep"), result.get("free_gib_awake")
    ok = bool(result.get("identical_after_sleep") and result.get("identical_after_sync"))
    memory = (
        f"free GPU memory {fmt(gib[0])} GiB awake -> {fmt(gib[1])} GiB asleep -> {fmt(gib[2])} GiB woken"
        if gib[0] is not None
        else "no GPU: sleep/wake are no-ops"
    )
    lines = [
        f"- vLLM-only check ({result['device']}, {Path(result['model']).name}): {'OK' if ok else 'FAILED'}",
        f"  - engine start {fmt(result['engine_start_s'])} s; "
        f"greedy generate {fmt(result['generate_1_s'])} s "
        f"({result['tokens']} tokens, {len(VLLM_PROMPTS)} prompts); sleep {fmt(result['sleep_s'])} s; "
        f"wake {fmt(result['wake_s'])} s; generate after wake {fmt(result['generate_2_s'])} s; "
        f"weight sync {fmt(result['sync_weights_s'])} s; generate after sync {fmt(result['generate_3_s'])} s",
        f"  - {memory} (sleep mode {'on' if result['sleep_enabled'] else 'off'})",
        f"  - greedy outputs identical after sleep/wake: {result['identical_after_sleep']}; "
        f"after a weight sync: {result['identical_after_sync']}",
    ]
    return "\n".join(lines), ok


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    parser.add_argument(
        "--model",
        default=None,
        help=f"Policy: a local HF folder or name (default: ${MODEL_ENV}, cached {QWEN}, else {EMBEDDED}).",
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda: the GPU check; cpu: a smoke run (hf engine, 32-true, no FSDP).",
    )
    parser.add_argument("--steps", type=int, default=3, help="Training steps per run (PPO and GRPO).")
    parser.add_argument(
        "--dtype", default=None, help="Policy weights (default: float32; bf16-mixed autocasts)."
    )
    parser.add_argument("--out", type=Path, default=Path("gpu_check.md"), help="Markdown report to write.")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="Configs, logs and runs (default: a temp dir)."
    )
    parser.add_argument("--runs", default="ppo,grpo", help="Comma-separated runs: ppo, grpo (default both).")
    parser.add_argument(
        "--vllm-check",
        choices=["auto", "on", "off"],
        default="auto",
        help="The vLLM-only check (auto: on with cuda, off with cpu, where sleep/wake are no-ops).",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="Seconds for all subprocesses together, each killed when it runs out (default: 450 with "
        "cuda, 1500 with cpu).",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="Write the configs, print the commands, run nothing."
    )
    parser.add_argument("--vllm-worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or any(r not in ("ppo", "grpo") for r in runs):
        parser.error(f"--runs ({args.runs!r}) must list ppo and/or grpo")
    args.runs = runs
    if args.budget is None:
        args.budget = 450.0 if args.device == "cuda" else 1500.0
    args.skip_vllm_check = args.vllm_check == "off" or (args.vllm_check == "auto" and args.device == "cpu")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.vllm_worker is not None:
        return vllm_worker(args.model, args.device, args.vllm_worker)

    started = time.perf_counter()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rlver-gpu-check-"))
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model = find_model(args.model)
    if not args.dry_run:
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            print(
                "gpu_check: CUDA is not available here (torch "
                f"{torch.__version__}, CUDA build {torch.version.cuda}); run it on a CUDA GPU with a CUDA "
                "torch and vLLM (`make setup VLLM_EXTRA=vllm`), or `--device cpu` for the CPU smoke run",
                file=sys.stderr,
            )
            return 2
        if args.device == "cuda" and importlib.util.find_spec("vllm") is None:
            print("gpu_check: vLLM is not installed (`make setup VLLM_EXTRA=vllm`)", file=sys.stderr)
            return 2
        if model == EMBEDDED:  # convert the packaged GGUF once, here, not in every run
            from rlver.models import resolve_model_path

            model = resolve_model_path(model)
    dtype = args.dtype or "float32"
    python = sys.executable
    vllm_cmd = [
        python,
        str(Path(__file__).resolve()),
        "--vllm-worker",
        str(workdir / "vllm_check.json"),
        "--model",
        model,
        "--device",
        args.device,
    ]
    fits = {}
    for algorithm in args.runs:
        config = write_config(workdir, algorithm, args.device, model, args.steps, dtype)
        fits[algorithm] = [python, "-m", "rlver.cli", "fit", "--config", str(config)]

    print(
        f"gpu_check: model {model}, device {args.device}, {args.steps} step(s), work dir {workdir}",
        flush=True,
    )
    if args.dry_run:
        for algorithm in args.runs:
            config = workdir / f"{algorithm}.yaml"
            print(f"\n# {algorithm}: {config}\n{config.read_text()}")
        if not args.skip_vllm_check:
            print("(cd", REPO, "&&", " ".join(vllm_cmd) + ")")
        for cmd in fits.values():
            print("(cd", REPO, "&&", " ".join(cmd) + ")")
        return 0

    def remaining() -> float:
        return args.budget - (time.perf_counter() - started)

    failures: list[str] = []
    report_lines: list[str] = []
    rows: list[dict] = []
    sampler = GpuMemorySampler() if args.device == "cuda" else None
    with sampler or nullcontext():
        if args.skip_vllm_check:
            report_lines.append("- vLLM-only check: skipped")
        else:
            log = workdir / "vllm_check.log"
            print(f"gpu_check: vLLM-only check (log {log})", flush=True)
            code, seconds = run_logged(vllm_cmd, log, min(150.0, remaining()), args.device)
            result_file = workdir / "vllm_check.json"
            result = json.loads(result_file.read_text()) if result_file.exists() else None
            error = None
            if code is None:
                error = f"timed out after {seconds:.0f} s; log {log}:\n{tail(log)}"
            elif result is None:
                error = f"exit {code}; log {log}:\n{tail(log)}"
            line, ok = vllm_report(result, error)
            report_lines.append(line)
            if not ok:
                failures.append("vLLM-only check")
        for algorithm, cmd in fits.items():
            log = workdir / f"{algorithm}.log"
            print(f"gpu_check: {algorithm.upper()} fit, {args.steps} step(s) (log {log})", flush=True)
            # On a GPU a hung run (e.g. a collective that never returns) must leave time for the next.
            cap = 240.0 if args.device == "cuda" else args.budget
            run_started = time.time()
            code, seconds = run_logged(cmd, log, min(cap, remaining()), args.device)
            run_peak = sampler.peak_gib(run_started, time.time()) if sampler else None
            got = fit_rows(algorithm.upper(), workdir / algorithm, sampler)
            rows.extend(got)
            status = "timed out" if code is None else f"exit {code}"
            if code != 0 or len(got) != args.steps:
                failures.append(f"{algorithm.upper()} fit")
                report_lines.append(
                    f"- {algorithm.upper()} fit FAILED ({status} after {seconds:.0f} s, "
                    f"{len(got)}/{args.steps} steps logged); log {log}:\n\n```\n{tail(log)}\n```"
                )
            else:
                report_lines.append(
                    f"- {algorithm.upper()} fit: {args.steps} step(s), {seconds:.0f} s wall in all "
                    f"(start-up included), peak GPU memory {fmt(run_peak)} GiB"
                )

    header = ["run", "step", *COLUMNS.values(), "peak GPU GiB", "logprob_gap"]
    setup = (
        "FSDP FULL_SHARD, bf16-mixed, vllm with sleep/wake" if args.device == "cuda" else "hf engine, 32-true"
    )
    title = f"## rlver GPU check: {Path(model).name} on {args.device}, {setup}"
    if args.device == "cuda":
        notes = (
            "sync s includes waking the engine (its weights back on the GPU) before the push; peak GPU "
            "GiB is the most device memory in use (nvidia-smi, all processes) during the step; step 0 "
            "includes first-call warm-up."
        )
    else:
        notes = "CPU smoke run: the hf engine generates with the policy itself (no weight sync, no GPU)."
    report = "\n\n".join(
        [
            title,
            markdown_table(rows, header) if rows else "(no training step was logged)",
            notes,
            "\n".join(report_lines),
            f"Total {time.perf_counter() - started:.0f} s; work dir {workdir}.",
        ]
    )
    print("\n" + report)
    args.out.write_text(report + "\n")
    print(f"\ngpu_check: wrote {args.out}")
    if failures:
        print(f"gpu_check: FAILED: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
