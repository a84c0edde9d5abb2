"""Refuse launches that would wait for ranks nobody starts: a SLURM job's batch script without
`srun`, and several nodes asked for with no launcher behind the process.

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


# Variables some launcher sets in every process it starts on several nodes: Lightning's own
# multi-node launch (NODE_RANK, MASTER_ADDR set by hand on each node), torchrun / TorchElastic /
# Kubeflow, SLURM, MPI, LSF.
_MULTI_NODE_VARIABLES = (
    "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID",
    "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "LSB_JOBID",
)  # fmt: skip


def nodes_launch_problem(num_nodes: int, devices: object, env: Mapping[str, str] | None = None) -> str | None:
    """One line saying why a run of `num_nodes` nodes cannot start from this process, or None.

    With several nodes asked for and no launcher behind the process, Lightning starts this node's
    ranks and they wait, silently, for the other nodes' (for the collective timeout: 106 min with
    the paper's endpoints). With a launcher whose WORLD_SIZE disagrees, they wait just the same.
    """
    env = os.environ if env is None else env
    if num_nodes <= 1:
        return None
    asked = f"--trainer.num_nodes {num_nodes}"
    if not any(env.get(name, "").strip() for name in _MULTI_NODE_VARIABLES):
        return (
            f"{asked}, but no launcher started this process as one of several nodes (none of "
            "NODE_RANK, MASTER_ADDR, torchrun's or SLURM's variables is set): its ranks would wait "
            "for nodes that never come. Run the same command on every node with NODE_RANK, "
            "MASTER_ADDR and MASTER_PORT set, or under torchrun / srun; on one node, pass "
            "--trainer.num_nodes 1 (`rlver plan --config FILE --world-size 8` checks the fit)"
        )
    world = env.get("WORLD_SIZE", "").strip()
    if isinstance(devices, int) and world.isdigit() and int(world) != num_nodes * devices:
        return (
            f"{asked} x --trainer.devices {devices} is {num_nodes * devices} ranks, but the launcher "
            f"started {world} (WORLD_SIZE): the ranks would wait for ones that never come"
        )
    return None


def refuse_nodes_without_launcher(
    num_nodes: int, devices: object, env: Mapping[str, str] | None = None
) -> None:
    problem = nodes_launch_problem(num_nodes, devices, env)
    if problem:
        raise RuntimeError(problem)
