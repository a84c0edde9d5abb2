"""The hang watchdog's FSDP checkpoint: each rank's own shards, written and read without a collective.

Two spawned ranks (gloo, CPU) shard the tiny Llama (tied embeddings) with FSDP1 and take an AdamW
step. Each writes its part while a rollout holds the full weights gathered (as the watchdog finds
a rank hung mid-rollout), counting collectives; then a fresh model and optimizer on the same ranks,
as a resumed run builds them, take the parts back. In the test process, with no process group,
the parts assemble into the whole weights. The 2-rank Lightning run that uses all of it is in
tests/integration/test_ranks_diverge.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlver.checkpoint.local_shards import (
    META_FILENAME,
    full_weights,
    is_local_shards_checkpoint,
    local_state,
    part_filename,
    restore_local_state,
)
from tests.integration.test_distributed import _batch, _count_collectives, _run_ranks, _tiny_llama


def _sharded_with_adam(rank: int) -> tuple[Any, torch.optim.Optimizer]:
    from rlver.parallel.sharding import fsdp1_wrap

    model = fsdp1_wrap(_tiny_llama(0), device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=_batch(rank), labels=_batch(rank)).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _local_shards_worker(rank: int, out: str) -> dict[str, Any]:
    from rlver.parallel.full_weights import full_state_dict, gathered_for_generation

    model, optimizer = _sharded_with_adam(rank)
    written = full_state_dict(model, cpu_offload=True)
    optimizer_state = optimizer.state_dict()
    with gathered_for_generation(model), _count_collectives() as counts:  # mid-rollout: weights gathered
        part = local_state(model, [optimizer], rank, world_size=2)
        torch.save(part, Path(out) / part_filename(rank))
    collectives = counts[0]
    # A resumed run: new weights (another seed), a new optimizer without state, the same wrapping.
    resumed, resumed_optimizer = _sharded_with_adam(rank)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in resumed.parameters():
            parameter.normal_()
    resumed_optimizer.state.clear()
    stored = torch.load(Path(out) / part_filename(rank), weights_only=True)
    restore_local_state(resumed, [resumed_optimizer], stored, world_size=2, source=out)
    mismatch = None
    try:
        restore_local_state(resumed, [resumed_optimizer], {**stored, "world_size": 4}, 2, source="x")
    except ValueError as error:
        mismatch = str(error)
    return {
        "collectives": collectives,
        "written": written,
        "restored": full_state_dict(resumed, cpu_offload=True),
        "optimizer": optimizer_state,
        "restored_optimizer": resumed_optimizer.state_dict(),
        "mismatch": mismatch,
    }


@pytest.mark.slow
def test_each_rank_writes_and_takes_back_its_shards_and_one_process_assembles_them(tmp_path):
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    results = _run_ranks(_local_shards_worker, tmp_path / "ranks", str(folder), timeout=600)
    written = results[0]["written"]
    assert results[1]["written"].keys() == written.keys()
    for result in results:
        assert result["collectives"] == 0  # a hung peer would never join one
        for name, tensor in written.items():
            assert torch.equal(result["restored"][name], tensor), name
        saved, restored = result["optimizer"], result["restored_optimizer"]
        assert saved["state"].keys() == restored["state"].keys() and saved["state"]
        for index, state in saved["state"].items():
            for key, value in state.items():
                assert torch.equal(restored["state"][index][key], value), (index, key)
        assert "written by the hang watchdog on 4 ranks" in result["mismatch"]
        assert "resume it on 4 ranks (this run has 2)" in result["mismatch"]
    # In one process, without a process group: the whole weights, tied embeddings named twice.
    assert not is_local_shards_checkpoint(folder)  # no meta.pt yet: not a checkpoint
    torch.save({"global_step": 3}, folder / META_FILENAME)
    assert is_local_shards_checkpoint(folder)
    assembled = full_weights(folder)
    assert set(assembled) | {"lm_head.weight"} == set(written) | {"lm_head.weight"}
    for name, tensor in written.items():
        assert torch.equal(assembled[name], tensor), name
    assert torch.equal(assembled["lm_head.weight"], assembled["model.embed_tokens.weight"])
