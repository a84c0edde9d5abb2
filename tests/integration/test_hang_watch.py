"""No rank progresses: the job ends within the watchdog's time, naming the phase, not at the collective timeout."""

from __future__ import annotations

import textwrap
import threading
import time
from types import SimpleNamespace

import pytest

from rlver.checkpoint.emergency import CollectiveFreeCheckpoint
from rlver.checkpoint.stopping import run_unless_stopped
from rlver.parallel.hang_watch import HangWatchdog, ProgressClock, turn_progress
from rlver.train.trainer import Trainer
from tests.integration.test_rank_watch import start_two_ranks


class CountingStore:
    """The one store call the clock makes, as torch's stores answer it (shared by every rank)."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, key: str, amount: int) -> int:
        self.value += amount
        return self.value


def test_the_clock_fires_only_after_the_timeout_without_progress():
    clock = ProgressClock(timeout_seconds=10.0)
    assert clock.check(0.0) is None  # disarmed: never fires
    clock.arm(0.0)
    assert clock.check(1.0) is None
    assert clock.check(10.5) is None  # 9.5 s since the first look
    clock.mark()
    assert clock.check(11.0) is None  # a mark: the wait starts again
    assert clock.check(20.9) is None
    assert clock.check(21.0) == pytest.approx(10.0)
    clock.disarm()
    assert clock.check(100.0) is None


def test_another_ranks_progress_keeps_this_rank_waiting():
    store = CountingStore()
    waiting, progressing = ProgressClock(10.0, store), ProgressClock(10.0, store)
    waiting.arm(0.0)
    progressing.arm(0.0)
    for now in range(1, 60, 3):  # rank 1's dialogues advance; rank 0 sits in a collective
        progressing.mark()
        assert progressing.check(float(now)) is None
        assert waiting.check(float(now)) is None
    # rank 1 stops too (its last mark was seen at 58 s): now the job is hung
    assert waiting.check(67.0) is None
    assert waiting.check(69.0) == pytest.approx(11.0)


def fake_trainer(step=4):
    return SimpleNamespace(world_size=1, global_rank=0, global_step=step, strategy=None, callbacks=[])


def started(watchdog, trainer):
    fired = []
    done = threading.Event()

    def record(stalled):
        fired.append((stalled, watchdog.describe(stalled)))
        done.set()

    watchdog.expire = record
    watchdog.setup(trainer, None, "fit")
    return fired, done


def test_the_watchdog_fires_naming_the_phase():
    watchdog = HangWatchdog(timeout_minutes=0.5 / 60, poll_seconds=0.05)
    trainer = fake_trainer(step=4)
    fired, done = started(watchdog, trainer)
    watchdog.on_train_batch_start(trainer, None, None, 0)
    assert done.wait(timeout=30)
    ((stalled, message),) = fired
    assert stalled >= 0.5
    assert "no progress for" in message and "in training step 5 (rollouts)" in message
    assert "timeout_minutes=" in message


def test_the_watchdog_stays_quiet_while_steps_progress_and_before_and_after_training():
    watchdog = HangWatchdog(timeout_minutes=0.5 / 60, poll_seconds=0.05)
    trainer = fake_trainer(step=0)
    trainer.state, trainer.sanity_checking = SimpleNamespace(fn="fit"), True
    fired, _ = started(watchdog, trainer)
    watchdog.on_validation_batch_start(trainer, None, None, 0)  # Lightning's sanity check
    watchdog.on_validation_end(trainer, None)
    trainer.sanity_checking = False
    watchdog.on_train_start(trainer, None)
    time.sleep(1.0)  # BeforeAfter's evaluation before training: no batches, not watched
    assert fired == []
    for step in range(15):  # 1.5 s of steps of 0.1 s, three times the timeout
        trainer.global_step = step
        watchdog.on_train_batch_start(trainer, None, None, step)
        time.sleep(0.05)
        watchdog.on_train_batch_end(trainer, None, None, None, step)
        time.sleep(0.05)
    watchdog.on_train_end(trainer, None)  # BeforeAfter's evaluation may follow: no batches to mark
    time.sleep(1.0)
    assert fired == []
    watchdog.teardown(trainer, None, "fit")


def test_every_rollout_turn_is_progress_and_the_update_is_its_own_phase():
    watchdog = HangWatchdog()
    trainer = SimpleNamespace(callbacks=[watchdog], world_size=1, global_step=2)
    watchdog.on_train_batch_start(trainer, None, None, 0)
    marks = watchdog.clock.marks

    def three_turns(should_stop):
        return [should_stop() for _ in range(3)]

    trajectories, fatal = run_unless_stopped(three_turns, trainer, gather=lambda value: [value])
    assert trajectories == [False, False, False] and fatal is None
    assert watchdog.clock.marks >= marks + 3
    assert watchdog.phase == "training step 3 (update)"
    watchdog.checkpoint = CollectiveFreeCheckpoint()
    share = watchdog.write_share(trainer)  # mid-update: the state is not whole
    assert share == "it was in training step 3 (update), past the rollouts: the state may be half updated"


def test_a_rank_waiting_in_the_stop_agreement_is_still_in_its_rollouts():
    """Issue 54 (5): the agreement is a step's first collective after its rollouts; a rank waiting
    there for a hung peer has changed nothing, so under FSDP it must still write its share of
    last.ckpt. The update's phase began before the agreement: no rank but the hung one wrote."""
    from rlver.checkpoint.stopping import GracefulStop

    watchdog, stop = HangWatchdog(), GracefulStop()
    seen_in_agreement = []
    stop.agree = lambda trainer: seen_in_agreement.append(watchdog.phase) or False
    trainer = SimpleNamespace(callbacks=[watchdog, stop], world_size=2, global_step=2)
    watchdog.on_train_batch_start(trainer, None, None, 0)
    run_unless_stopped(lambda should_stop: [should_stop()], trainer, gather=lambda value: [value])
    assert seen_in_agreement == ["training step 3 (rollouts)"]
    assert watchdog.phase == "training step 3 (update)"


