"""`rlver eval`: a policy's general capabilities through lm-eval, and the change between two runs.

    rlver eval --model smollm2-135m-instruct --tasks rlver_gsm8k,rlver_humaneval --limit 20 \\
        --allow-code-execution --out eval/
    rlver eval --ckpt runs/quickstart/checkpoints/last.ckpt --tasks rlver_gsm8k --limit 20
    rlver eval --compare eval/smollm2-135m-instruct.json runs/quickstart/eval/quickstart-last.json
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentParser

from rlver.evaluate.capabilities import BACKENDS, OFFLINE_TASKS, safe_label


def eval_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="rlver eval",
        description="General capabilities (maths, code, ...) of a policy through EleutherAI's "
        "lm-evaluation-harness, with the policy's chat template; or, with --compare, the change "
        "between two results with its 95%% interval. Needs `pip install rlver[eval]`.",
    )
    parser.add_argument("--ckpt", type=str | None, default=None, help="An `rlver fit` checkpoint.")
    parser.add_argument(
        "--model",
        type=str | None,
        default=None,
        help="A built-in model name (smollm2-135m-instruct), a Hugging Face folder (e.g. from "
        "`rlver export`) or a hub id where the network allows.",
    )
    parser.add_argument(
        "--tasks",
        type=str,
        default=",".join(OFFLINE_TASKS),
        help=f"Comma-separated lm-eval tasks. Offline: {', '.join(OFFLINE_TASKS)}; others run "
        "only if their data is in the local cache, else they are skipped with one line (IFEval "
        "always: its prompts are in no PyPI package).",
    )
    parser.add_argument("--limit", type=int | None, default=None, help="Items per task (default: all).")
    parser.add_argument(
        "--out",
        type=str | None,
        default=None,
        help="Folder for <label>.json and <label>.md (default: <run>/eval beside a checkpoint's "
        "checkpoints/ folder, else ./eval).",
    )
    parser.add_argument(
        "--tensorboard",
        type=str | None,
        default=None,
        help="Also write the scores as scalars eval/<task>/... into this TensorBoard folder "
        "(e.g. runs/quickstart/tensorboard), at the checkpoint's step.",
    )
    parser.add_argument("--backend", type=str, default="hf", help=f"lm-eval backend: {', '.join(BACKENDS)}.")
    parser.add_argument("--device", type=str, default="cpu", help="Device for the hf backend (cpu, cuda).")
    parser.add_argument("--dtype", type=str, default="float32", help="float32, bfloat16 or float16.")
    parser.add_argument("--batch-size", type=int, default=8, help="Prompts generated together (hf backend).")
    parser.add_argument("--max-length", type=int, default=2048, help="Prompt + answer tokens at most.")
    parser.add_argument(
        "--max-new-tokens",
        type=int | None,
        default=None,
        help="Answer tokens at most, for every task (default: each task's own: 256 GSM8K, 384 HumanEval).",
    )
    parser.add_argument(
        "--allow-code-execution",
        action="store_true",
        help="Run code tasks (rlver_humaneval): this EXECUTES MODEL-WRITTEN CODE in a child process "
        "with time and memory limits; without it they are skipped.",
    )
    parser.add_argument("--seed", type=int, default=0, help="lm-eval's random, numpy and torch seeds.")
    parser.add_argument(
        "--compare",
        type=str,
        default=None,
        nargs=2,
        help="BEFORE AFTER: two results (JSON files or folders from `rlver eval`); prints each "
        "task's change with its 95%% interval, paired per item where the items match.",
    )
    return parser


def _default_out(ckpt: str | None) -> Path:
    if ckpt is not None:
        folder = Path(ckpt).resolve().parent
        if folder.name == "checkpoints":
            return folder.parent / "eval"
        return folder / "eval"
    return Path("eval")


def _label(ckpt: str | None, model: str | None) -> str:
    if ckpt is None:
        return safe_label(Path(model).name if Path(model).is_dir() else model)
    path = Path(ckpt).resolve()
    run = path.parent.parent.name if path.parent.name == "checkpoints" else path.parent.name
    return safe_label(f"{run}-{path.stem}")


def load_evaluated_policy(ckpt: str | None, model: str | None, dtype: str, device: str) -> Any:
    """The policy as rlver loads it: a checkpoint's weights on its own base model, or a named model."""
    from rlver.modeling.models import load_policy

    if ckpt is None:
        return load_policy(model, dtype=dtype, device=device)
    from rlver.checkpoint.export import load_policy_weights, read_policy_state

    base, _ = read_policy_state(ckpt)  # raises a clear --ckpt error for a missing or foreign file
    policy = load_policy(base, dtype=dtype, device="cpu")
    load_policy_weights(policy.model, ckpt)
    policy.model.to(device)
    return policy


