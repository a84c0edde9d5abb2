"""Ranks that take different paths through a step, on the order of collectives a GPU run takes.

Each test is a real 2-process `rlver fit` of a paper recipe's twin (FSDP over gloo, CPU) whose
engine is `tests.harness.stand_in_vllm`: rlver's vLLM engine with sleep mode on, as on a GPU (level 2
frees the weights, the reload after an update is deferred while asleep and gathers FSDP shards
through the real `iter_full_weights`). A CPU run of vLLM never sleeps, so without the stand-in
none of these paths would run anywhere but on a GPU cluster. Run them alone with
`pytest -m ranks_diverge`.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml
from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

from rlver.checkpoint.io import read_checkpoint_state
from rlver.checkpoint.local_shards import is_local_shards_checkpoint, part_filename
from tests.conftest import REPO, run_rlver
from tests.harness.probes import digest_local_part
from tests.harness.stand_in_vllm import read_engine_records
from tests.integration.test_multiprocess import (
    API_KEY,
    FAULTY,
    digests,
    lay_out_data,
    read_scalars,
    run_fit,
    twin_config,
    two_profiles,
)

pytestmark = [pytest.mark.slow, pytest.mark.ranks_diverge]

ASLEEP: list[str] = []  # what the stand-in engine holds awake while asleep: nothing
HANG_LIMIT = 420  # seconds: a fit here takes ~40 s; before the fixes these runs hung instead


def with_callbacks(config, *callbacks):
    twin = yaml.safe_load(config.read_text())
    twin["trainer"]["callbacks"] = [*twin["trainer"]["callbacks"], *callbacks]
    config.write_text(yaml.safe_dump(twin, sort_keys=False, allow_unicode=True))
    return config


def stand_in(workdir):
    return {
        "class_path": "tests.harness.stand_in_vllm.UseStandInVLLM",
        "init_args": {"out_dir": str(workdir / "engine")},
    }


@pytest.mark.parametrize("at", ["turn 0", "mid-rollout"])
def test_a_stop_signal_on_one_rank_stops_every_rank_with_the_engine_asleep_and_resumes(
    at, tmp_path, tiny_model_dir, server
):
    """SIGTERM reaches rank 1 alone during step 2's rollout. At turn 0 rank 1 stops before it
    generates: the engine's deferred reload (an FSDP all-gather) used to run inside the first
    generation, so rank 0 waited in it while rank 1 waited in the stop agreement. Both ranks must
    agree, write `last.ckpt` at step 1 with the engine asleep (a stop's checkpoint was written with
    vLLM awake: 76 of 79.3 GiB for ppo_think), and the resumed run restores into an asleep engine."""
    lay_out_data(tmp_path)
    config = twin_config("ppo_think", tmp_path, tiny_model_dir, server.url, steps=3)
    signal = {
        "class_path": "tests.harness.probes.SignalOneRank",
        "init_args": {"rank": 1, "step": 1, "at": at},
    }
    with_callbacks(config, stand_in(tmp_path), signal)
    result = run_fit(tmp_path, "--config", config, timeout=HANG_LIMIT)
    assert "stopped by" in result.stdout + result.stderr
    checkpoint = tmp_path / "runs" / "ppo_think" / "checkpoints" / "last.ckpt"
    assert read_checkpoint_state(checkpoint)["global_step"] == 1
    for record in read_engine_records(tmp_path / "engine"):
        assert record["saved_with"] and all(held == ASLEEP for _, held in record["saved_with"]), record
        assert "generate" in record["events"] and "reload" in record["events"]
    if at == "mid-rollout":
        return
    resume = twin_config("ppo_think", tmp_path, tiny_model_dir, server.url, steps=2)
    with_callbacks(resume, stand_in(tmp_path))
    run_fit(tmp_path, "--config", resume, "--ckpt_path", "last", timeout=HANG_LIMIT)
    for record in read_engine_records(tmp_path / "engine"):
        assert record["loaded_with"] == [[1, ASLEEP]], (
            record
        )  # the optimizer state came back beside no engine
    assert [d["step"] for d in digests(tmp_path)] == [2, 2]


def test_a_rank_whose_every_dialogue_ends_at_the_opening_takes_the_reload_with_its_peer(
    tmp_path, tiny_model_dir
):
    """Rank 0's only user fails at the opening every step: it never generates. Its peer's first
    generation of step 2 used to run the deferred reload's all-gather alone: the job hung."""
    faults = {(FAULTY, "open", n): "500" for n in range(1, 200)}
    with ScriptedServer(Script(faults=faults)) as server:
        two_profiles(tmp_path)
        config = twin_config("ppo_think", tmp_path, tiny_model_dir, server.url, steps=2)
        twin = yaml.safe_load(config.read_text())
        twin["model"]["simulator"].update(backoff_seconds=0.01, backoff_max_seconds=0.02, max_retries=1)
        config.write_text(yaml.safe_dump(twin, allow_unicode=True))
        with_callbacks(config, stand_in(tmp_path))
        run_fit(tmp_path, "--config", config, "--data.shuffle", "false", timeout=HANG_LIMIT)
    per_rank = digests(tmp_path)
    assert per_rank[0]["tensors"] == per_rank[1]["tensors"]
    scalars = read_scalars(tmp_path / "runs" / "ppo_think" / "tensorboard")
    assert scalars["rollout/simulator_errors"] == [1.0, 1.0]
    records = read_engine_records(tmp_path / "engine")
    generated = ["generate" in record["events"] for record in records]
    assert sorted(generated) == [False, True]  # one rank never generated, and nothing hung
    # Both reloaded after each update (the first step too: the engine slept from the start).
    assert [record["events"].count("reload") for record in records] == [2, 2], [r["events"] for r in records]
    assert json.dumps(records)  # the records are plain data