def test_every_rlver_trainer_has_the_watchdog_once_and_bad_settings_name_it(tmp_path):
    trainer = Trainer(accelerator="cpu", devices=1, default_root_dir=tmp_path)
    assert sum(isinstance(c, HangWatchdog) for c in trainer.callbacks) == 1
    mine = HangWatchdog(timeout_minutes=30)
    trainer = Trainer(accelerator="cpu", devices=1, default_root_dir=tmp_path, callbacks=[mine])
    assert [c for c in trainer.callbacks if isinstance(c, HangWatchdog)] == [mine]
    with pytest.raises(ValueError, match="HangWatchdog timeout_minutes"):
        HangWatchdog(timeout_minutes=-1)


# A two-rank DDP fit in which rank 1 hangs in its fourth training step (as a rank waiting on a
# dead simulator endpoint does) while rank 0 waits for it in the gradient all-reduce. Nothing
# fails, so RankFailureWatch alone never acts: without the watchdog both wait out the
# collective timeout (here 10 min).
HANG_SCRIPT = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from rlver.parallel.hang_watch import HangWatchdog
    from rlver.train.trainer import Trainer

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            if self.global_rank == 1 and batch_idx == 3:
                print("rank 1 hangs", flush=True)
                time.sleep(900)
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 4))
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(minutes=10)), max_steps=20,
        logger=False, enable_progress_bar=False, default_root_dir=sys.argv[1],
        callbacks=[
            ModelCheckpoint(dirpath=sys.argv[1] + "/checkpoints", save_last=True, every_n_train_steps=100),
            HangWatchdog(timeout_minutes=3 / 60, poll_seconds=0.2, checkpoint_seconds=60),
        ],
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=2))
""")


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_within_the_watchdogs_time_with_last_ckpt(tmp_path):
    ranks = start_two_ranks(HANG_SCRIPT, tmp_path)
    try:
        output1 = ""
        # A guard under the 10 min collective timeout; start-up takes 20 s to minutes on a busy machine.
        deadline = time.monotonic() + 540
        for line in iter(ranks[1].stdout.readline, ""):
            output1 += line
            if "rank 1 hangs" in line:
                break
        hung_at = time.monotonic()
        output0, _ = ranks[0].communicate(timeout=max(1.0, deadline - time.monotonic()))
        rest1, _ = ranks[1].communicate(timeout=max(1.0, deadline - time.monotonic()))
        output1 += rest1
        ended_after = time.monotonic() - hung_at
        assert ranks[0].returncode == 1, output0[-3000:]
        assert ranks[1].returncode == 1, output1[-3000:]
        assert "rlver: rank 1: no progress for" in output1
        assert "in training step 4 (rollouts) (HangWatchdog timeout_minutes=0.05)" in output1
        assert "rlver: rank 0: no progress for" in output0
        assert f"wrote {tmp_path}/checkpoints/last.ckpt" in output0  # rank 0 holds the whole state
        assert (tmp_path / "checkpoints" / "last.ckpt").exists()
        assert ended_after < 60, ended_after
    finally:
        for process in ranks:
            process.kill()
            process.wait()


def test_the_emergency_save_keeps_a_live_main_thread_out_of_the_update_until_written(tmp_path):
    """Issue 54: the phase check and the dump were not atomic with `rollouts_done`, so a slow but
    live main thread could start changing the weights while the watchdog wrote them."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import SingleDeviceStrategy

    watch = HangWatchdog(timeout_minutes=1)
    watch.checkpoint = CollectiveFreeCheckpoint()
    watch.progress("training step 3 (rollouts)")
    dumping, events = threading.Event(), []

    def dump_checkpoint(weights_only):
        dumping.set()
        time.sleep(0.5)  # the state is read while the main thread would begin its update
        events.append("state dumped")
        return {"global_step": 2}

    trainer = SimpleNamespace(
        strategy=SingleDeviceStrategy(device="cpu"),
        global_rank=0,
        global_step=2,
        checkpoint_callback=ModelCheckpoint(dirpath=tmp_path, save_last=True),
        _checkpoint_connector=SimpleNamespace(dump_checkpoint=dump_checkpoint),
    )
    saver = threading.Thread(target=lambda: events.append(watch.write_share(trainer)))
    saver.start()
    assert dumping.wait(10)
    watch.rollouts_done()  # the main thread reaches its update
    events.append("update begins")
    saver.join(10)
    assert events == ["state dumped", "written at step 2", "update begins"]
    assert (tmp_path / "last.ckpt").is_file()
    assert watch.phase == "training step 3 (update)"


