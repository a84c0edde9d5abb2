"""`rlver plan` and the memory check of `rlver fit`: parameter counts, per-phase arithmetic by hand.

No model is loaded: architectures come from config.json files; the cross-checks against
transformers build the modules on the meta device (shapes only, no memory, no weights).
"""

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from rlver.cli import main, parse_recipe
from rlver.modeling.lora import DEFAULT_TARGETS, LoraSettings
from rlver.plan.architectures import Architecture, resolve_architecture, shipped_architectures
from rlver.plan.memory_plan import GIB, check_fits, failures, plan_memory, plan_recipe, raise_if_over
from rlver.plan.training_shape import TrainingShape, training_shape
from tests.conftest import REPO

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
TRAINING_ON_GPUS = ["ppo_think", "ppo_nothink", "grpo_think", "grpo_nothink", "env_normal", "env_hard"]
TRAINING_ON_GPUS += ["ppo_think_reference_user", "ppo_think_lora"]

# Qwen2.5-7B-Instruct by hand (config.json: hidden 3584, MLP 18944, 28 layers, 28 heads of 128,
# 4 key/value heads, vocabulary 152064, untied LM head, q/k/v biases).
P = 7_615_616_512  # the policy
V, H, INTER, LAYERS, KV = 152_064, 3_584, 18_944, 28, 4 * 128
LAYER = (H * H + H) + 2 * (H * KV + KV) + H * H + 3 * H * INTER + 2 * H  # q, k, v, o, MLP, 2 norms
C = P - V * H + H + 1  # the critic: no LM head, a 1-output value head
POLICY_ROOT = P - LAYERS * LAYER  # embeddings, final norm, LM head
CRITIC_ROOT = C - LAYERS * LAYER


def quiet_parse(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parse_recipe(str(path))


def recipe_copy(tmp_path: Path, name: str, **changes) -> Path:
    """recipes/<name>.yaml with `section__key=value` changes (e.g. model__dtype="float32")."""
    recipe = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        node = recipe
        for parent in parents:
            node = node[parent]
        node[key] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def phase_bytes(phases):
    return {phase.name: phase.total for phase in phases}


# ---------------------------------------------------------------------- parameter counts
def test_parameter_counts_of_the_shipped_architectures():
    qwen7 = resolve_architecture("Qwen/Qwen2.5-7B-Instruct")
    assert qwen7.parameter_count() == 7_615_616_512
    assert qwen7.decoder_layer_parameters() == LAYER == 233_057_792
    assert qwen7.critic_parameter_count() == C == 7_070_622_721
    assert resolve_architecture("Qwen/Qwen2.5-0.5B-Instruct").parameter_count() == 494_032_768
    smol = Architecture.from_config(
        json.loads(shipped_architectures()["smollm2-135m-instruct"].read_text()), "smol", "shipped"
    )
    assert smol.parameter_count() == 134_515_008


@pytest.mark.parametrize("name", sorted(shipped_architectures()))
def test_counts_equal_the_transformers_modules(name):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = json.loads(shipped_architectures()[name].read_text())
    arch = Architecture.from_config(config, name, "shipped")
    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):  # shapes only
        causal = AutoModelForCausalLM.from_config(hf_config)
        backbone = AutoModel.from_config(hf_config)
    assert sum(p.numel() for p in causal.parameters()) == arch.parameter_count()
    assert (
        sum(p.numel() for p in backbone.parameters()) + arch.hidden_size + 1 == arch.critic_parameter_count()
    )
    assert hf_config.num_hidden_layers == arch.num_layers


def test_lora_parameters_by_hand_and_as_peft_builds_them():
    qwen7 = resolve_architecture("Qwen/Qwen2.5-7B-Instruct")
    per_layer = 2 * (H + H) + 2 * (H + KV) + 3 * (H + INTER)  # q, o; k, v; gate, up, down
    assert qwen7.lora_parameters(64, DEFAULT_TARGETS) == LAYERS * 64 * per_layer == 161_480_704
    assert qwen7.lora_parameters(8, ("q_proj", "v_proj")) == LAYERS * 8 * (2 * H + H + KV)
    with pytest.raises(ValueError, match=r"--model.lora.target_modules: qkv_proj"):
        qwen7.lora_parameters(8, ("qkv_proj",))

    from transformers import AutoConfig, AutoModelForCausalLM

    from rlver.modeling.lora import add_adapter

    config = json.loads(shipped_architectures()["qwen2.5-0.5b-instruct"].read_text())
    with torch.device("meta"):
        model = add_adapter(
            AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)), LoraSettings(rank=8)
        )
    built = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
    assert (
        built == Architecture.from_config(config, "q", "s").lora_parameters(8, DEFAULT_TARGETS) == 4_399_104
    )


