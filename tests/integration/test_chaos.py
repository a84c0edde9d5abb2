"""Crash safety: `rlver fit` killed with SIGKILL again and again resumes to the uninterrupted run.

The quickstart's miniature twin (the recipe's own checkpoint interval) talks with the `sage`
user of the scripted server through a response cache, so every kind of file a run writes is
in play: checkpoints, transcripts, TensorBoard events and the SQLite cache. It is killed at
named points (mid-rollout, mid-update, halfway through a checkpoint, halfway through a
transcript line: tests.harness.probes.Chaos) and at random moments, resumed each time with
`--ckpt_path last`, and must end exactly where a run that was never killed ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sqlite3
import time
from pathlib import Path

import pytest
import torch
import yaml

from rlver.checkpoint.io import read_checkpoint_state
from tests.conftest import REPO, run_rlver
from tests.integration.test_multiprocess import digests, launch, lay_out_data, read_scalars, twin_config

pytestmark = pytest.mark.slow

STEPS = 9
RECIPE = "quickstart"


def chaos_config(workdir: Path, model_dir: Path, server_url: str) -> Path:
    config = twin_config(RECIPE, workdir, model_dir, server_url, steps=STEPS, devices=1)
    twin = yaml.safe_load(config.read_text())
    twin["model"]["simulator"] = {
        "name": "sage",
        "base_url": server_url,
        "model": "scripted-user",
        "timeout": 5,
        "language": "en",
        "cache": "cache.sqlite",  # the working folder's: the same text in both runs' transcripts
    }
    # Bitwise equality needs each engine call to hold the same dialogues in both runs: an engine
    # call's log-probs differ in their last bits with the prompts beside them, and under the
    # `dialogue` schedule a call holds whichever users' answers came in within 50 ms, which the
    # machine's load decides (and a cached answer comes at once). `lockstep` composes every call
    # from all active dialogues, as an in-process user like the quickstart's does.
    twin["model"]["rollout"]["schedule"] = "lockstep"
    twin["trainer"]["callbacks"].append({"class_path": "tests.harness.probes.Chaos"})
    config.write_text(yaml.safe_dump(twin, sort_keys=False))
    return config


def transcript_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def finished_steps(path: Path) -> int:
    steps = set()
    for line in transcript_lines(path):
        with contextlib.suppress(ValueError):
            steps.add(json.loads(line)["step"])
    return len(steps)


def cache_rows(path: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        return sorted(db.execute("SELECT key, answer FROM answers"))


def test_sigkill_at_any_point_then_resume_equals_the_uninterrupted_run(tmp_path, tiny_model_dir):
    from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

    straight, chaos = tmp_path / "straight", tmp_path / "chaos"
    with ScriptedServer(Script()) as server:
        for workdir in (straight, chaos):
            workdir.mkdir()
            lay_out_data(workdir)
        config = chaos_config(straight, tiny_model_dir, server.url)
        every = yaml.safe_load(config.read_text())["trainer"]["callbacks"][0]["init_args"][
            "every_n_train_steps"
        ]
        assert every <= 4, "the quickstart checkpoints often enough to lose little"
        # Fresh: the runs compared differ in their string-hash seed too (warm launches share one).
        process = launch(straight, config, fresh=True)
        output, _ = process.communicate(timeout=1800)
        assert process.returncode == 0, output[-3000:]

        config = chaos_config(chaos, tiny_model_dir, server.url)
        run = chaos / "runs" / RECIPE
        transcripts = run / "tensorboard" / "rollouts" / "train_rank0.jsonl"
        checkpoint = run / "checkpoints" / "last.ckpt"
        # Each named point once (a second mid-rollout kill at step 6 only repeated the first: one
        # launch fewer), and one random moment (two cost the suite ~18 s more): 7 launches in all.
        kills = [
            "generation:1",  # before any checkpoint: the resume starts afresh
            "transcripts:2",
            f"checkpoint:{every + 1 if every < 3 else every}",
            "update:4",
            "random",
        ]
        rng = random.Random(0)
        survived = []
        for kill in kills:
            resume = ("--ckpt_path", "last") if survived else ()
            if kill == "random":
                process = launch(chaos, config, *resume)
                start = finished_steps(transcripts)
                deadline = time.monotonic() + 1200
                while finished_steps(transcripts) <= start and process.poll() is None:
                    assert time.monotonic() < deadline, "no step finished"
                    time.sleep(0.05)
                delay = rng.uniform(0.0, 1.5)
                time.sleep(delay)  # somewhere in the next step
                if process.poll() is not None:
                    break  # it finished first: nothing left to kill
                process.send_signal(signal.SIGKILL)
                kill = f"random: {delay:.2f} s after step {start} ended"  # where it landed, for a failure
            else:
                process = launch(chaos, config, *resume, chaos=kill)
            output, _ = process.communicate(timeout=1800)
            assert process.returncode == -signal.SIGKILL, (kill, output[-3000:])
            survived.append(kill)
            if checkpoint.exists():  # the previous checkpoint, never a torn one
                read_checkpoint_state(checkpoint)
        process = launch(chaos, config, "--ckpt_path", "last")
        output, _ = process.communicate(timeout=1800)
        assert process.returncode == 0, output[-3000:]
        assert len(survived) >= 4, survived  # the random kill may come after the run's end
        print("kills survived:", survived)

    # The final weights are the uninterrupted run's; if not, the message says where the two
    # runs first parted (a step's dialogues, or its update with the same dialogues).
    (a,), (b,) = digests(straight, ranks=1), digests(chaos, ranks=1)
    assert a["step"] == b["step"] == STEPS
    differing = [k for k in a["tensors"] if a["tensors"][k] != b["tensors"][k]][:5]
    assert a["tensors"] == b["tensors"], (differing, survived, first_divergence(straight, chaos))
    assert read_checkpoint_state(checkpoint)["global_step"] == STEPS
    assert torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"] == STEPS

    # Every step's transcripts exactly once, identical to the uninterrupted run's; all parseable.
    name = f"runs/{RECIPE}/tensorboard/rollouts/train_rank0.jsonl"
    expected = [json.loads(line) for line in transcript_lines(straight / name)]
    got = [json.loads(line) for line in transcript_lines(chaos / name)]
    assert sorted({r["step"] for r in got}) == list(range(STEPS))
    assert got == expected

    # TensorBoard shows each step once, with the uninterrupted run's values.
    clean = read_scalars(straight / "runs" / RECIPE / "tensorboard")
    resumed = read_scalars(chaos / "runs" / RECIPE / "tensorboard")
    for tag in ("rollout/final_emotion", "reward/total", "ppo/grad_norm", "perf/step_seconds"):
        assert len(resumed[tag]) == STEPS, (tag, resumed[tag])
        if not tag.startswith("perf/"):
            assert resumed[tag] == pytest.approx(clean[tag], abs=1e-6), tag
    steps = _scalar_steps(chaos / "runs" / RECIPE / "tensorboard", "reward/total")
    assert steps == list(range(STEPS))

    # The sage cache holds the same answers, once each, and is a sound SQLite file.
    assert cache_rows(chaos / "cache.sqlite") == cache_rows(straight / "cache.sqlite")
    # No temporary checkpoint file of a killed writer is left behind.
    assert not list((run / "checkpoints").glob(".*.tmp"))


def first_divergence(straight: Path, chaos: Path) -> str:
    """The first step whose transcripts or update scalars differ between the two runs."""
    name = f"runs/{RECIPE}/tensorboard/rollouts/train_rank0.jsonl"
    by_step: dict[str, dict[int, list[str]]] = {}
    for label, workdir in (("straight", straight), ("chaos", chaos)):
        by_step[label] = {}
        for line in transcript_lines(workdir / name):
            with contextlib.suppress(ValueError, KeyError):
                by_step[label].setdefault(json.loads(line)["step"], []).append(line)
    dialogues = [s for s in range(STEPS) if by_step["straight"].get(s) != by_step["chaos"].get(s)]
    clean = read_scalars(straight / "runs" / RECIPE / "tensorboard")
    resumed = read_scalars(chaos / "runs" / RECIPE / "tensorboard")
    updates = {
        tag: next((s for s, (x, y) in enumerate(zip(clean[tag], resumed.get(tag, []))) if x != y), None)
        for tag in ("reward/total", "ppo/policy_loss", "ppo/grad_norm")
        if tag in clean
    }
    return (
        f"first step with other dialogues: {dialogues[:1] or None}; first differing update scalars: {updates}"
    )


def _scalar_steps(folder: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return [event.step for event in accumulator.Scalars(tag)]


def test_a_full_disk_while_checkpointing_leaves_the_previous_checkpoint_usable(tmp_path, tiny_model_dir):
    """The file size limit (RLIMIT_FSIZE) makes the next checkpoint write fail as a full disk does."""
    config = twin_config(RECIPE, tmp_path, tiny_model_dir, "", steps=4, devices=1)
    twin = yaml.safe_load(config.read_text())
    twin["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] = 2
    config.write_text(yaml.safe_dump(twin, sort_keys=False))
    run = tmp_path / "runs" / RECIPE
    checkpoint = run / "checkpoints" / "last.ckpt"
    process = launch(tmp_path, config, "--trainer.max_steps", "2")
    output, _ = process.communicate(timeout=1800)
    assert process.returncode == 0, output[-3000:]
    before = checkpoint.read_bytes()
    limit = len(before) // 2  # the checkpoint cannot be written; transcripts and events still can
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLVER_CHAOS": ""}
    argv = ["fit", "--config", config, "--ckpt_path", "last"]
    result = run_rlver(argv, cwd=tmp_path, env=env, file_size_limit=limit)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("rlver fit: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "runs/quickstart/checkpoints/last.ckpt: checkpoint not written (File too large)" in errors[0], (
        errors
    )
    assert "previous checkpoint there is unchanged" in errors[0], errors
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert checkpoint.read_bytes() == before  # untouched, and it resumes
    assert not list(checkpoint.parent.glob(".*.tmp"))
    process = launch(tmp_path, config, "--ckpt_path", "last")
    output, _ = process.communicate(timeout=1800)
    assert process.returncode == 0, output[-3000:]
    assert read_checkpoint_state(checkpoint)["global_step"] == 4


def test_the_paper_recipes_keep_the_newest_checkpoints(tmp_path, tiny_model_dir):
    """Retention as the paper recipes set it (save_top_k newest by step), every step here."""
    config = twin_config("grpo_think", tmp_path, tiny_model_dir, "", steps=5, devices=1)
    twin = yaml.safe_load(config.read_text())
    (checkpointing,) = [
        c for c in twin["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint")
    ]
    assert checkpointing["init_args"]["save_top_k"] == 3 and checkpointing["init_args"]["monitor"] == "step"
    checkpointing["init_args"]["every_n_train_steps"] = 1
    twin["trainer"].update(num_sanity_val_steps=0, limit_val_batches=0, strategy="auto")
    twin["model"]["simulator"] = {"name": "embedded", "language": "zh"}
    config.write_text(yaml.safe_dump(twin, sort_keys=False, allow_unicode=True))
    lay_out_data(tmp_path)
    process = launch(tmp_path, config)
    output, _ = process.communicate(timeout=1800)
    assert process.returncode == 0, output[-3000:]
    kept = sorted(p.name for p in (tmp_path / "runs" / "grpo_think" / "checkpoints").iterdir())
    assert kept == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=5.ckpt", "last.ckpt"], kept


def test_a_kill_while_writing_a_sharded_checkpoint_keeps_the_previous_one(tmp_path, tiny_model_dir):
    """The paper recipes' FSDP checkpoints are folders of shards: written aside, swapped in whole."""
    from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

    lay_out_data(tmp_path)
    with ScriptedServer(Script()) as server:
        config = twin_config("grpo_nothink", tmp_path, tiny_model_dir, server.url, steps=2)
        twin = yaml.safe_load(config.read_text())
        (checkpointing,) = [
            c for c in twin["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint")
        ]
        checkpointing["init_args"]["every_n_train_steps"] = 1  # step 1's whole, step 2's torn
        twin["trainer"]["callbacks"].append({"class_path": "tests.harness.probes.Chaos"})
        twin["trainer"].update(num_sanity_val_steps=0, limit_val_batches=0)
        config.write_text(yaml.safe_dump(twin, sort_keys=False, allow_unicode=True))
        folder = tmp_path / "runs" / "grpo_nothink" / "checkpoints"
        process = launch(tmp_path, config, chaos="checkpoint:2", group=True)
        try:
            output, _ = process.communicate(timeout=1800)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # rank 1 waits for rank 0 forever otherwise
        assert process.returncode == -signal.SIGKILL, output[-3000:]
        assert [p.name for p in folder.glob(".*.partial")], sorted(p.name for p in folder.iterdir())
        assert read_checkpoint_state(folder / "last.ckpt")["global_step"] == 1  # the previous one, whole
        process = launch(tmp_path, config, "--ckpt_path", "last", group=True)
        try:
            output, _ = process.communicate(timeout=1800)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        assert process.returncode == 0, output[-3000:]
    assert read_checkpoint_state(folder / "last.ckpt")["global_step"] == 2
    assert not list(folder.glob(".*.partial")) and not list(folder.glob(".*.old"))


