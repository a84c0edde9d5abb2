"""benchmarks/step_cost.py: reading `rlver fit`'s console, the alternating order, the ratios, bad arms."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import step_cost

CONSOLE = """rlver: loading smollm2-135m-instruct and the vllm engine ...
rlver: ... done in 8 s
rlver: talking with 64 held-out users before training (greedy) ... done in 11 s
step 1/4  reward 0.316  emotion 31.6  (22 s)
step 2/4  reward 0.312  emotion 31.2  (10 s)
step 3/4  reward 0.318  emotion 31.8  (9 s)
step 4/4  reward 0.310  emotion 31.0  (12.5 s)
rlver: talking with 64 held-out users after training (greedy) ... done in 9 s
"""


def test_the_steps_after_the_first_and_the_evaluations_are_read_from_the_console():
    assert step_cost.step_seconds(CONSOLE) == [10.0, 9.0, 12.5]
    assert step_cost.evaluation_seconds(CONSOLE) == [11.0, 9.0]  # the model's load is not an evaluation
    assert step_cost.step_seconds("step 1/4  reward 0.3  emotion 30.0  (20 s)\n") == []


def test_rounds_alternate_the_order_so_drift_in_the_hour_cancels():
    assert step_cost.run_order(["a", "b"], 3) == [(1, ["a", "b"]), (2, ["b", "a"]), (3, ["a", "b"])]


def test_ratios_compare_arms_within_a_round_only():
    medians = {(1, "a"): 10.0, (1, "b"): 13.0, (2, "a"): 20.0, (2, "b"): 22.0, (3, "b"): 5.0}
    ratios = step_cost.ratios(medians, "a")
    assert ratios["a"] == [1.0, 1.0]
    assert ratios["b"] == pytest.approx([1.3, 1.1])  # round 3 has no reference run: no ratio


def test_a_missing_arms_file_is_one_error_naming_it():
    done = subprocess.run(
        [sys.executable, "benchmarks/step_cost.py", "--arms", "nope.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--arms: nope.yaml not found" in done.stderr, done.stderr


def test_step_times_come_from_the_runs_tensorboard_scalars_first_step_left_out(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tensorboard"))
    for step, seconds in enumerate([30.0, 10.25, 9.5, 11.0]):
        writer.add_scalar("perf/step_seconds", seconds, step)
    writer.close()
    assert step_cost.logged_seconds(tmp_path, "perf/step_seconds") == [10.25, 9.5, 11.0]
    assert step_cost.logged_seconds(tmp_path, "perf/update_seconds") == []
    assert step_cost.logged_seconds(tmp_path / "no run here", "perf/step_seconds") == []
