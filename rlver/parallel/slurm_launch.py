"""Refuse a SLURM job whose processes were not started by `srun`.

Under `sbatch`, the batch script runs once, on the first node, outside any job step. Lightning
sees SLURM_NTASKS and takes SLURM as the launcher (so it starts no processes itself), reads
SLURM_PROCID, which is 0 there, and waits for the other SLURM_NTASKS - 1 ranks, which nobody
starts; a script copied to every node by other means gives every process SLURM_PROCID 0. Either
way the job hangs until the collective timeout. `srun` (the one supported launch: `srun rlver fit
...` inside the batch script, one task per GPU) exports SLURM_STEP_ID and SLURM_STEP_NUM_TASKS to
every task it starts (srun(1), OUTPUT ENVIRONMENT VARIABLES); the batch script has neither.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# Lightning's own opt-out of SLURM detection (lightning.fabric.plugins.environments.slurm).
_INTERACTIVE_JOB_NAMES = ("bash", "interactive")


def slurm_launch_problem(env: Mapping[str, str] | None = None) -> str | None:
    """One line saying why this process cannot be one rank of the SLURM job, or None."""
    env = os.environ if env is None else env
    tasks = env.get("SLURM_NTASKS", "").strip()
    if not tasks.isdigit() or int(tasks) < 2:
        return None  # not SLURM, or one task: nothing to wait for
    if env.get("SLURM_JOB_NAME") in _INTERACTIVE_JOB_NAMES:
        return None  # Lightning does not take SLURM as the launcher then
    if "SLURM_STEP_ID" in env or "SLURM_STEPID" in env or "SLURM_STEP_NUM_TASKS" in env:
        return None  # inside an srun step: every task has its own SLURM_PROCID
    return (
        f"SLURM job of {tasks} tasks, but this process was not started by srun (no SLURM_STEP_ID), "
        "so every rank would be SLURM_PROCID 0 and the job would hang: launch with "
        "`srun rlver fit ...` in the batch script (one task per GPU: --ntasks-per-node = GPUs per node)"
    )


def refuse_launch_without_srun(env: Mapping[str, str] | None = None) -> None:
    problem = slurm_launch_problem(env)
    if problem:
        raise RuntimeError(problem)
