"""Training end to end on CPU with the real SmolLM2: GRPO, PPO + critic, resume, export, direction."""

import json
import math
import textwrap

import pytest
import torch

from rlver.modeling.batch import token_logprobs
from rlver.train.module import PPOSettings, actor_loss
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def read_scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def write_config(
    tmp_path, algorithm, max_steps, engine="hf", precision="bf16-mixed", ppo="micro_batch_size: 2"
):
    """Checkpoints every 2 steps: with `save_last` a run also saves its final step (GracefulStop),
    so each test still reads the state it asks for, with fewer 1.6-3.2 GB writes on the way."""
    root = tmp_path / "run"
    config = tmp_path / f"{algorithm}.yaml"
    advantage, group_size = ("grpo", 2) if algorithm == "grpo" else ("gae", 1)
    config.write_text(
        textwrap.dedent(f"""
        seed_everything: 0
        trainer:
          accelerator: cpu
          devices: 1
          precision: {precision}
          max_steps: {max_steps}
          limit_val_batches: 0
          log_every_n_steps: 1
          enable_progress_bar: false
          default_root_dir: {root}
          logger:
            class_path: lightning.pytorch.loggers.TensorBoardLogger
            init_args: {{save_dir: {root}, name: tb, version: ""}}
          callbacks:
            - class_path: lightning.pytorch.callbacks.ModelCheckpoint
              init_args: {{dirpath: {root}/checkpoints, save_last: true, save_top_k: 0, every_n_train_steps: 2}}
        model:
          engine: {engine}
          advantage: {advantage}
          group_size: {group_size}
          rewards: [final_emotion, {{name: emotion_gain, weight: 0.5}}]
          rollout: {{max_turns: 2, max_new_tokens: 12}}
          ppo: {{{ppo}}}
          actor_lr: 1.0e-5
          log_samples_every_n_steps: 1
        data:
          batch_size: {1 if algorithm == "grpo" else 2}
    """)
    )
    return config, root


def fit(config, *extra):
    result = run_cli("fit", "--config", config, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


EXPECTED_SCALARS = [
    "reward/total",
    "reward/final_emotion",
    "reward/emotion_gain",
    "rollout/final_emotion",
    "rollout/success_rate",
    "rollout/failure_rate",
    "rollout/turns",
    "rollout/reply_tokens",
    "rollout/format_violation_rate",
    "rollout/logprob_gap",
    "ppo/policy_loss",
    "ppo/entropy",
    "ppo/clip_fraction",
    "ppo/approx_kl",
    "ppo/grad_norm",
    "perf/rollout_seconds",
    "perf/simulator_seconds",
    "perf/update_seconds",
    "perf/rollout_tokens_per_second",
    "perf/update_tokens_per_second",
    "gaming/repeat_share",
    "gaming/copy_share",
    "gaming/cut_share",
    "gaming/distinct_2",
    "gaming/top_opening_share",
]


def test_grpo_fit_with_vllm_two_steps_then_resume_from_last(tmp_path):
    """GRPO on the real SmolLM2 with the vLLM engine (float32 on both sides): after every update,
    and after a resume, the weights are pushed into vLLM and its log-probs keep matching the
    trainer's; then rollouts from the checkpoint with both engines, and export.

    (One run serves what were two tests of the same shape: this and the vLLM-follows check; its
    learning rate decays linearly, to check the schedule's wiring and the logged rate.)"""
    engine = "{name: vllm, dtype: float32, cpu_kv_cache_gib: 0.5}"
    config, root = write_config(tmp_path, "grpo", max_steps=2, engine=engine, precision="32-true")
    fit(config, "--model.lr_schedule", "linear", "--model.min_lr_ratio", "0.5")
    scalars = read_scalars(root / "tb")
    # Each step's own rate: 1e-5, then half-way to the floor of 0.5 x 1e-5 at max_steps.
    assert [rate for _, rate in scalars["ppo/actor_lr"]] == pytest.approx([1e-5, 0.75e-5])
    for tag in [*EXPECTED_SCALARS, "advantage/degenerate_group_fraction", "perf/weight_sync_seconds"]:
        assert tag in scalars, tag
        assert [step for step, _ in scalars[tag]] == [0, 1], tag
        assert all(math.isfinite(v) for _, v in scalars[tag]), tag
    gaps = [value for _, value in scalars["rollout/logprob_gap"]]
    assert max(gaps) < 1e-3, gaps  # step 1 sampled after an update
    assert all(seconds > 0 for _, seconds in scalars["perf/weight_sync_seconds"])
    transcripts = [
        json.loads(line) for line in (root / "tb" / "rollouts" / "train_rank0.jsonl").read_text().splitlines()
    ]
    assert [t["step"] for t in transcripts] == [0, 0, 1, 1]
    assert transcripts[0]["profile_id"] == transcripts[1]["profile_id"]  # a group shares its profile
    last = root / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 2

    fit(
        config,
        "--trainer.max_steps",
        "3",
        "--ckpt_path",
        "last",
        "--model.lr_schedule",
        "linear",
        "--model.min_lr_ratio",
        "0.5",
    )
    gaps = [value for _, value in read_scalars(root / "tb")["rollout/logprob_gap"]]
    assert len(gaps) == 3 and max(gaps) < 1e-3, gaps  # step 2: vLLM got the resumed weights
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 3
    assert "rlver_rng" in checkpoint and len(checkpoint["optimizer_states"]) == 1
    steps = [
        json.loads(line)["step"]
        for line in (root / "tb" / "rollouts" / "train_rank0.jsonl").read_text().splitlines()
    ]
    assert steps == [0, 0, 1, 1, 2, 2]  # the resumed run continued at step 2

    evaluate = (
        "rollout",
        "--config",
        config,
        "--ckpt",
        last,
        "--limit",
        "1",
        "--model.rollout.temperature",
        "0",
    )
    result = run_cli(*evaluate, "--out", tmp_path / "eval.jsonl", "--model.engine", "hf")
    assert result.returncode == 0, result.stderr[-2000:]
    (evaluated,) = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert evaluated["model"].endswith(f"@{last}")
    # vLLM keeps its own copy of the weights: it must talk with the checkpoint's policy too.
    vllm_engine = "{name: vllm, dtype: float32, cpu_kv_cache_gib: 0.5}"
    result = run_cli(*evaluate, "--out", tmp_path / "v.jsonl", "--model.engine", vllm_engine)
    assert result.returncode == 0, result.stderr[-2000:]
    (with_vllm,) = [json.loads(line) for line in (tmp_path / "v.jsonl").read_text().splitlines()]
    assert [t["text"] for t in with_vllm["turns"]] == [t["text"] for t in evaluated["turns"]]

    out = tmp_path / "exported"
    result = run_cli("export", "--ckpt", last, "--out", out)
    assert result.returncode == 0, result.stderr
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out)
    state = {
        k[len("policy_model.") :]: v
        for k, v in checkpoint["state_dict"].items()
        if k.startswith("policy_model.")
    }
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(exported.state_dict()[name], state[name])


