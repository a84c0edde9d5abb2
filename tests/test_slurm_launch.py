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
