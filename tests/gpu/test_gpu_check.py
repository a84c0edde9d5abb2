"""tests/gpu/gpu_check.py: its pieces by hand, and its CPU smoke run end to end (slow).

The GPU run itself cannot run here; these tests make sure the script that a borrowed GPU
machine runs works: the configs differ from the paper recipes only where a one-GPU check must,
the tokenizer round-trips every id, the gaps are bucketed by position, failed checks fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import yaml

from tests.conftest import REPO, start_rlver

sys.path.insert(0, str(REPO / "tests" / "gpu"))

import gpu_check
from gpu_check_parts import TIE_BREAK, bucket_gaps, tie_breaking_reward, word_tokenizer

# What the check may change in a recipe; everything else (numerics, optimizer, PPO settings,
# precision, strategy, format, advantage) must stay as the paper recipe has it.
ALLOWED = {
    "trainer.devices",
    "trainer.num_nodes",
    "trainer.max_steps",
    "trainer.limit_val_batches",
    "trainer.enable_progress_bar",
    "trainer.default_root_dir",
    "trainer.callbacks",
    "model.policy",
    "model.engine",
    "model.simulator",
    "model.rollout.max_turns",
    "model.rollout.max_new_tokens",
    "model.rollout.max_context_tokens",
    "data.train_files",
    "data.val_files",
    "data.test_files",
    "data.batch_size",
    "data.profiles_per_step",
}


def flatten(tree, prefix=""):
    if isinstance(tree, dict) and prefix not in ("model.engine", "model.simulator"):
        out = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: tree}


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_gpu_configs_change_only_the_model_lengths_data_and_simulator(algorithm, tmp_path):
    recipe = flatten(yaml.safe_load(gpu_check.RECIPES[algorithm].read_text()))
    config = flatten(
        gpu_check.run_config(
            algorithm, tmp_path / "m", tmp_path, smoke=False, checkpoint=True, steps=1, reply_tokens=1024
        )
    )
    changed = {key for key in recipe.keys() | config.keys() if recipe.get(key) != config.get(key)}
    assert changed <= ALLOWED, changed - ALLOWED
    assert config["model.dtype"] == "float32" and config["trainer.precision"] == "bf16-mixed"
    assert config["model.actor_lr"] == 1e-6 and config["model.ppo.micro_batch_size"] == 2
    assert config["model.gradient_checkpointing"] is True
    assert config["trainer.strategy.init_args.sharding_strategy"] == "FULL_SHARD"
    assert config["model.engine"]["name"] == "hf"
    assert config["model.simulator"] == {"name": "embedded", "judge": "rubric"}


def test_the_grpo_run_breaks_tied_rewards_and_the_ppo_run_does_not(tmp_path):
    from types import SimpleNamespace

    from rlver.train.scoring import score_dialogues

    def probe_args(algorithm):
        config = gpu_check.run_config(
            algorithm, tmp_path / "m", tmp_path, smoke=False, checkpoint=True, steps=1, reply_tokens=8
        )
        (probe,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("PhaseProbe")]
        return probe["init_args"]

    assert probe_args("grpo")["tie_break"] is True and probe_args("ppo")["tie_break"] is False
    group = [SimpleNamespace(num_turns=2, final_emotion=50.0) for _ in range(4)]  # a random model's group

    def tied(trajectories):
        return [t.final_emotion for t in trajectories]

    alone = score_dialogues([("final_emotion", 1.0, tied)], group, {}).sum(dim=1)
    assert alone.std() == 0  # GRPO's advantages: all 0, only the entropy term would move the weights
    broken = score_dialogues([("final_emotion", 1.0, tied), (TIE_BREAK, 1.0, tie_breaking_reward)], group, {})
    assert len(set(broken.sum(dim=1).tolist())) == 4


def test_smoke_configs_are_the_only_32_true_ones(tmp_path):
    smoke = gpu_check.run_config(
        "ppo", tmp_path, tmp_path, smoke=True, checkpoint=False, steps=1, reply_tokens=8
    )
    assert smoke["trainer"]["precision"] == "32-true" and smoke["trainer"]["accelerator"] == "cpu"
    assert smoke["trainer"]["enable_checkpointing"] is False


def test_the_word_tokenizer_round_trips_every_id_and_renders_chatml():
    tokenizer = word_tokenizer(512)
    assert len(tokenizer) == 512 and tokenizer.eos_token_id == 510 and tokenizer.pad_token_id == 508
    ids = list(range(0, 508, 7))
    assert tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] == ids
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "w5 w6"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nw5 w6<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == [509, 511, 5, 6, 510, 509, 511]


def test_gaps_are_bucketed_by_position_in_the_sequence():
    length = 2100
    trainer = torch.zeros(2, length)
    engine = torch.zeros(2, length)
    mask = torch.zeros(2, length, dtype=torch.long)
    mask[0, [3, 600, 2050]] = 1
    mask[1, [10, 2099]] = 1
    engine[0, 3], engine[0, 600], engine[0, 2050] = 0.1, -0.2, 0.5
    engine[1, 10], engine[1, 2099] = 0.3, 0.25
    engine[1, 11] = 9.0  # off the mask: not a sampled token
    gaps = bucket_gaps(trainer, engine, mask)
    assert gaps["0-511"]["max"] == pytest.approx(0.3) and gaps["0-511"]["tokens"] == 2
    assert gaps["512-2047"] == {"max": pytest.approx(0.2), "mean": pytest.approx(0.2), "tokens": 1}
    assert gaps["2048+"]["max"] == pytest.approx(0.5) and gaps["2048+"]["mean"] == pytest.approx(0.375)
    mask[0, 600] = 0
    assert bucket_gaps(trainer, engine, mask)["512-2047"] is None


def test_bf16_masters_and_bf16_buffers_fail_the_check(tmp_path):
    weights = {"trained": 1000, "changed": 20, "with_gradient": 1000, "changed_with_gradient": 20}
    record = {"weights": weights, "inv_freq_dtypes": ["torch.bfloat16"]}
    cells, failures = gpu_check.check_run(record, 0, 1.0, tmp_path / "fit.log")
    assert cells["changed"] == pytest.approx(0.02)
    assert len(failures) == 2 and "changed 0.02" in failures[0] and "bfloat16" in failures[1]
    weights.update(changed_with_gradient=999, changed=999)
    record["inv_freq_dtypes"] = ["torch.float32"]
    assert gpu_check.check_run(record, 0, 1.0, tmp_path / "fit.log")[1] == []
    assert "exit 1" in gpu_check.check_run(None, 1, 1.0, tmp_path / "fit.log")[1][0]


def test_the_script_runs_as_a_program_and_refuses_cuda_without_it():
    result = subprocess.run(
        [sys.executable, "tests/gpu/gpu_check.py", "--device", "cuda", "--out", "/dev/null"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "CUDA is not available" in result.stderr and "--device cpu --smoke" in result.stderr


@pytest.mark.slow
def test_the_cpu_smoke_run_prints_one_row_per_shape_and_algorithm(tmp_path, monkeypatch):
    """The script's main, its 4 one-process `rlver fit` runs started through the suite's warm
    launcher one at a time (as fresh interpreters: 55 s of CPU alone against 27 s warm)."""

    def run_warm(cmd, log, timeout, smoke):
        assert cmd[:3] == [sys.executable, "-m", "rlver.cli"], cmd
        # The script's environment, less two variables read at import that would send each launch
        # to a fresh interpreter: OpenMP threads stay the suite's, and HF_HUB_OFFLINE changes
        # nothing here (the models are local folders; nothing is downloaded either way).
        env = gpu_check.child_env(smoke)
        for name in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE"):
            env.pop(name)
            if name in os.environ:
                env[name] = os.environ[name]
        started = time.perf_counter()
        process = start_rlver(cmd[3:], cwd=log.parent, env=env, new_session=True)
        output, _ = process.communicate(timeout=max(timeout, 1))
        log.write_text(output)
        return process.returncode, time.perf_counter() - started

    monkeypatch.setattr(gpu_check, "run_logged", run_warm)
    out = tmp_path / "gpu_check.md"
    argv = [
        "--device",
        "cpu",
        "--smoke",
        "--jobs",
        "1",
        "--out",
        str(out),
        "--workdir",
        str(tmp_path / "work"),
    ]
    argv += ["--budget", "3600", "--run-timeout", "1800"]  # hang guards, not speed requirements
    assert gpu_check.main(argv) == 0
    report = out.read_text()
    assert "SMOKE RUN on CPU" in report and "32-true" in report
    assert "vLLM check: skipped" in report
    lines = [line for line in report.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header == gpu_check.HEADER
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]
    assert [(row["shape"].split(" (")[0], row["algorithm"]) for row in rows] == [
        ("tiny Qwen2.5-0.5B-like", "PPO"),
        ("tiny Qwen2.5-0.5B-like", "GRPO"),
        ("tiny Qwen2.5-7B-like", "PPO"),
        ("tiny Qwen2.5-7B-like", "GRPO"),
    ]
    for row in rows:
        assert row["run"] == "ok" and float(row["changed"]) >= 0.9 and row["inv_freq"] == "float32"
        assert float(row["gap 0-511"]) < 1e-4  # float32 on both sides
        assert row["gap 2048+"] == "-"  # 8-token replies never get there
        assert row["update GiB"].startswith("- / ")  # no GPU to measure; the plan's figure is there


def test_the_run_timeout_is_sized_from_the_first_gpu_runs_figures_and_the_report_says_what_is_unchecked(
    monkeypatch,
):
    """docs/gpu.md: 68 ms a decode step (hf engine, 4 rows of the 0.5B model), 37.3 s for the GRPO
    step at 256-token replies: the default run fits its timeout with a margin, 4 runs fit the 450 s
    budget, and the report names sharding (NO_SHARD at world size 1) and the positions not reached."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = gpu_check.parse_args(["--out", "x.md"])
    assert args.reply_tokens == 256
    rollout = 2 * 256 * 0.068  # 34.8 s, the measured rollout was 34.9
    assert gpu_check.run_seconds(256, 1) == pytest.approx(gpu_check.FIT_START_SECONDS + rollout + 16.0)
    assert args.run_timeout == pytest.approx(1.5 * gpu_check.run_seconds(256, 1))
    assert 4 * gpu_check.run_seconds(256, 1) < args.budget == 450.0
    lines = gpu_check.not_checked(args, runs=4)
    assert any("NO_SHARD" in line and "not checked: sharding" in line for line in lines)
    assert any("positions beyond 768" in line for line in lines)
    assert not any(line.startswith("- budget") for line in lines)
    long = gpu_check.parse_args(["--reply-tokens", "1024"])
    assert any(line.startswith("- budget") for line in gpu_check.not_checked(long, runs=4))  # 4 x 200 s
