"""Lockstep vs dialogue-level vs overlapped rollouts against an LLM-played user with latency.

Each mode trains the tiny model (2-layer Llama, SmolLM2's tokenizer) with `rlver fit` for a
few GRPO steps of 32 dialogues x 8 turns (8 profiles x group 4) against the `sage` user behind
the scripted SAGE-format server on 127.0.0.1, which answers each request (two a turn: planning,
reply) after a latency drawn per request:

    fixed       2 s
    uniform     1-5 s
    lognormal   median 2.5 s, sigma 0.6
    retried     lognormal, and 5% of requests fail (HTTP 500) and are retried once

Modes: `lockstep` (every turn waits for all generations, then all answers), `dialogue` (the
default: a dialogue goes on when its user has answered), `overlapped` (dialogue-level, and the
next step's dialogues run while this step's update does: `--model.overlap`), `overlapped-2`
(the same with `max_staleness: 2`: two steps' dialogues in flight together; not run by default).

Printed per latency and mode, medians over steps 2..N: seconds per step, the speed-up over
lockstep, the trainer's wait (the share of a step in which it neither generated nor updated:
waiting on users; overlapped: waiting on the background rollout), the staleness trained on.
`--scale` multiplies every latency (and the retry backoff): at 0.25 a full table takes about
10 minutes on 2 cores; the ratios hold as long as a step's generation and update stay small
next to the users' latency, which is the regime this measures.

    .venv/bin/python benchmarks/async_rollouts.py [--steps 4] [--scale 1.0] [--latencies ...]
        [--modes lockstep dialogue overlapped] [--out runs/async_rollouts.json]

Whether overlapped steps learn as on-policy ones do is an ablation, not a speed figure:
`rlver ablate --arms recipes/ablations/overlap.yaml` (the quickstart as it is and with
`--model.overlap`, 3 seeds, paired intervals).

Figures go in docs/performance.md by hand, with the date, the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

LATENCIES = {
    "fixed": ("fixed:{a}", {"a": 2.0}, 0.0),
    "uniform": ("uniform:{a}:{b}", {"a": 1.0, "b": 5.0}, 0.0),
    "lognormal": ("lognormal:{a}:0.6", {"a": 2.5}, 0.0),
    "retried": ("lognormal:{a}:0.6", {"a": 2.5}, 0.05),
}
# mode: (rollout.schedule, overlap's max_staleness; 0 = no overlap)
MODES = {
    "lockstep": ("lockstep", 0), "dialogue": ("dialogue", 0), "overlapped": ("dialogue", 1),
    "overlapped-2": ("dialogue", 2),
}  # fmt: skip
DEFAULT_MODES = ["lockstep", "dialogue", "overlapped"]


def tiny_model(folder: Path) -> Path:
    """A 2-layer Llama with the embedded model's tokenizer (random weights, a few MB)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from rlver.modeling.models import resolve_model_path

    source = resolve_model_path("smollm2-135m-instruct")
    base = LlamaConfig.from_pretrained(source)
    config = LlamaConfig(
        vocab_size=base.vocab_size, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
        bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    GenerationConfig.from_pretrained(source).save_pretrained(folder)
    return folder


def fit_config(
    work: Path, model: Path, url: str, schedule: str, overlap: int, steps: int, scale: float
) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "precision": "32-true", "max_steps": steps,
            "limit_val_batches": 0, "log_every_n_steps": 1, "default_root_dir": str(work),
            "enable_checkpointing": False, "callbacks": [],
        },
        "model": {
            "policy": str(model), "engine": "hf", "advantage": "grpo", "group_size": 4,
            "rewards": ["final_emotion"], "actor_lr": 1e-5, "prompt_format": "nothink",
            "simulator": {
                "name": "sage", "base_url": url, "model": "scripted-user", "language": "en",
                "timeout": 60, "max_retries": 1, "backoff_seconds": 1.0 * scale, "max_concurrency": 64,
            },
            "rollout": {
                "max_turns": 8, "max_new_tokens": 24, "max_context_tokens": 4096, "schedule": schedule
            },
            "ppo": {"micro_batch_size": 8},
            "log_samples_every_n_steps": 0,
            **({"overlap": {"max_importance_weight": 2.0, "max_staleness": overlap}} if overlap else {}),
        },
        "data": {"train_files": ["builtin:en_train"], "batch_size": 8},
    }  # fmt: skip
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def scalars(folder: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {tag: [e.value for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def measure(work: Path, model: Path, latency: str, mode: str, steps: int, scale: float) -> dict:
    from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

    template, numbers, fault_rate = LATENCIES[latency]
    spec = template.format(**{k: v * scale for k, v in numbers.items()})
    schedule, overlap = MODES[mode]
    run = work / f"{latency}-{mode}"
    run.mkdir(parents=True)
    with ScriptedServer(Script(latency_spec=spec, fault_rate=fault_rate, fault_kinds=("500",))) as server:
        config = fit_config(run, model, server.url, schedule, overlap, steps, scale)
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "rlver.cli", "fit", "--config", str(config)],
            cwd=REPO, capture_output=True, text=True,
        )  # fmt: skip
        wall = time.perf_counter() - started
        served = dict(server.script.served)
    if result.returncode != 0:
        raise SystemExit(f"{latency}/{mode} failed:\n{(result.stdout + result.stderr)[-3000:]}")
    values = scalars(run / "tensorboard")
    kept = slice(1, None)  # step 1 starts the engine's caches (and, overlapped, has nothing to overlap)
    step = values["perf/step_seconds"][kept]
    rollout, generate = values["perf/rollout_seconds"][kept], values["perf/generate_seconds"][kept]
    # overlapped: the trainer's wait for the background rollout; else its wait on the users
    waiting = rollout if overlap else [r - g for r, g in zip(rollout, generate, strict=True)]
    row = {
        "latency": latency, "spec": spec, "mode": mode, "steps": steps, "wall_seconds": round(wall, 1),
        "step_seconds": statistics.median(step),
        "wait_fraction": statistics.median(w / s for w, s in zip(waiting, step, strict=True)),
        "staleness": statistics.mean(values.get("offpolicy/staleness", [0.0])[kept] or [0.0]),
        "served": served,
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| latency | mode | s/step | vs lockstep | trainer waiting | staleness |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lockstep = {r["latency"]: r["step_seconds"] for r in rows if r["mode"] == "lockstep"}
    for r in rows:
        base = lockstep.get(r["latency"])
        ratio = f"{base / r['step_seconds']:.2f}x" if base else "-"
        lines.append(
            f"| {r['latency']} ({r['spec']}) | {r['mode']} | {r['step_seconds']:.1f} | {ratio} | "
            f"{100 * r['wait_fraction']:.0f}% | {r['staleness']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per run (medians of steps 2..N)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every latency")
    parser.add_argument("--latencies", nargs="+", default=list(LATENCIES), choices=list(LATENCIES))
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "async_rollouts.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlver-async-") as folder:
        work = Path(folder)
        model = tiny_model(work / "tiny-llama")
        for latency in args.latencies:
            for mode in args.modes:
                rows.append(measure(work, model, latency, mode, args.steps, args.scale))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
