"""A node that never starts: the ranks that did end within the rendezvous bound, naming it.

Issue 54 (4): with a launcher behind every process (MASTER_ADDR, NODE_RANK, WORLD_SIZE set) but
fewer nodes started than asked, the ranks waited in torch's rendezvous for the process group's
timeout (rlver raises it to 106 min for the paper's endpoints), in silence.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rlver.parallel.rendezvous import describe_ranks
from rlver.train.trainer import Trainer
from tests.integration.test_rank_watch import _free_port

# One node of a 2-node job of one process each; the group's timeout is 30 min, the rendezvous 3 s.
NODE_SCRIPT = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from rlver.train.trainer import Trainer

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = Trainer(
        accelerator="cpu", devices=1, num_nodes=2, strategy=DDPStrategy(timeout=timedelta(minutes=30)),
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        default_root_dir=sys.argv[1], rendezvous_seconds=3,
    )
    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=2))
""")


def start_node(tmp_path, node_rank, port):
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "NODE_RANK": str(node_rank),
        "LOCAL_RANK": "0",
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, str(script), str(tmp_path)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("started", [0, 1])
def test_a_job_whose_other_node_never_starts_ends_within_the_bound_naming_it(started, tmp_path):
    node = start_node(tmp_path, started, _free_port())
    try:
        # A hang guard far under the group's 30 min: imports take seconds, the bound 3 s.
        output, _ = node.communicate(timeout=240)
    finally:
        node.kill()
        node.wait()
    assert node.returncode != 0, output[-3000:]
    if started == 0:  # rank 0 hosts the store; rank 1 (node 1) never checks in
        assert "rank 0: 1 of the job's 2 ranks never came within 3 s: rank 1 (node 1)" in output, output[
            -3000:
        ]
    else:  # rank 0, the store's host, never came
        assert "rank 1: the job's store (127.0.0.1:" in output and "rank 0 never came" in output, output[
            -3000:
        ]
    assert "NODE_RANK" in output and "--trainer.rendezvous_seconds (3)" in output


def test_missing_ranks_are_named_by_node_as_ranges():
    assert describe_ranks(list(range(8, 16)), 8) == "ranks 8-15 (node 1)"
    assert describe_ranks([9], 8) == "rank 9 (node 1)"
    assert describe_ranks([3, 4, 6, 24, 25], 8) == "ranks 3-4, 6 (node 0), ranks 24-25 (node 3)"


def test_the_bound_must_be_positive_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match=r"--trainer.rendezvous_seconds \(0\) must be > 0"):
        Trainer(accelerator="cpu", devices=1, default_root_dir=tmp_path, rendezvous_seconds=0)
