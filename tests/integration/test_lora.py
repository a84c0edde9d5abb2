"""LoRA through peft: merged weights for engines and exports, the reference with the adapter off,
and `rlver fit` on the LoRA quickstart's twin (only the adapter trains, is checkpointed and exported)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlver.modeling.batch import token_logprobs
from rlver.modeling.lora import (
    LoraSettings,
    adapter_disabled,
    add_adapter,
    inference_state_dict,
    trainable_names,
)


def adapted(model_dir, seed=0):
    model = add_adapter(AutoModelForCausalLM.from_pretrained(model_dir), LoraSettings(rank=4, alpha=8))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a trained-looking adapter: B is 0 when fresh
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model


def test_settings_are_checked():
    with pytest.raises(ValueError, match="lora.rank"):
        LoraSettings(rank=0)
    with pytest.raises(ValueError, match="lora.dropout"):
        LoraSettings(dropout=1.0)
    assert LoraSettings(target_modules=["q_proj"]).target_modules == ("q_proj",)


def test_only_the_adapter_trains(tiny_model_dir):
    model = adapted(tiny_model_dir)
    names = trainable_names(model)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)


def test_merged_weights_are_what_peft_merges(tiny_model_dir):
    model = adapted(tiny_model_dir)
    ours = inference_state_dict(model)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(ours) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6)
    assert any(".lora_" in n for n in model.state_dict())  # the training model itself is untouched


def test_the_adapter_switched_off_is_the_base_model(tiny_model_dir):
    model = adapted(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with adapter_disabled(model):
            reference = token_logprobs(model(input_ids=ids).logits, ids)
        separate = token_logprobs(base(input_ids=ids).logits, ids)
        adapted_lp = token_logprobs(model(input_ids=ids).logits, ids)
    torch.testing.assert_close(reference, separate, rtol=1e-5, atol=1e-5)
    assert (adapted_lp - separate).abs().max() > 1e-3  # the adapter does change the policy


@pytest.mark.slow
def test_lora_quickstart_twin_trains_syncs_vllm_checkpoints_the_adapter_and_exports(tmp_path, tiny_model_dir):
    from rlver.checkpoint.io import read_checkpoint_state
    from tests.conftest import run_cli
    from tests.integration.test_multiprocess import read_scalars, run_fit, twin_config

    config = twin_config(
        "quickstart_lora", tmp_path, tiny_model_dir, "", steps=3, devices=1, vllm=True, float32_compute=True
    )
    run_fit(tmp_path, "--config", config)
    run_dir = tmp_path / "runs" / "quickstart_lora"
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    state = read_checkpoint_state(checkpoint)
    policy_keys = [k for k in state["state_dict"] if k.startswith("policy_model.")]
    assert policy_keys and all(".lora_A." in k or ".lora_B." in k for k in policy_keys)
    adam = state["optimizer_states"][0]["state"]
    assert len(adam) == len(policy_keys)  # Adam moments for the adapter only
    assert state["hyper_parameters"]["lora"]["rank"] == 16
    # vLLM sampled from the merged, updated weights: the trainer's log-probs of its samples agree.
    gaps = read_scalars(run_dir / "tensorboard")["rollout/logprob_gap"]
    # ... as closely as with full fine-tuning (the curriculum twin: the same vLLM engine and steps).
    full_dir = tmp_path / "full"
    full_dir.mkdir()
    full = twin_config(
        "curriculum", full_dir, tiny_model_dir, "", steps=3, devices=1, vllm=True, float32_compute=True
    )
    run_fit(full_dir, "--config", full)
    full_gaps = read_scalars(full_dir / "runs" / "curriculum" / "tensorboard")["rollout/logprob_gap"]
    print("logprob gap after each sync: lora", gaps, "full", full_gaps)
    assert len(gaps) == 3 and max(gaps) < 1e-3 and max(gaps) <= max(10 * max(full_gaps), 1e-4), (
        gaps,
        full_gaps,
    )
    # The adapter moved; merged export equals base + adapter; the peft export loads with peft.
    merged = tmp_path / "merged"
    assert run_cli("export", "--ckpt", checkpoint, "--out", merged).returncode == 0
    adapter = tmp_path / "adapter"
    result = run_cli("export", "--ckpt", checkpoint, "--out", adapter, "--adapter")
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 16
    from peft import PeftModel

    via_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter)
    exported = AutoModelForCausalLM.from_pretrained(merged)
    ids = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = token_logprobs(via_peft(input_ids=ids).logits, ids)
        b = token_logprobs(exported(input_ids=ids).logits, ids)
        base = token_logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir)(input_ids=ids).logits, ids)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert (a - base).abs().max() > 0  # three updates changed the policy
    # It resumes: the base weights come from the model path, the adapter from the checkpoint.
    run_fit(tmp_path, "--config", config, "--ckpt_path", "last", "--trainer.max_steps", "4")
    assert read_checkpoint_state(checkpoint)["global_step"] == 4


def test_the_hf_engine_samples_from_the_adapted_policy(tiny_model_dir):
    """hf generates with the peft model itself: its log-probs are the adapted policy's, not the base's."""
    from rlver.core.interfaces import SamplingSettings
    from rlver.core.plugins import get_registry
    from rlver.modeling.models import Policy, load_tokenizer

    model = adapted(tiny_model_dir)
    policy = Policy(
        model=model, tokenizer=load_tokenizer(str(tiny_model_dir)), path=str(tiny_model_dir), name="t"
    )
    engine = get_registry().build("engines", {"name": "hf"}, flag="engine", policy=policy)
    prompt = [1, 5, 9, 13, 17, 21]
    (generation,) = engine.generate([prompt], SamplingSettings(max_new_tokens=8, temperature=1.0, seed=3))
    ids = torch.tensor([prompt + list(generation.token_ids)])
    with torch.no_grad():
        ours = token_logprobs(model(input_ids=ids).logits, ids)[0, len(prompt) :]
        with adapter_disabled(model):
            base = token_logprobs(model(input_ids=ids).logits, ids)[0, len(prompt) :]
    recorded = torch.tensor(generation.logprobs)
    assert (recorded - ours).abs().max() < 1e-4
    assert (recorded - base).abs().max() > 1e-3


@pytest.mark.slow
def test_lora_under_fsdp_on_two_processes_trains_syncs_vllm_and_checkpoints_the_adapter(
    tmp_path, tiny_model_dir
):
    """The paper's GRPO recipe (FSDP1, sage user) with adapters: sharded frozen base, trained
    adapters, merged weights gathered out of the shards into each rank's vLLM."""
    import yaml
    from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

    from rlver.checkpoint.io import read_checkpoint_state
    from tests.integration.test_multiprocess import digests, lay_out_data, read_scalars, run_fit, twin_config

    lay_out_data(tmp_path)
    with ScriptedServer(Script()) as server:
        config = twin_config(
            "grpo_nothink", tmp_path, tiny_model_dir, server.url, steps=2, vllm=True, float32_compute=True
        )
        twin = yaml.safe_load(config.read_text())
        twin["model"]["lora"] = {"rank": 4, "alpha": 8}
        twin["model"]["actor_lr"] = 1e-3
        config.write_text(yaml.safe_dump(twin, sort_keys=False, allow_unicode=True))
        run_fit(tmp_path, "--config", config)
    per_rank = digests(tmp_path)
    assert [d["step"] for d in per_rank] == [2, 2]
    assert per_rank[0]["tensors"] == per_rank[1]["tensors"]
    checkpoint = tmp_path / "runs" / "grpo_nothink" / "checkpoints" / "last.ckpt"
    state = read_checkpoint_state(checkpoint)["state_dict"]
    adapters = [k for k in state if k.startswith("policy_model.") and (".lora_A." in k or ".lora_B." in k)]
    assert adapters and any(state[k].abs().max() > 0 for k in adapters if ".lora_B." in k)  # it trained
    gaps = read_scalars(tmp_path / "runs" / "grpo_nothink" / "tensorboard")["rollout/logprob_gap"]
    assert max(gaps) < 1e-3, gaps  # step 1 sampled the merged, updated adapter
    # It resumes under FSDP (the sharded checkpoint keeps the frozen base for the loader).
    with ScriptedServer(Script()) as server:
        config = twin_config(
            "grpo_nothink", tmp_path, tiny_model_dir, server.url, steps=3, vllm=True, float32_compute=True
        )
        twin["trainer"]["max_steps"] = 3
        twin["model"]["simulator"]["base_url"] = server.url
        config.write_text(yaml.safe_dump(twin, sort_keys=False, allow_unicode=True))
        run_fit(tmp_path, "--config", config, "--ckpt_path", "last")
    assert read_checkpoint_state(checkpoint)["global_step"] == 3
    from tests.conftest import run_cli

    for extra in ((), ("--adapter",)):
        out = tmp_path / f"export{len(extra)}"
        result = run_cli("export", "--ckpt", checkpoint, "--out", out, *extra)
        assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "export1" / "adapter_config.json").read_text())["r"] == 4


