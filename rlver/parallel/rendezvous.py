"""A job whose ranks do not all start ends within a minute, naming the ones that never came.

torch's rendezvous waits for every rank for the process group's timeout, which rlver raises to
cover the simulator's retries (106 min with the paper's endpoints): a node that never started (a
wrong NODE_RANK, an srun step that failed on one node, a node lost at boot) kept every other GPU
of the job waiting that long, in silence. So before the group exists each rank checks in at the
job's store (MASTER_ADDR:MASTER_PORT, hosted by rank 0) and waits there at most
`--trainer.rendezvous_seconds`; then every rank that came ends with one line naming the ranks
(and nodes) that did not and what to check. Only after that does the group's long timeout apply.

The store is the group's own: TCPStore servers are shared within a process (`multi_tenant`), so
torch's rendezvous reuses the one rank 0 opened here. Under torchrun the agent hosts it, and every
rank checks in as a client.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any

ARRIVED_KEY = "rlver/rendezvous"  # "/<rank>": the host the rank runs on

# Rank 0's store, kept for the process's life: torch's rendezvous takes its server over.
_kept_stores: list[Any] = []


def describe_ranks(ranks: list[int], ranks_per_node: int) -> str:
    """`[8, 9, ..., 15], 8` -> "ranks 8-15 (node 1)": the ranks grouped by node, runs as ranges."""
    by_node: dict[int, list[int]] = {}
    for rank in sorted(ranks):
        by_node.setdefault(rank // max(ranks_per_node, 1), []).append(rank)
    parts = []
    for node, members in by_node.items():
        runs: list[str] = []
        start: int | None = members[0]  # None once the last run is closed
        for before, after in zip(members, [*members[1:], None], strict=True):
            if after != before + 1:
                runs.append(str(start) if start == before else f"{start}-{before}")
                start = after
        noun = "rank" if len(members) == 1 else "ranks"
        parts.append(f"{noun} {', '.join(runs)} (node {node})")
    return ", ".join(parts)


def await_every_rank(
    address: str, port: int, rank: int, world_size: int, ranks_per_node: int, seconds: float
) -> None:
    """Check this rank in at the job's store; return once all `world_size` ranks have.

    Raises:
        RuntimeError: some rank had not come within `seconds` (or the store, rank 0's, never
            answered), naming the ranks missing and what to check.
    """
    from torch.distributed import TCPStore

    hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    deadline = time.monotonic() + seconds
    where = f"MASTER_ADDR={address} MASTER_PORT={port}"
    check = (
        f"Check that every node ran the same command with its own NODE_RANK and {where} (or that "
        "srun / torchrun started every node), that the node count and devices asked for match what "
        f"started, and that {address}:{port} is reachable from every node; --trainer.rendezvous_seconds "
        f"({seconds:g}) waits longer for nodes that start slowly"
    )
    try:
        store = TCPStore(
            address, port, is_master=hosts_store, timeout=timedelta(seconds=seconds),
            wait_for_workers=False, multi_tenant=True,
        )  # fmt: skip
    except (RuntimeError, OSError) as error:  # torch's DistNetworkError and DistStoreError are both
        raise RuntimeError(
            f"rank {rank}: the job's store ({address}:{port}, rank 0's) did not answer within "
            f"{seconds:g} s ({str(error).splitlines()[0]}): rank 0 never came. {check}"
        ) from None
    if hosts_store:
        _kept_stores.append(store)
    store.set(f"{ARRIVED_KEY}/{rank}", socket.gethostname())
    keys = [f"{ARRIVED_KEY}/{other}" for other in range(world_size)]
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [other for other, key in enumerate(keys) if not store.check([key])]
            raise RuntimeError(
                f"rank {rank}: {len(missing)} of the job's {world_size} ranks never came within "
                f"{seconds:g} s: {describe_ranks(missing, ranks_per_node)}. {check}"
            )
        time.sleep(0.2)


def bound_rendezvous(strategy: Any, seconds: float) -> None:
    """Make a distributed Lightning `strategy` wait at most `seconds` for every rank to start.

    Every strategy that creates a process group does it in `setup_environment` (after Lightning's
    launcher has started this node's processes); the check runs just before, on each rank.
    """
    if getattr(strategy, "cluster_environment", None) is None or getattr(
        strategy, "_rlver_rendezvous", False
    ):
        return  # one process, or already bounded
    setup_environment = strategy.setup_environment

    def checked_setup_environment() -> None:
        import torch.distributed as dist

        strategy.set_world_ranks()  # what the strategy does next itself: global rank, world size
        environment = strategy.cluster_environment
        if strategy.world_size > 1 and not dist.is_initialized():
            await_every_rank(
                environment.main_address, int(environment.main_port), strategy.global_rank,
                strategy.world_size, strategy.num_processes, seconds,
            )  # fmt: skip
        setup_environment()

    strategy.setup_environment = checked_setup_environment
    strategy._rlver_rendezvous = True
