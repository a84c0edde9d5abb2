"""What a cluster run depends on before its first step: ranks, timeouts, the engine's device and options."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
import torch
from rlver_plugins.sage_user.client import EndpointSettings
from rlver_plugins.vllm_engine.engine import check_engine_device, engine_options

from rlver.data.profiles import ProfileError, load_profiles
from rlver.train.trainer import launcher_global_rank, wait_for_processes, widen_collective_timeout


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({}, 0),
        ({"LOCAL_RANK": "0"}, 0),
        ({"LOCAL_RANK": "0", "RANK": "8"}, 8),  # torchrun, second node: no NODE_RANK
        ({"LOCAL_RANK": "0", "SLURM_PROCID": "16"}, 16),  # SLURM
        ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, 1),  # Lightning's launcher on a second node
        ({"LOCAL_RANK": "3"}, 3),  # a process Lightning's launcher started
        ({"RANK": "0", "LOCAL_RANK": "0"}, 0),
    ],
)
def test_only_the_jobs_first_process_counts_as_rank_zero(env, rank):
    assert (launcher_global_rank(env) == 0) == (rank == 0)
    if "RANK" in env or "SLURM_PROCID" in env:
        assert launcher_global_rank(env) == rank


def test_the_launching_rank_waits_for_every_rank_it_started_and_reports_the_failed_ones():
    """Lightning's launcher leaves its child ranks running when rank 0 returns."""
    done = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert wait_for_processes([done, failed], timeout_seconds=600) == {2: 3}  # each waited for
    assert done.returncode == 0
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    assert wait_for_processes([hung], timeout_seconds=0.5) == {1: -9}  # killed at the deadline
    assert wait_for_processes([], timeout_seconds=0) == {}


def test_the_paper_recipes_dead_endpoint_is_given_up_on_before_the_collectives_time_out():
    """ppo_think's user: timeout 120 s, 4 retries, backoff up to 30 s, 8 failures in a row."""
    from lightning.pytorch.strategies import DDPStrategy

    settings = EndpointSettings(base_url="http://127.0.0.1:9/v1", model="m", timeout=120)
    assert settings.worst_request_seconds() == 5 * 120 + 4 * 30
    assert settings.seconds_until_given_up() == 8 * 720  # 96 min: past torch's 30 min default
    assert EndpointSettings(base_url="u", model="m", max_failures_in_a_row=0).seconds_until_given_up() is None
    strategy = DDPStrategy()
    assert strategy._timeout == timedelta(minutes=30)
    assert widen_collective_timeout(strategy, 8 * 720 + 600)
    assert strategy._timeout == timedelta(seconds=8 * 720 + 600)
    assert not widen_collective_timeout(strategy, 60)  # never shortened
    assert strategy._timeout == timedelta(seconds=8 * 720 + 600)


def test_the_module_asks_for_the_simulators_bound_plus_a_margin(monkeypatch):
    from rlver.train.module import RLVERModule

    monkeypatch.setenv("RLVER_TEST_KEY", "not-a-secret")
    user = {
        "name": "sage",
        "base_url": "http://127.0.0.1:9/v1",
        "model": "m",
        "api_key_env": "RLVER_TEST_KEY",
    }
    module = RLVERModule(simulator={**user, "timeout": 120})
    assert module.collective_timeout_seconds() == 8 * 720 + 600
    assert RLVERModule(simulator={"name": "embedded", "judge": "rubric"}).collective_timeout_seconds() is None