# ---------------------------------------------------------------------- finding a config
def test_the_shipped_configs_are_package_data():
    import tomllib

    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "architectures/*.json" in patterns["rlver.data"]
    shipped = {path.name for path in shipped_architectures().values()}
    assert {"Qwen2.5-7B-Instruct.json", "Qwen2.5-0.5B-Instruct.json", "SmolLM2-135M-Instruct.json"} <= shipped
    assert all(
        path.parent == REPO / "rlver" / "data" / "architectures" for path in shipped_architectures().values()
    )


def test_a_hub_id_resolves_to_the_shipped_file_case_insensitively():
    arch = resolve_architecture("qwen/QWEN2.5-7B-instruct")
    assert arch.source == "shipped: rlver/data/architectures/Qwen2.5-7B-Instruct.json"


def test_a_local_folder_wins_and_a_folder_without_config_is_an_error(tmp_path):
    config = json.loads(shipped_architectures()["qwen2.5-0.5b-instruct"].read_text())
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    arch = resolve_architecture(str(tmp_path / "model"))
    assert arch.num_layers == 2 and arch.source == str(tmp_path / "model" / "config.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"--model.policy: .*empty is not a Hugging Face model folder"):
        resolve_architecture(str(tmp_path / "empty"))


def test_the_hugging_face_cache_is_read_and_nothing_is_downloaded(tmp_path, monkeypatch):
    import huggingface_hub.constants

    snapshot = tmp_path / "models--someone--Tiny-Chat" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    config = json.loads(shipped_architectures()["qwen2.5-0.5b-instruct"].read_text())
    (snapshot / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    (tmp_path / "models--someone--Tiny-Chat" / "refs").mkdir()
    (tmp_path / "models--someone--Tiny-Chat" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_architecture("someone/Tiny-Chat").num_layers == 3
    with pytest.raises(
        ValueError, match=r"--model.policy: no config.json for 'someone/Unknown-7B'.*qwen2.5-7b"
    ):
        resolve_architecture("someone/Unknown-7B")


# ---------------------------------------------------------------------- ppo_think by hand
CARD = 79.3  # what torch reports for an "80 GB" GPU: the memory a run really has


def ppo_think_shape(**changes) -> TrainingShape:
    """recipes/ppo_think.yaml's inputs as they are meant to be (float32 master weights), on "80 GB" cards."""
    config = quiet_parse(REPO / "recipes" / "ppo_think.yaml")
    model = {**config.model.as_dict(), "dtype": "float32"}
    shape = training_shape(
        model,
        critic=True,
        gpu_memory_gib=CARD,
        world_size=32,
        devices_per_node=8,
        sharding="FULL_SHARD",
        state_dict_type="sharded",
        precision="bf16-mixed",
        accelerator="gpu",
    )
    return dataclasses.replace(shape, **changes)


def test_ppo_think_shape_reads_the_recipe():
    shape = ppo_think_shape()
    assert (shape.world_size, shape.shard_count, shape.master_bytes, shape.compute_bytes) == (32, 32, 4, 2)
    assert (shape.micro_batch_size, shape.context_tokens, shape.engine_bytes) == (2, 8192, 2)
    assert shape.critic and shape.entropy and shape.gradient_checkpointing and shape.sleep_between_rollouts
    assert not shape.reference and shape.lora_rank is None and shape.gpu_memory_utilization == 0.55


def test_ppo_think_every_phase_by_hand():
    phases = plan_memory(resolve_architecture("Qwen/Qwen2.5-7B-Instruct"), ppo_think_shape())
    tokens = 2 * 8192  # micro_batch_size x max_context_tokens
    # policy + critic sharded over 32: float32 weights, float32 grads, 2 float32 AdamW states
    resident = (P + C) * (4 + 4 + 8) / 32 + GIB  # + CUDA context
    asleep = GIB
    awake = 0.55 * CARD * GIB
    gathered_scoring = (POLICY_ROOT + CRITIC_ROOT + LAYER) * 2  # roots stay gathered, + one layer, bf16
    hidden = tokens * (2 * H + 3 * INTER) * 2
    chunk = 1024 * V  # the vocabulary maths 1,024 rows at a time (rlver.modeling.batch.in_vocab_chunks)
    head_copy = V * H * 4  # the float32 head's copy of its bf16 weight (install_float32_head)
    # float32 logits (the head computes in float32); a chunk's tempered copy, log-softmax
    logits_scoring = tokens * V * 4 + head_copy + chunk * (4 + 4)
    gathered_update = (POLICY_ROOT + CRITIC_ROOT + 2 * LAYER) * 2  # + the prefetched layer
    checkpointed = 2 * LAYERS * tokens * H * 2  # each layer's bf16 input, policy and critic
    recomputed = tokens * (8 * H + 2 * (6 * H + 3 * KV + 4 * INTER))  # one layer's activations
    # float32 logits and their float32 gradient, the head's copy; a recomputed chunk's tempered
    # copy, log-softmax, gradient, entropy's log-probs and probs
    logits_update = tokens * V * (4 + 4) + head_copy + chunk * (4 + 4 + 4 + 8)
    unsharded_grads = POLICY_ROOT * 2
    reduce_copy = POLICY_ROOT * 4  # reduce-scattered in float32 (full_precision_reductions)
    reload_copy = V * H * 2  # vLLM materialises its largest module (embeddings, LM head) to reload it
    # Lightning's dump: the model state dict first, FSDP1 unsharding the root for the whole walk and
    # a layer at a time in float32; then the optimizer state dict gathers a unit's state (the root's,
    # 4.06 GiB): the model's is the larger, by the layer (0.87)
    model_gather = (POLICY_ROOT + LAYER) * 4
    expected = {
        "trainer resident": resident,
        "engine idle (asleep)": asleep,
        "engine awake": awake,
        "rollout": resident + awake,
        "scoring": resident + asleep + gathered_scoring + hidden + logits_scoring,
        "update": resident
        + asleep
        + gathered_update
        + checkpointed
        + recomputed
        + logits_update
        + unsharded_grads
        + reduce_copy,
        # engine weights alone (its KV cache asleep) + the root in float32 and bf16 + vLLM's copy
        "sync": resident + P * 2 + POLICY_ROOT * (4 + 2) + reload_copy,
        "checkpoint": resident + asleep + model_gather,  # the engine asleep: its sync waits
    }
    assert phase_bytes(phases) == pytest.approx(expected, rel=1e-12)
    assert {name: round(size / GIB, 1) for name, size in expected.items()} == PPO_THINK_GIB
    # vLLM starts only if its KV cache holds one max_model_len sequence: the model's 32,768
    engine = next(phase for phase in phases if phase.name == "engine awake")
    assert engine.required == P * 2 + 2 * LAYERS * KV * 2 * 32768
    assert not failures(phases)


# The docstring's worked example (rlver/plan/memory_plan.py), phase by phase, and for each a figure
# a plan that missed something would print instead.
PPO_THINK_GIB = {
    "trainer resident": 7.8,
    "engine idle (asleep)": 1.0,
    "engine awake": 43.6,
    "rollout": 51.5,
    "scoring": 26.7,
    "update": 51.9,
    "sync": 29.1,
    "checkpoint": 13.8,
}
KNOWN_WRONG = {
    "trainer resident": (13.3, "bf16 master weights counted with float32 grads and states"),
    "engine idle (asleep)": (63.4, "an engine that never sleeps"),
    "engine awake": (64.0, "80 GiB where the card has 79.3"),
    "rollout": (51.8, "80 GiB where the card has 79.3"),
    "scoring": (89.1, "the engine awake while scoring"),
    "update": (47.8, "no float32 copy of the gradient for the reduce-scatter"),
    "sync": (28.1, "no vLLM reload copy"),
    "checkpoint": (12.9, "the optimizer-state gather alone: no root and layer unsharded by the model's dump"),
}


@pytest.mark.parametrize("phase", sorted(PPO_THINK_GIB))
def test_each_ppo_think_phase_is_its_worked_figure_and_not_a_known_wrong_one(phase):
    planned = phase_bytes(plan_memory(resolve_architecture("Qwen/Qwen2.5-7B-Instruct"), ppo_think_shape()))
    wrong, why = KNOWN_WRONG[phase]
    assert round(planned[phase] / GIB, 1) == PPO_THINK_GIB[phase]
    assert round(planned[phase] / GIB, 1) != wrong, why


def test_the_checkpoint_gathers_per_state_dict_type_and_the_docstring_says_so():
    import rlver.plan.memory_plan as memory_plan

    arch = resolve_architecture("Qwen/Qwen2.5-7B-Instruct")
    resident = (P + C) * 16 / 32 + GIB
    sharded = phase_bytes(plan_memory(arch, ppo_think_shape()))["checkpoint"]
    full = phase_bytes(plan_memory(arch, ppo_think_shape(full_state_dict_checkpoint=True)))["checkpoint"]
    one_gpu = phase_bytes(plan_memory(arch, ppo_think_shape(world_size=1, shard_count=1)))["checkpoint"]
    # the model state dict's root and one layer unsharded in float32, above the optimizer's gather
    # of the root's state into one float32 buffer (POLICY_ROOT * 4)
    assert sharded == resident + GIB + (POLICY_ROOT + LAYER) * 4
    assert full == resident + GIB + 3 * POLICY_ROOT * 4  # its parameters and both states
    assert one_gpu == (P + C) * 16 + GIB + GIB  # NO_SHARD: nothing gathered
    # sharded LoRA: the adapters' optimizer states are too small to count, but the model's dump
    # still unshards the frozen base's root and a layer
    lora = phase_bytes(plan_memory(arch, ppo_think_shape(lora_rank=64, lora_targets=("q_proj", "v_proj"))))
    assert lora["checkpoint"] == lora["trainer resident"] + GIB + (POLICY_ROOT + LAYER) * 4
    for name, gib in PPO_THINK_GIB.items():  # the worked example quotes every phase's figure
        if name not in ("trainer resident", "engine idle (asleep)"):
            assert f"{gib}" in memory_plan.__doc__, name


def test_ppo_think_table_through_the_cli(tmp_path, capsys):
    recipe = recipe_copy(tmp_path, "ppo_think", model__dtype="float32")
    assert main(["plan", "--config", str(recipe), "--gpu-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "32 GPU(s) of 80.0 GiB, FSDP FULL_SHARD over 32, weights 4 B, compute 2 B" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line[:1].isalpha()}
    assert rows["rollout"].split()[1:4] == ["51.8", "80.0", "yes"]
    assert rows["update"].split()[1:4] == ["51.9", "80.0", "yes"]
    assert "logits+grad+entropy 23.5" in rows["update"] and "float32 reduce copy 4.1" in rows["update"]
    assert "vLLM reload copy 1.0" in rows["sync"] and "engine weights (KV cache asleep) 14.2" in rows["sync"]
    assert "model state-dict gather (root + layer) 4.9" in rows["checkpoint"]
    assert "assumptions:" in out


def test_grpo_has_no_critic_and_lora_holds_frozen_bases_and_float32_adapters():
    grpo = plan_memory(resolve_architecture("Qwen/Qwen2.5-7B-Instruct"), ppo_think_shape(critic=False))
    assert phase_bytes(grpo)["trainer resident"] == P * 16 / 32 + GIB
    lora = ppo_think_shape(
        lora_rank=64,
        lora_targets=DEFAULT_TARGETS,
        master_bytes=2,
        world_size=1,
        shard_count=1,
        micro_batch_size=1,
    )
    adapters = 2 * 161_480_704 + H + 1  # policy's and critic's adapters, the value head
    resident = (P + C - (H + 1)) * 2 + adapters * 16 + GIB
    phases = phase_bytes(plan_memory(resolve_architecture("Qwen/Qwen2.5-7B-Instruct"), lora))
    assert phases["trainer resident"] == resident
    targeted_in_a_layer = 2 * H * H + 2 * H * KV + 3 * H * INTER
    # one layer's merged copy (merged layer by layer since issue 54; all 28 layers at once before: 11.7 GiB more),
    # one layer cast, vLLM's reload copy of its largest module
    assert phases["sync"] == resident + P * 2 + targeted_in_a_layer * 2 + LAYER * 2 + V * H * 2


def test_an_engine_without_its_own_weights_and_vllm_on_cpu():
    arch = resolve_architecture("Qwen/Qwen2.5-7B-Instruct")
    hf = phase_bytes(plan_memory(arch, ppo_think_shape(engine="hf", rollout_sequences=4)))
    resident = (P + C) * 16 / 32 + GIB
    assert "sync" not in hf and "engine awake" not in hf  # it samples from the training module
    # the policy gathered in float32 for generation, and a bf16 KV cache for 4 sequences of 8192
    assert hf["rollout"] == resident + P * 4 + 4 * 8192 * 2 * LAYERS * KV * 2
    assert hf["update"] == pytest.approx(phase_bytes(plan_memory(arch, ppo_think_shape()))["update"] - GIB)

    smol = 134_515_008
    resident = smol * 16 + GIB  # float32 weights, grads and AdamW, whole
    _, shape, phases = plan_recipe(quiet_parse(REPO / "recipes" / "curriculum.yaml"), gpu_memory_gib=80.0)
    assert not shape.engine_on_gpu and not shape.sleep_between_rollouts and shape.shard_count == 1
    # a float32 vLLM engine on a CPU (`dtype: auto`), its weights and the recipe's cpu_kv_cache_gib
    assert phase_bytes(phases)["rollout"] == resident + smol * 4 + 1.0 * GIB

    # the quickstart samples with hf (issue 53): no second copy of the weights, no engine to wake or sync
    _, shape, quickstart = plan_recipe(quiet_parse(REPO / "recipes" / "quickstart.yaml"), gpu_memory_gib=80.0)
    quickstart = phase_bytes(quickstart)
    assert "sync" not in quickstart and "engine awake" not in quickstart
    assert quickstart["trainer resident"] == resident


def test_overlapped_steps_keep_the_engine_awake_and_hf_a_policy_snapshot():
    arch = resolve_architecture("Qwen/Qwen2.5-7B-Instruct")
    plain = phase_bytes(plan_memory(arch, ppo_think_shape()))
    overlapped = phase_bytes(plan_memory(arch, ppo_think_shape(overlap=True, sleep_between_rollouts=False)))
    awake = 0.55 * CARD * GIB  # generating through the update: no sleep
    assert overlapped["update"] == pytest.approx(plain["update"] - GIB + awake)
    assert overlapped["trainer resident"] == plain["trainer resident"]  # vLLM holds its own weights
    hf = phase_bytes(plan_memory(arch, ppo_think_shape(engine="hf", rollout_sequences=4, overlap=True)))
    hf_plain = phase_bytes(plan_memory(arch, ppo_think_shape(engine="hf", rollout_sequences=4)))
    assert hf["trainer resident"] == hf_plain["trainer resident"] + P * 4  # a float32 snapshot
    # max_staleness 2: two steps' rollouts generate at once, each with its KV cache
    recipe = quiet_parse(REPO / "recipes" / "ppo_think.yaml")
    recipe["model"]["engine"] = "hf"
    cache = {}
    for depth in (1, 2):
        recipe["model"]["overlap"] = {"max_staleness": depth}
        _, shape, phases = plan_recipe(recipe, gpu_memory_gib=80.0)
        cache[depth] = dict(next(p for p in phases if p.name == "rollout").parts)["KV cache"]
        assert shape.rollout_sequences == depth  # 1 profile x group 1 per GPU, per step
    assert cache[2] == pytest.approx(2 * cache[1])
    recipe = quiet_parse(REPO / "recipes" / "ppo_think.yaml")
    recipe["model"]["overlap"] = {"max_importance_weight": 2.0}
    _, shape, _ = plan_recipe(recipe, gpu_memory_gib=80.0)
    assert shape.overlap and not shape.sleep_between_rollouts


# ---------------------------------------------------------------------- what does not fit
def test_one_gpu_cannot_hold_a_7b_full_fine_tuning(tmp_path, capsys):
    recipe = recipe_copy(tmp_path, "ppo_think", model__dtype="float32")
    assert main(["plan", "--config", str(recipe), "--gpu-memory-gib", "80", "--world-size", "1"]) == 1
    out = capsys.readouterr().out
    needed = ((P + C) * 16 + GIB) / GIB  # 219.8
    assert (
        f"memory: trainer resident needs {needed:.1f} GiB per GPU but 80.0 are available "
        f"({needed - 80:.1f} over, 1 GPUs of 80.0 GiB); change --trainer.num_nodes / --trainer.devices, "
        "--model.lora" in out
    )
    assert "219.8" in out


def test_an_engine_share_of_0_95_leaves_too_little_for_the_trainer(tmp_path, capsys):
    engine = {"name": "vllm", "gpu_memory_utilization": 0.95, "sleep_between_rollouts": True}
    recipe = recipe_copy(tmp_path, "ppo_think", model__dtype="float32", model__engine=engine)
    assert main(["plan", "--config", str(recipe), "--gpu-memory-gib", "80"]) == 1
    out = capsys.readouterr().out
    rollout = ((P + C) * 16 / 32 + GIB + 0.95 * 80 * GIB) / GIB  # 83.8
    assert f"memory: rollout needs {rollout:.1f} GiB per GPU but 80.0 are available (3.8 over" in out
    assert "--model.engine.gpu_memory_utilization" in out.splitlines()[-1]


def test_a_141_gib_gpu_fits_what_80_does_not(tmp_path, capsys):
    recipe = recipe_copy(tmp_path, "ppo_think", model__dtype="float32", model__ppo__micro_batch_size=8)
    assert main(["plan", "--config", str(recipe), "--gpu-memory-gib", "80"]) == 1
    update = 93.1 + POLICY_ROOT * 4 / GIB  # the float32 reduce copy of the root's gradient
    update += (8 * 8192 * V * (4 + 4 - 2 - 2) + V * H * 4) / GIB  # float32 logits and grad, head copy
    assert f"memory: update needs {update:.1f} GiB per GPU but 80.0 are available" in capsys.readouterr().out
    assert main(["plan", "--config", str(recipe), "--gpu-memory-gib", "141"]) == 0
    assert "OVER" not in capsys.readouterr().out


def test_an_engine_too_small_for_one_sequence_and_an_update_without_checkpointing():
    arch = resolve_architecture("Qwen/Qwen2.5-7B-Instruct")
    (engine,) = failures(plan_memory(arch, ppo_think_shape(gpu_memory_utilization=0.18)))
    assert engine.name == "engine awake"  # 14.3 GiB < weights 14.2 + one 32768-token KV cache 1.75
    assert engine.shortfall == pytest.approx(P * 2 + 2 * LAYERS * KV * 2 * 32768 - 0.18 * CARD * GIB)
    # with max_model_len set to the recipe's context, the same share holds one sequence
    assert not failures(
        plan_memory(arch, ppo_think_shape(gpu_memory_utilization=0.185, engine_max_model_len=8192))
    )
    with pytest.raises(ValueError, match=r"^memory: update needs .* change --model.ppo.micro_batch_size, "):
        raise_if_over(arch, ppo_think_shape(gradient_checkpointing=False))
    try:
        raise_if_over(arch, ppo_think_shape(gradient_checkpointing=False))
    except ValueError as error:
        assert "--model.gradient_checkpointing" in str(error) and "\n" not in str(error)


# ---------------------------------------------------------------------- every recipe
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_shipped_recipe_plans(recipe):
    config = quiet_parse(recipe)
    arch, shape, phases = plan_recipe(config, gpu_memory_gib=80.0)
    assert arch.name == config.model.policy
    assert shape.world_size == int(config.trainer.devices) * int(config.trainer.num_nodes or 1)
    assert {"trainer resident", "rollout", "scoring", "update", "checkpoint"} <= {p.name for p in phases}
    assert all(phase.total > 0 for phase in phases if phase.name != "engine idle (asleep)")
    if recipe.stem in TRAINING_ON_GPUS:  # the training recipes fit their 80 GB GPUs
        assert not failures(phases), [p.name for p in failures(phases)]


def test_a_recipe_whose_config_cannot_be_found_exits_2(tmp_path, capsys):
    recipe = recipe_copy(tmp_path, "grpo_think", model__policy="someone/Not-Shipped-9B")
    assert main(["plan", "--config", str(recipe)]) == 2
    assert "--model.policy: no config.json for 'someone/Not-Shipped-9B'" in capsys.readouterr().err


def test_a_run_reads_as_its_recipe(tmp_path):
    """`rlver fit`'s check sees the shape `rlver plan` prints for the same recipe."""
    from rlver.core.plugins import plain_config
    from rlver.plan.training_shape import shape_from_recipe, shape_from_run
    from rlver.train.module import RLVERModule
    from rlver.train.trainer import Trainer

    recipe = recipe_copy(tmp_path, "quickstart_lora", trainer__precision="bf16-mixed")
    config = quiet_parse(recipe)
    module = RLVERModule(**plain_config(config.model))
    trainer = Trainer(
        accelerator="cpu", devices=1, precision="bf16-mixed", logger=False, enable_checkpointing=False
    )
    from_recipe = shape_from_recipe(config, gpu_memory_gib=24.0)
    from_run = shape_from_run(module, trainer, 24.0)
    assert from_recipe.lora_rank == 16 and not from_recipe.engine_on_gpu and from_recipe.compute_bytes == 2
    # Only an engine without its own weights reads the datamodule's batch size (not attached here).
    assert (
        dataclasses.replace(
            from_run,
            rollout_sequences=from_recipe.rollout_sequences,
            dialogues_per_rank=from_recipe.dialogues_per_rank,
        )
        == from_recipe
    )


def test_the_fit_check_skips_cpu_runs():
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert check_fits(None, trainer) is None  # returns before it reads the module


# ---------------------------------------------------------------------- one node or four
@pytest.mark.parametrize("world", [8, 32])
@pytest.mark.parametrize("recipe", ["ppo_think", "ppo_nothink", "grpo_think", "grpo_nothink"])
def test_the_paper_recipes_fit_one_node_of_8_and_four_with_the_papers_step(recipe, world, capsys):
    """Issue 54 (5): the machine most researchers have is one node of 8 x 80 GB. Each paper recipe
    keeps the paper's 32 profiles a step there (4 a GPU; 1 a GPU on 4 nodes) and every phase fits:
    `rlver plan --config recipes/<recipe>.yaml --world-size 8` exits 0."""
    path = REPO / "recipes" / f"{recipe}.yaml"
    assert (
        main(["plan", "--config", str(path), "--world-size", str(world), "--gpu-memory-gib", str(CARD)]) == 0
    )
    config = quiet_parse(path)
    _, shape, phases = plan_recipe(config, gpu_memory_gib=CARD, world_size=world)
    assert not failures(phases)
    dialogues = 32 * int(config.model.group_size)
    assert shape.dialogues_per_rank * world == dialogues
    assert f"{dialogues} dialogues a step, {dialogues // world} on each GPU" in capsys.readouterr().out


def test_profiles_per_step_splits_over_ranks_or_names_the_flag():
    from types import SimpleNamespace

    from rlver.data.datamodule import ProfileDataModule, profiles_per_rank

    assert profiles_per_rank(32, 8) == 4 and profiles_per_rank(32, 32) == 1
    with pytest.raises(
        ValueError, match=r"--data.profiles_per_step \(32\) must divide by the world size \(12"
    ):
        profiles_per_rank(32, 12)
    data = ProfileDataModule(profiles_per_step=32)
    data.trainer = SimpleNamespace(world_size=8, global_rank=0, global_step=0)
    data.setup("fit")
    assert data.batch_size == 4
    with pytest.raises(ValueError, match="--data.profiles_per_step"):
        ProfileDataModule(profiles_per_step=0)
