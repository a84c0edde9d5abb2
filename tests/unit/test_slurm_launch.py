"""A SLURM job whose processes srun did not start is refused in one line (issue 42, item 6)."""

from __future__ import annotations

import pytest

from rlver.parallel.slurm_launch import refuse_launch_without_srun, slurm_launch_problem

BATCH_SCRIPT = {"SLURM_NTASKS": "16", "SLURM_PROCID": "0", "SLURM_JOB_NAME": "ppo_think", "SLURM_JOB_ID": "7"}


def test_a_batch_script_of_a_many_task_job_is_refused_in_one_line():
    problem = slurm_launch_problem(BATCH_SCRIPT)
    assert problem and "\n" not in problem
    assert "SLURM job of 16 tasks" in problem and "srun rlver fit" in problem
    with pytest.raises(RuntimeError, match="not started by srun"):
        refuse_launch_without_srun(BATCH_SCRIPT)


@pytest.mark.parametrize(
    "env",
    [
        {},  # no SLURM
        {**BATCH_SCRIPT, "SLURM_NTASKS": "1"},  # one task: nothing to wait for
        {**BATCH_SCRIPT, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "16"},  # srun's tasks
        {**BATCH_SCRIPT, "SLURM_JOB_NAME": "interactive"},  # Lightning's opt-out of SLURM
    ],
)
def test_srun_tasks_and_jobs_that_are_not_slurm_launches_pass(env):
    assert slurm_launch_problem(env) is None


def test_the_trainer_refuses_before_lightning_waits(monkeypatch):
    from rlver.train.trainer import Trainer

    for name, value in BATCH_SCRIPT.items():
        monkeypatch.setenv(name, value)
    for name in ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="SLURM job of 16 tasks"):
        Trainer(accelerator="cpu", devices=1, logger=False)


# --------------------------------------------------------------------------- several nodes, no launcher
def test_several_nodes_without_a_launcher_are_refused_in_one_line():
    """Issue 54 (5): ppo_think asks for 4 nodes; started on one machine with no launcher, its 8
    ranks waited ~106 minutes in silence for 24 that never came."""
    from rlver.parallel.slurm_launch import nodes_launch_problem, refuse_nodes_without_launcher

    problem = nodes_launch_problem(4, 8, {})
    assert problem and "\n" not in problem
    assert "--trainer.num_nodes 4" in problem and "--trainer.num_nodes 1" in problem
    with pytest.raises(RuntimeError, match="no launcher started this process"):
        refuse_nodes_without_launcher(4, 8, {"HOME": "/root"})
    assert nodes_launch_problem(1, 8, {}) is None  # one node: Lightning starts every rank itself
    assert nodes_launch_problem(4, 8, {"NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"}) is None
    assert nodes_launch_problem(4, 8, {"RANK": "9", "WORLD_SIZE": "32", "MASTER_ADDR": "n0"}) is None
    mismatch = nodes_launch_problem(4, 8, {"RANK": "0", "WORLD_SIZE": "8", "MASTER_ADDR": "n0"})
    assert mismatch and "32 ranks" in mismatch and "started 8" in mismatch


@pytest.mark.slow
def test_the_paper_recipe_on_one_machine_without_a_launcher_fails_at_once(tmp_path):
    """`rlver fit --config recipes/ppo_think.yaml` as shipped (4 nodes) on a machine that is not
    one of 4: one line naming the flag, an exit status, and no process left waiting."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO), RLVER_SIMULATOR_API_KEY="sk-not-a-secret")
    result = subprocess.run(
        [sys.executable, "-m", "rlver.cli", "fit", "--config", str(REPO / "recipes" / "ppo_think.yaml")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode != 0
    assert "--trainer.num_nodes 4, but no launcher started this process" in result.stderr + result.stdout
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.ckpt"))