def test_a_rank_hung_in_its_rollout_leaves_every_ranks_shards_as_last_ckpt_and_resumes_exactly(
    tmp_path, tiny_model_dir
):
    """Issue 54 (5): rank 0's user stops answering in step 3's opening; rank 1 finishes its
    rollout and waits in the stop agreement. Under FSDP the watchdog wrote no checkpoint (its
    state would need a gather no hung peer joins): now every rank writes its own shards and
    optimizer states, without a collective, rank 0 the loops' state beside them, and
    `--ckpt_path last` restores on each rank exactly what it held at the end of step 2."""
    faults = {(FAULTY, "open", 3): "timeout"}  # one opening a step, on rank 0: step 3's never ends
    with ScriptedServer(Script(faults=faults, timeout_delay=900)) as server:
        two_profiles(tmp_path)
        config = twin_config("ppo_think", tmp_path, tiny_model_dir, server.url, steps=3)
        twin = yaml.safe_load(config.read_text())
        twin["model"]["simulator"]["timeout"] = 600  # the request outlasts the watchdog
        config.write_text(yaml.safe_dump(twin, allow_unicode=True))
        watchdog = {
            "class_path": "rlver.parallel.hang_watch.HangWatchdog",
            "init_args": {"timeout_minutes": 0.5, "poll_seconds": 0.5, "checkpoint_seconds": 120},
        }
        digest = {
            "class_path": "tests.harness.probes.LocalStateDigest",
            "init_args": {"out_dir": str(tmp_path / "local"), "step": 2},
        }
        with_callbacks(config, stand_in(tmp_path), watchdog, digest)
        env = {**os.environ, "PYTHONPATH": str(REPO), "RLVER_SIMULATOR_API_KEY": API_KEY}
        argv = ["fit", "--config", str(config), "--data.shuffle", "false"]
        hung = run_rlver(argv, cwd=tmp_path, env=env, timeout=HANG_LIMIT)
        output = hung.stdout + hung.stderr
        assert hung.returncode == 1, output[-4000:]
        assert "rlver: rank 0: no progress for" in output and "in training step 3 (rollouts)" in output
        checkpoint = tmp_path / "runs" / "ppo_think" / "checkpoints" / "last.ckpt"
        named = "rlver: rank 0: wrote runs/ppo_think/checkpoints/last.ckpt (written at step 2"
        assert named in output, output[-4000:]  # the recipe's dirpath, relative to the run folder
        assert is_local_shards_checkpoint(checkpoint)
        for rank in range(2):  # each rank's file holds what it held at the end of step 2
            part = torch.load(checkpoint / part_filename(rank), weights_only=True)
            finished = json.loads((tmp_path / "local" / f"local_rank{rank}_finished.json").read_text())
            assert digest_local_part(part) == finished
        whole = read_checkpoint_state(checkpoint)
        assert whole["global_step"] == 2 and any(k.startswith("policy_model.") for k in whole["state_dict"])
        # Resumed on the same two ranks: each takes its own shards and optimizer states back.
        run_fit(
            tmp_path, "--config", config, "--data.shuffle", "false", "--ckpt_path", "last", timeout=HANG_LIMIT
        )
    for rank in range(2):
        finished, restored = (
            json.loads((tmp_path / "local" / f"local_rank{rank}_{when}.json").read_text())
            for when in ("finished", "restored")
        )
        assert restored == finished
    assert [d["step"] for d in digests(tmp_path)] == [3, 3]
    # the resumed run's own last.ckpt (a torch.distributed.checkpoint folder) names the same weights
    regular = read_checkpoint_state(checkpoint)
    assert regular["global_step"] == 3 and not is_local_shards_checkpoint(checkpoint)
    assert set(regular["state_dict"]) == set(whole["state_dict"])