def test_ppo_with_critic_and_kl_to_a_reference_one_step(tmp_path):
    ppo = "micro_batch_size: 2, kl_coef: 0.05, kl_estimator: k3, kl_mode: in-loss"
    # `auto`: bf16-mixed where the CPU has native bf16, 32-true where bf16 would be emulated
    # (3.5x the time on an AVX2-only CPU: 196 s); this test is about the critic and the reference.
    config, root = write_config(tmp_path, "ppo", max_steps=1, ppo=ppo, precision="auto")
    fit(config)
    scalars = read_scalars(root / "tb")
    tags = [
        *EXPECTED_SCALARS,
        "ppo/value_loss",
        "ppo/critic_grad_norm",
        "ppo/critic_lr",
        "ppo/kl",
        "ppo/kl_loss",
    ]
    for tag in tags:
        assert tag in scalars and all(math.isfinite(v) for _, v in scalars[tag]), tag
    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert any(k.startswith("value_model.value_head") for k in checkpoint["state_dict"])
    assert len(checkpoint["optimizer_states"]) == 2  # actor and critic
    assert not any(
        k.startswith("_reference") for k in checkpoint["state_dict"]
    )  # the frozen reference is not saved
    assert abs(scalars["ppo/kl"][0][1]) < 1e-3  # the policy starts as the reference


def test_one_update_moves_log_probs_in_the_advantage_direction(policy):
    """Positively advantaged sampled tokens become likelier, negatively advantaged ones less likely."""
    model = policy.model
    tokenizer = policy.tokenizer
    texts = ["I hear how hard this week has been for you.", "Whatever, just deal with it yourself."]
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, encoded))
    ids = torch.tensor([e + [tokenizer.pad_token_id] * (width - len(e)) for e in encoded])
    attention = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in encoded])
    mask = attention.clone()
    mask[:, 0] = 0  # the first token is context, not an action
    advantages = torch.tensor([[1.0], [-1.0]]).expand_as(mask) * mask
    original = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            before = token_logprobs(model(input_ids=ids, attention_mask=attention).logits, ids)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        loss, stats = actor_loss(
            model, ids, attention, mask, before * mask, advantages, None, PPOSettings(entropy_coef=0.0)
        )
        assert stats["clip_fraction"] == 0.0 and abs(stats["approx_kl"]) < 1e-6  # ratio 1 at the old policy
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            after = token_logprobs(model(input_ids=ids, attention_mask=attention).logits, ids)
        change = ((after - before) * mask).sum(dim=1) / mask.sum(dim=1)
        assert change[0] > 0 and change[1] < 0
    finally:
        model.load_state_dict(original)
        model.zero_grad(set_to_none=True)