# --------------------------------------------------------------------------- what healthy looks like
def test_the_default_timeout_outlasts_the_simulators_worst_request():
    """Issue 54 (3): a sage request may retry for 12 min (5 x 120 s + 4 x 30 s); a dead endpoint
    must stop the run the clean way (the simulator gives up, last.ckpt, `rlver fit` says why),
    not by the watchdog, which under FSDP writes no checkpoint. On a fake clock: an outage as long
    as the simulator's budget passes; the watchdog fires only once that budget is exceeded."""
    from rlver_plugins.sage_user.simulator import SageUserSimulator

    user = SageUserSimulator(base_url="http://127.0.0.1:9/v1", model="m", timeout=120)  # ppo_think's
    worst = user.worst_request_seconds()
    assert worst > HangWatchdog.DEFAULT_MINUTES * 60  # the old fixed default ended such runs
    module = SimpleNamespace(expected_quiet_seconds=lambda: worst)
    watchdog = HangWatchdog()
    watchdog.fit_module(module)
    clock = watchdog.clock
    clock.arm(0.0)
    clock.check(0.0)  # the last turn's mark, seen
    assert clock.check(worst + 1.0) is None  # the retries' whole budget, and a turn's work after
    assert clock.check(worst + HangWatchdog.MARGIN_SECONDS + 1.0) is not None
    # Set by hand, it stays as set; without a simulator bound, the default is 10 minutes.
    assert HangWatchdog(timeout_minutes=5).timeout_seconds == 300
    mine = HangWatchdog(timeout_minutes=5)
    mine.fit_module(module)
    assert mine.timeout_seconds == 300
    unbounded = HangWatchdog()
    unbounded.fit_module(SimpleNamespace(expected_quiet_seconds=lambda: None))
    assert unbounded.timeout_seconds == 600


def test_the_rlver_module_reports_its_simulators_worst_request_as_its_quiet_time():
    from rlver.train.module import RLVERModule

    sage = {"name": "sage", "base_url": "http://127.0.0.1:9/v1", "model": "m", "timeout": 60}
    module = RLVERModule(simulator=sage)
    assert module.expected_quiet_seconds() == module.simulator.worst_request_seconds() > 0
    assert RLVERModule(simulator={"name": "embedded", "judge": "rubric"}).expected_quiet_seconds() is None


def test_a_checkpoint_write_has_its_own_allowance_and_ends_with_the_next_phase():
    """Issue 54 (3): ppo_think writes ~2 x 176 GB at a checkpoint step, with no turn or batch."""
    watchdog = HangWatchdog(timeout_minutes=10, checkpoint_minutes=30)
    trainer = SimpleNamespace(
        callbacks=[watchdog], world_size=1, global_step=100, state=SimpleNamespace(fn="fit")
    )
    watchdog.on_train_batch_end(trainer, None, None, None, 99)
    watchdog.on_save_checkpoint(trainer, None, {})
    assert watchdog.phase == "writing a checkpoint at step 100"
    start = watchdog.clock.last_progress
    watchdog.clock.check(start)  # the write's start, seen
    assert watchdog.clock.check(start + 30 * 60) is None  # past the timeout, within the write's allowance
    assert watchdog.clock.check(start + 40 * 60 + 1) is not None
    watchdog.on_train_batch_start(trainer, None, None, 100)  # the next step: the usual timeout again
    assert watchdog.clock.extra_seconds == 0


def test_validation_and_overlapped_turns_are_progress(tiny_model_dir):
    """Issue 54 (3): validation rollouts and the overlapped mode's rollouts ahead take no
    `should_stop`, so their turns marked nothing: a long evaluation against a slow user ended a
    healthy run. Both runners now get an `on_turn` that marks each turn."""
    from rlver.data.profiles import load_profile_sets
    from rlver.rollout.overlap import background_run
    from rlver.rollout.runner import RolloutSettings
    from rlver.train.module import RLVERModule

    watchdog = HangWatchdog()
    module = RLVERModule(
        policy=str(tiny_model_dir),
        simulator={"name": "embedded", "judge": "rubric"},
        rollout=RolloutSettings(max_turns=2, max_new_tokens=4),
    )
    module.setup("validate")
    module._trainer = SimpleNamespace(callbacks=[watchdog])
    profiles = load_profile_sets(["builtin:en_test"])[:2]
    before = watchdog.clock.marks
    trajectories = module.evaluation_rollouts(profiles, seed=0)
    turns = max(t.num_turns for t in trajectories)
    assert watchdog.clock.marks - before >= turns >= 1
    before = watchdog.clock.marks
    run = background_run(module.runner, profiles, 0, 1, turn_progress(module._trainer))
    run({})
    assert watchdog.clock.marks > before