def _checkpoint_step(ckpt: str | None) -> int:
    if ckpt is None:
        return 0
    from rlver.checkpoint.io import read_checkpoint_state

    return int(read_checkpoint_state(Path(ckpt)).get("global_step", 0))


def compare_command(before: str, after: str) -> int:
    from rlver.evaluate.capability_compare import compare_markdown, load_summary

    print(compare_markdown(load_summary(before, "--compare BEFORE"), load_summary(after, "--compare AFTER")))
    return 0


def eval_command(argv: Sequence[str]) -> int:
    parser = eval_parser()
    cfg = parser.parse_args(list(argv))
    if cfg.compare:
        if cfg.ckpt or cfg.model:
            parser.error("--compare reads two results; it takes no --ckpt or --model")
        return compare_command(*cfg.compare)
    if (cfg.ckpt is None) == (cfg.model is None):
        parser.error("name exactly one policy: --ckpt PATH or --model NAME (or --compare BEFORE AFTER)")
    if cfg.limit is not None and cfg.limit < 1:
        parser.error(f"--limit ({cfg.limit}) must be >= 1")
    if cfg.max_new_tokens is not None and cfg.max_new_tokens < 1:
        parser.error(f"--max-new-tokens ({cfg.max_new_tokens}) must be >= 1")
    if cfg.backend not in BACKENDS:
        parser.error(f"--backend ({cfg.backend!r}) must be one of {', '.join(BACKENDS)}")
    from rlver.evaluate.capabilities import announce_plan, evaluate_capabilities, plan_tasks
    from rlver.evaluate.capability_compare import results_markdown, write_tensorboard

    tasks = [name.strip() for name in cfg.tasks.split(",") if name.strip()]
    planned = plan_tasks(tasks, cfg.allow_code_execution)  # an unknown task fails before a model loads
    announce_plan(planned[0])  # so do skipped tasks when nothing else is left
    label = _label(cfg.ckpt, cfg.model)
    out = Path(cfg.out) if cfg.out else _default_out(cfg.ckpt)
    policy = load_evaluated_policy(cfg.ckpt, cfg.model, cfg.dtype, cfg.device)
    model_folder = None
    if cfg.backend == "vllm":
        model_folder = policy.path
        if cfg.ckpt is not None:  # vLLM loads from a folder: the checkpoint's policy exported first
            from rlver.checkpoint.export import export_checkpoint

            model_folder = str(export_checkpoint(cfg.ckpt, out / f"{label}-model"))
        policy.model = None  # vLLM loads its own copy
    summary = evaluate_capabilities(
        policy,
        label,
        tasks,
        limit=cfg.limit,
        allow_code=cfg.allow_code_execution,
        backend=cfg.backend,
        batch_size=cfg.batch_size,
        max_length=cfg.max_length,
        model_folder=model_folder,
        seed=cfg.seed,
        planned=planned,
        max_new_tokens=cfg.max_new_tokens,
    )
    summary["policy"] = {"ckpt": cfg.ckpt, "model": cfg.model, "backend": cfg.backend}
    table = results_markdown(summary)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{label}.json").write_text(json.dumps(summary, indent=1))
    (out / f"{label}.md").write_text(table + "\n")
    print(table)
    print(f"\nresults: {out / (label + '.json')}")
    if cfg.tensorboard:
        print(f"tensorboard: {write_tensorboard(summary, cfg.tensorboard, _checkpoint_step(cfg.ckpt))}")
    return 0
