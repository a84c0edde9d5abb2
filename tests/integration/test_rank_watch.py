"""One rank fails: the others end within seconds with its error, not at the collective timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rlver.parallel.rank_watch import FailureBoard, FailureWatcher, RankFailureWatch
from rlver.train.trainer import Trainer


def _free_port():
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def store_pair():
    """A real TCPStore (as the process group's) and a second client of it, as another rank holds."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=10))
    return host, client


def watch(board, **kwargs):
    calls = []
    done = threading.Event()

    def on_failure(rank, error):
        calls.append((rank, error))
        done.set()

    watcher = FailureWatcher(board, on_failure, interval_seconds=0.05, **kwargs)
    watcher.start()
    return watcher, calls, done


def test_the_first_failure_posted_is_what_every_rank_reads(store_pair):
    host, client = store_pair
    rank0, rank1 = FailureBoard(host, 0), FailureBoard(client, 1)
    assert rank0.read() is None and rank1.read() is None
    rank1.post("OSError: [Errno 28] No space left on device")
    rank0.post("RuntimeError: later, and a consequence")
    assert rank0.read() == (1, "OSError: [Errno 28] No space left on device")
    assert rank1.read() == rank0.read()


def test_a_watcher_acts_on_another_ranks_failure_and_never_on_its_own(store_pair):
    host, client = store_pair
    watcher, calls, done = watch(FailureBoard(host, 0))
    FailureBoard(client, 1).post("RuntimeError: boom")
    assert done.wait(timeout=60)
    watcher.join(timeout=60)
    assert calls == [(1, "RuntimeError: boom")]

    own = FailureBoard(client, 1)  # the failed rank's own watcher reads its own post: no call
    watcher, calls, done = watch(own)
    time.sleep(0.5)
    watcher.stop()
    watcher.join(timeout=60)
    assert calls == [] and not watcher.is_alive()


def test_a_stopped_watcher_never_acts(store_pair):
    host, client = store_pair
    watcher, calls, _ = watch(FailureBoard(host, 0))
    watcher.stop()
    watcher.join(timeout=60)
    FailureBoard(client, 1).post("RuntimeError: after the run ended")
    time.sleep(0.3)
    assert calls == []


def test_a_store_that_stops_answering_ends_the_rank_after_the_grace_period_only():
    from datetime import timedelta

    from torch.distributed import TCPStore

    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=10))
    patient, patient_calls, _ = watch(FailureBoard(client, 1), grace_seconds=3600)
    _, calls, done = watch(FailureBoard(client, 2), grace_seconds=1.0)
    del host  # the store's host (rank 0's process) is gone
    assert done.wait(timeout=120)
    ((rank, error),) = calls
    assert rank is None and "stopped answering" in error and "rank 0 is gone" in error
    assert patient_calls == [] and patient.is_alive()  # still inside its grace period
    patient.stop()


def test_every_rlver_trainer_has_the_watch_once(tmp_path):
    trainer = Trainer(accelerator="cpu", devices=1, default_root_dir=tmp_path, callbacks=[RankFailureWatch()])
    assert sum(isinstance(c, RankFailureWatch) for c in trainer.callbacks) == 1
    trainer = Trainer(accelerator="cpu", devices=1, default_root_dir=tmp_path)
    assert sum(isinstance(c, RankFailureWatch) for c in trainer.callbacks) == 1


# A two-rank DDP fit in which rank 1 raises at its second step and then never exits (as a rank
# whose peers sit in an NCCL collective sees it: no socket closes). Without the watch, rank 0
# waits in the gradient all-reduce for the process group's timeout.
RANK_SCRIPT = textwrap.dedent("""
    import sys, time
    import lightning as L
    import torch
    from rlver.train.trainer import Trainer

    class Stuck(L.Callback):
        def on_exception(self, trainer, pl_module, exception):
            if trainer.global_rank == 1:
                print("rank 1 failed, staying alive", flush=True)
                time.sleep(900)

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            if self.global_rank == 1 and batch_idx == 1:
                raise RuntimeError("No space left on device (rank 1's checkpoint disk)")
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 4))
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=20, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, callbacks=[Stuck()],
        default_root_dir=sys.argv[1],
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=2))
""")


def start_two_ranks(script_text, tmp_path):
    """Two ranks of `script_text` (its argv[1]: `tmp_path`) on this machine, as Lightning's own
    launcher would start them, their output piped."""
    script = tmp_path / "ranks.py"
    script.write_text(script_text)
    port = _free_port()
    ranks = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "NODE_RANK": "0",
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
        }
        command = [sys.executable, str(script), str(tmp_path)]
        ranks.append(
            subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    return ranks


@pytest.mark.slow
def test_when_rank_1_fails_rank_0_ends_with_its_error_while_rank_1_still_hangs(tmp_path):
    ranks = start_two_ranks(RANK_SCRIPT, tmp_path)
    try:
        output0, _ = ranks[0].communicate(timeout=900)  # a hang guard: the group's timeout is 30 min
        assert ranks[1].poll() is None, "rank 1 exited: its sockets closing, not the watch, ended rank 0"
        assert ranks[0].returncode == 1, output0[-3000:]
        assert (
            "rlver: rank 1 failed (RuntimeError: No space left on device (rank 1's checkpoint disk))"
            in output0
        )
        assert "rank 0 stops too rather than wait out the collective timeout" in output0
    finally:
        for process in ranks:
            process.kill()
            process.wait()


# A two-rank DDP fit with every watch an rlver Trainer has (RankFailureWatch, HangWatchdog at its
# 10 min default), in which rank 0, the store's host, is SIGKILLed (the out-of-memory killer) at
# its third step while rank 1 sleeps outside any collective (as a rank in an NCCL collective sees
# it: no error comes). Only the watches can end rank 1; it must not wait for rank 0's post or
# for the watchdog's timeout.
RANK_0_KILLED_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import lightning as L
    import torch
    from rlver.parallel.rank_watch import RankFailureWatch
    from rlver.train.trainer import Trainer

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                if self.global_rank == 0:
                    time.sleep(1)  # rank 1 is asleep by now
                    print("rank 0 killed", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                print("rank 1 asleep", flush=True)
                time.sleep(900)
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 4))
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=20, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=sys.argv[1],
        callbacks=[RankFailureWatch(interval_seconds=0.5, grace_seconds=3)],
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=2))
""")


@pytest.mark.slow
def test_when_rank_0_is_killed_rank_1_ends_within_seconds(tmp_path):
    ranks = start_two_ranks(RANK_0_KILLED_SCRIPT, tmp_path)
    try:
        output0, _ = ranks[0].communicate(timeout=600)
        assert ranks[0].returncode == -9, output0[-3000:]
        killed_at = time.monotonic()
        # grace 3 s + polls; 60 s of slack for a busy machine, far below the watchdog's 10 min
        output1, _ = ranks[1].communicate(timeout=60)
        ended_after = time.monotonic() - killed_at
        assert ranks[1].returncode == 1, output1[-3000:]
        assert "rank 1 asleep" in output1
        assert "store stopped answering" in output1 and "rank 1 stops too" in output1, output1[-3000:]
        print(f"rank 1 ended {ended_after:.1f} s after rank 0's death")
    finally:
        for process in ranks:
            process.kill()
            process.wait()
