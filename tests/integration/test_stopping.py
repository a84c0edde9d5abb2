"""The first SIGTERM or Ctrl-C stops `rlver fit` within a step, with a checkpoint that resumes."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections import Counter

import pytest

from rlver.checkpoint.io import read_checkpoint_state
from tests.integration.test_multiprocess import launch, lay_out_data, run_fit, twin_config

pytestmark = pytest.mark.slow


def transcript_steps(path):
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def stop_after_first_step(process, transcripts, which):
    """Signal the run once a step has finished; its output and the steps finished by then.

    The time limits only catch a hang: whether it stopped in time is read from the steps.
    """
    deadline = time.monotonic() + 1200
    while not transcript_steps(transcripts):
        assert process.poll() is None, process.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no step finished"
        time.sleep(0.2)
    finished = len(set(transcript_steps(transcripts)))
    process.send_signal(which)
    try:
        output, _ = process.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("the run did not stop after the first signal")
    return output, finished


@pytest.mark.parametrize(
    ("recipe", "devices", "which"),
    [
        ("quickstart_hard", 1, signal.SIGTERM),
        ("quickstart_hard", 1, signal.SIGINT),
        ("grpo_nothink", 2, signal.SIGTERM),  # sent to rank 0 only: both ranks stop together
    ],
)
def test_first_signal_checkpoints_and_stops_then_the_run_resumes(
    recipe, devices, which, tmp_path, tiny_model_dir
):
    from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

    with ScriptedServer(Script()) as server:
        lay_out_data(tmp_path)
        config = twin_config(recipe, tmp_path, tiny_model_dir, server.url, steps=500, devices=devices)
        run = tmp_path / "runs" / recipe
        transcripts = run / "tensorboard" / "rollouts" / "train_rank0.jsonl"
        output, finished = stop_after_first_step(launch(tmp_path, config), transcripts, which)
        assert f"stopped by {which.name}" in output, output[-3000:]
        checkpoint = run / "checkpoints" / "last.ckpt"
        stopped_at = read_checkpoint_state(checkpoint)["global_step"]
        assert 1 <= finished <= stopped_at <= finished + 1  # within the step it was in
        # Every finished step is in the transcripts once; a step cut short left nothing.
        per_step = Counter(transcript_steps(transcripts))
        assert sorted(per_step) == list(range(stopped_at)) and len(set(per_step.values())) == 1

        run_fit(tmp_path, "--config", config, "--ckpt_path", "last", "--trainer.max_steps", stopped_at + 1)
        assert read_checkpoint_state(checkpoint)["global_step"] == stopped_at + 1
        resumed = Counter(transcript_steps(transcripts))
        assert sorted(resumed) == list(range(stopped_at + 1)) and set(resumed.values()) == set(
            per_step.values()
        )


def test_a_run_ending_between_checkpoints_leaves_last_ckpt_at_its_final_step(tmp_path, tiny_model_dir):
    """max_steps (or max_time) off the checkpoint interval: last.ckpt still holds the final state."""
    import yaml

    config = twin_config("quickstart", tmp_path, tiny_model_dir, "", steps=3, devices=1)
    twin = yaml.safe_load(config.read_text())
    checkpoint = next(c for c in twin["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint"))
    checkpoint["init_args"]["every_n_train_steps"] = 2
    twin["trainer"]["callbacks"] = [checkpoint]
    config.write_text(yaml.safe_dump(twin))
    run_fit(tmp_path, "--config", config)
    folder = tmp_path / "runs" / "quickstart" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]
    assert read_checkpoint_state(folder / "last.ckpt")["global_step"] == 3