def test_overlapped_rollouts_killed_anywhere_resume_to_the_uninterrupted_run(tmp_path, tiny_model_dir):
    """`--model.overlap` with max_staleness 2: the next steps' dialogues are in flight at each
    kill (two steps' at the first); the checkpoint holds them finished (their weights are gone
    after the update), so the resumed run trains on what the uninterrupted one did: same
    weights, transcripts and staleness."""
    from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

    steps = 5
    straight, chaos = tmp_path / "straight", tmp_path / "chaos"
    with ScriptedServer(Script(latency_spec="uniform:0:0.05")) as server:
        for workdir in (straight, chaos):
            workdir.mkdir()
            lay_out_data(workdir)
            config = chaos_config(workdir, tiny_model_dir, server.url)
            twin = yaml.safe_load(config.read_text())
            twin["trainer"]["max_steps"] = steps
            twin["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] = 1
            callbacks = twin["trainer"]["callbacks"]  # without the before/after evaluation: 4 launches
            twin["trainer"]["callbacks"] = [
                c for c in callbacks if not c["class_path"].endswith("BeforeAfter")
            ]
            twin["model"]["overlap"] = {"max_importance_weight": 2.0, "max_staleness": 2}
            config.write_text(yaml.safe_dump(twin, sort_keys=False))
        process = launch(straight, straight / config.name, fresh=True)
        output, _ = process.communicate(timeout=1800)
        assert process.returncode == 0, output[-3000:]
        for index, kill in enumerate(["update:1", "checkpoint:3"]):  # torn lines: the test above
            resume = ("--ckpt_path", "last") if index else ()
            process = launch(chaos, chaos / config.name, *resume, chaos=kill)
            output, _ = process.communicate(timeout=1800)
            assert process.returncode == -signal.SIGKILL, (kill, output[-3000:])
        process = launch(chaos, chaos / config.name, "--ckpt_path", "last")
        output, _ = process.communicate(timeout=1800)
        assert process.returncode == 0, output[-3000:]

    # Every token and user answer is the uninterrupted run's, and so is every step's staleness.
    name = f"runs/{RECIPE}/tensorboard/rollouts/train_rank0.jsonl"
    assert transcript_lines(chaos / name) == transcript_lines(straight / name)
    clean = read_scalars(straight / "runs" / RECIPE / "tensorboard")
    resumed = read_scalars(chaos / "runs" / RECIPE / "tensorboard")
    # step 0 on-policy; it starts steps 1 and 2 with its weights, step 2 starts 3 and 4
    assert clean["offpolicy/staleness"] == resumed["offpolicy/staleness"] == [0.0, 1.0, 2.0, 1.0, 2.0]
    assert resumed["reward/total"] == clean["reward/total"]
    # The behaviour log-probs the engine records differ in their last bits with which dialogues
    # shared an engine call (under dialogue-level scheduling, a matter of timing), and they enter
    # the loss through the importance weights: close, not bitwise. A gradient element that is a
    # near-cancelling sum can flip sign, and Adam then moves it by up to lr either way.
    for tag in ("offpolicy/importance_weight_mean", "ppo/grad_norm", "ppo/policy_loss"):
        assert resumed[tag] == pytest.approx(clean[tag], rel=1e-4, abs=1e-6), tag
    checkpoint = Path("runs") / RECIPE / "checkpoints" / "last.ckpt"
    weights = [torch.load(w / checkpoint, weights_only=True, map_location="cpu") for w in (straight, chaos)]
    assert weights[0]["global_step"] == weights[1]["global_step"] == steps
    lr = yaml.safe_load(config.read_text())["model"]["actor_lr"]
    for key, tensor in weights[0]["state_dict"].items():
        assert (tensor - weights[1]["state_dict"][key]).abs().max() <= 2 * lr * steps, key