def test_an_unsharded_adapted_policy_syncs_merging_one_layer_at_a_time(tiny_model_dir, monkeypatch):
    """Issue 54 (7): on one GPU the LoRA policy is not sharded, so its weights came as one chunk and
    every targeted weight's merged copy was alive at once (~12 GiB at 7B). The sync now merges one
    decoder layer at a time; the weights it hands over are the same, bit for bit."""
    import rlver.modeling.lora as lora

    model = adapted(tiny_model_dir)
    parts: list[set[str]] = []
    merge = lora.merged_state_dict

    def recording_merge(state, scaling):
        parts.append(
            {name.split(".layers.")[1].split(".")[0] if ".layers." in name else "-" for name in state}
        )
        return merge(state, scaling)

    monkeypatch.setattr(lora, "merged_state_dict", recording_merge)
    streamed = dict(lora.inference_weights(model, torch.float32))
    monkeypatch.setattr(lora, "merged_state_dict", merge)
    assert streamed.keys() == inference_state_dict(model).keys()
    for name, tensor in inference_state_dict(model).items():
        assert torch.equal(streamed[name], tensor.float()), name
    layers = model.config.num_hidden_layers
    assert len(parts) == layers + 1  # each layer alone; the embeddings, the norm and the head together
    assert all(len(part) == 1 for part in parts)