def test_cuda_graphs_are_on_by_default_on_gpus_and_off_on_cpus():
    common = dict(
        dtype="bfloat16",
        enable_prefix_caching=True,
        max_model_len=None,
        gpu_memory_utilization=0.8,
        tensor_parallel_size=1,
        sleep=True,
        cpu_kv_cache_bytes=2 * 2**30,
    )
    gpu = engine_options("m", cuda=True, enforce_eager=None, **common)
    cpu = engine_options("m", cuda=False, enforce_eager=None, **common)
    assert gpu["enforce_eager"] is False and gpu["enable_sleep_mode"] is True
    assert cpu["enforce_eager"] is True and cpu["enable_chunked_prefill"] is False
    assert "gpu_memory_utilization" not in cpu
    assert cpu["kv_cache_memory_bytes"] == 2 * 2**30  # as given; GPUs size theirs by a fraction
    assert "kv_cache_memory_bytes" not in gpu
    quarter = engine_options("m", cuda=False, enforce_eager=None, **{**common, "cpu_kv_cache_bytes": 2**28})
    assert quarter["kv_cache_memory_bytes"] == 2**28
    assert gpu["skip_tokenizer_init"] is cpu["skip_tokenizer_init"] is True  # ids in, ids out
    assert engine_options("m", cuda=True, enforce_eager=True, **common)["enforce_eager"] is True


def test_an_engine_on_another_gpu_than_its_rank_is_refused():
    check_engine_device(launcher_local_rank=1, trainer_device=1, rank=1)
    with pytest.raises(ValueError, match=r"LOCAL_RANK \(0\) is not the GPU the trainer uses \(cuda:2\)"):
        check_engine_device(launcher_local_rank=0, trainer_device=2, rank=0)


def test_a_missing_official_profile_file_says_where_it_comes_from(tmp_path):
    with pytest.raises(
        ProfileError, match="train_profile.jsonl: profile file not found .*RLVER/data.*data/rlver/"
    ):
        load_profiles(tmp_path / "data" / "rlver" / "train_profile.jsonl")
    with pytest.raises(ProfileError, match=r"mine.jsonl: profile file not found$"):
        load_profiles(tmp_path / "mine.jsonl")


def test_a_gpu_weight_sync_wakes_the_weights_streams_them_then_wakes_the_kv_cache(tiny_model_dir):
    """The order of sleep and wake calls around a sync, which only CUDA builds of vLLM carry out
    (on CPU sleep mode is off): a recording stand-in for `vllm.LLM`, the real policy and gather."""
    from rlver_plugins.vllm_engine.engine import VLLMEngine
    from transformers import AutoModelForCausalLM

    from rlver.modeling.models import Policy

    calls = []

    class Worker:
        def reload_weights(self, weights_iterator):  # the worker's own entry point (config context)
            names = [name for name, _ in weights_iterator]
            calls.append(("reload", len(names)))

    class RecordingLLM:
        def sleep(self, level):
            calls.append(("sleep", level))

        def wake_up(self, tags):
            calls.append(("wake_up", tags))

        def collective_rpc(self, function):
            function(Worker())

        def reset_prefix_cache(self):
            calls.append(("reset_prefix_cache",))

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = object.__new__(VLLMEngine)
    engine.policy = Policy(model=model, tokenizer=None, path=str(tiny_model_dir), name="tiny")
    engine.llm, engine.weight_dtype, engine.tensor_parallel_size = RecordingLLM(), torch.bfloat16, 1
    engine.sync_every_step, engine.sleep_between_rollouts, engine._asleep, engine.weights_version = (
        True,
        True,
        set(),
        0,
    )
    engine._sync_pending = False
    engine.release_memory()
    engine.sync_weights()
    assert calls == [("sleep", 2)]  # weights and KV cache dropped; the sync waits for the next generation
    assert engine._sync_pending  # (tests/unit/test_engine_memory_order.py follows it through a generation)
    engine._reload_weights()  # what the next generation does first
    engine._wake(None)
    parameters = len(dict(model.named_parameters(remove_duplicate=False)))  # the tied head by name too
    assert calls == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("reload", parameters),
        ("reset_prefix_cache",),
        ("wake_up", ["kv_cache"]),
    ]
    calls.clear()
    engine.sync_every_step = False  # weights must survive the sleep: level 1
    engine.release_memory()
    assert calls == [("sleep", 1)]
