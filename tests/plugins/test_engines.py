"""The shared engine contract, run against every engine plugin (`hf` and `vllm`) with the real SmolLM2.

Exact sampled ids and log-probs, stop and per-turn limits, seeds, the rollout loop's masks, and
(for engines that keep their own weights) weight sync.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rlver_plugins.formats import NoThinkFormat
from rlver_plugins.hf_engine import HFEngine

from rlver.core.interfaces import SamplingSettings
from rlver.modeling.models import load_policy
from rlver.rollout.runner import RolloutRunner, RolloutSettings
from tests.unit.test_rollout import (
    ScriptedSimulator,
    assert_masks_cover_exactly_the_sampled_ids,
    make_profile,
)

pytestmark = pytest.mark.slow

CHATS = [
    "I feel sad today.",
    "My boss shouted at me in front of everyone.",
    "hi",
    "Nobody came to my birthday.",
]
# vLLM runs float32 here so its log-probs can be held to the same tolerance as transformers'.
TOLERANCE = {"hf": 1e-4, "vllm": 1e-3}


@pytest.fixture(scope="session")
def vllm_engine(policy):
    from rlver_plugins.vllm_engine import VLLMEngine

    # 0.5 GiB holds one 8192-token SmolLM2 sequence in float32 (377 MB) and these tests' prompts.
    return VLLMEngine(policy, dtype="float32", cpu_kv_cache_gib=0.5)


@pytest.fixture(params=["hf", "vllm"])
def engine(request, policy):
    if request.param == "hf":
        return HFEngine(policy, batch_size=4)
    return request.getfixturevalue("vllm_engine")


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for c in CHATS
    ]


def engine_name(engine):
    return "hf" if isinstance(engine, HFEngine) else "vllm"


def teacher_forced_logprobs(policy, prompt, response, temperature):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = policy.model(ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_are_those_of_the_sampled_ids(engine, policy, prompts, temperature):
    generations = engine.generate(
        prompts, SamplingSettings(max_new_tokens=20, temperature=temperature, seed=11)
    )
    assert len(generations) == len(prompts)
    for prompt, generation in zip(prompts, generations):
        assert len(generation.token_ids) == len(generation.logprobs) > 0
        expected = teacher_forced_logprobs(policy, prompt, generation.token_ids, temperature)
        gap = (torch.tensor(generation.logprobs) - expected).abs().max().item()
        assert gap < TOLERANCE[engine_name(engine)], gap


def test_greedy_picks_the_argmax(engine, policy, prompts):
    (generation,) = engine.generate(prompts[:1], SamplingSettings(max_new_tokens=8, temperature=0))
    ids = torch.tensor([list(prompts[0]) + list(generation.token_ids)])
    with torch.no_grad():
        logits = policy.model(ids).logits[0, len(prompts[0]) - 1 : -1]
    assert logits.argmax(-1).tolist() == list(generation.token_ids)


def test_stop_and_length_are_respected(engine, policy, prompts):
    stops = set(policy.stop_token_ids)
    generations = engine.generate(prompts * 2, SamplingSettings(max_new_tokens=40, temperature=1.0, seed=2))
    assert {g.finish_reason for g in generations} <= {"stop", "length"}
    for generation in generations:
        ids = list(generation.token_ids)
        if generation.finish_reason == "stop":
            assert ids[-1] in stops and not stops & set(ids[:-1])
        else:
            assert len(ids) == 40 and not stops & set(ids)
    greeting = engine.generate(prompts[2:3], SamplingSettings(max_new_tokens=40, temperature=0))[0]
    assert greeting.finish_reason == "stop"  # "hi" gets a short greeting that ends with <|im_end|>
    short = engine.generate(prompts, SamplingSettings(max_new_tokens=3, temperature=1.0, seed=2))
    assert all(len(g.token_ids) <= 3 for g in short)


def test_seeded_and_order_preserving(engine, prompts):
    settings = SamplingSettings(max_new_tokens=12, temperature=1.0, seed=5)
    first = engine.generate(prompts, settings)
    assert engine.generate(prompts, settings) == first
    assert engine.generate(prompts, SamplingSettings(max_new_tokens=12, temperature=1.0, seed=6)) != first
    greedy = engine.generate(prompts, SamplingSettings(max_new_tokens=6, temperature=0))
    alone = [engine.generate([p], SamplingSettings(max_new_tokens=6, temperature=0))[0] for p in prompts]
    assert [g.token_ids for g in greedy] == [a.token_ids for a in alone]


def test_rollout_loop_masks_with_this_engine(engine, policy):
    settings = RolloutSettings(max_turns=2, max_new_tokens=16, temperature=1.0, seed=1)
    runner = RolloutRunner(policy, engine, ScriptedSimulator(), NoThinkFormat(), settings)
    for trajectory in runner.run([make_profile("a"), make_profile("b", "Work has been awful lately.")]):
        assert trajectory.num_turns == 2
        assert_masks_cover_exactly_the_sampled_ids(trajectory)


def test_empty_prompt_is_rejected(engine):
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], SamplingSettings())


# --------------------------------------------------------------------------- engine-specific
def test_the_cpu_vllm_engine_compiles_nothing(vllm_engine, prompts):
    """Eager on CPU means eager throughout: vLLM's sampler would torch.compile its rank count with
    inductor in every process (about 2.8 s), and again when the batch size first changes."""
    from torch._dynamo import eval_frame
    from torch._dynamo.utils import counters

    for batch in (1, 3):  # two batch sizes: the second would have recompiled with dynamic shapes
        generations = vllm_engine.generate(prompts[:batch], SamplingSettings(max_new_tokens=4, seed=batch))
        assert all(len(g.logprobs) == len(g.token_ids) > 0 for g in generations)
    assert sum(counters["frames"].values()) == 0, dict(counters["frames"])
    assert eval_frame._stance.stance == "default"  # the rest of the process compiles as it asks


def test_vllm_weight_sync_follows_the_policy(vllm_engine, policy, prompts):
    """Change the policy's weights, sync, and the engine samples from the changed policy."""
    greedy = SamplingSettings(max_new_tokens=12, temperature=0)
    before = vllm_engine.generate(prompts[:2], greedy)
    original = {k: v.clone() for k, v in policy.model.state_dict().items()}
    try:
        with torch.no_grad():
            for name, parameter in policy.model.named_parameters():
                if ".mlp.down_proj" in name:
                    parameter.add_(torch.randn_like(parameter), alpha=0.02)
        version = vllm_engine.weights_version
        vllm_engine.sync_weights()
        assert vllm_engine.weights_version == version + 1
        after = vllm_engine.generate(prompts[:2], greedy)
        assert [g.token_ids for g in after] != [g.token_ids for g in before]
        for prompt, generation in zip(prompts[:2], after):
            expected = teacher_forced_logprobs(policy, prompt, generation.token_ids, 0)
            assert (torch.tensor(generation.logprobs) - expected).abs().max().item() < TOLERANCE["vllm"]
    finally:
        policy.model.load_state_dict(original)
        vllm_engine.sync_weights()
    assert [g.token_ids for g in vllm_engine.generate(prompts[:2], greedy)] == [g.token_ids for g in before]


def test_hf_training_mode_is_restored(policy, prompts):
    policy.model.train()
    HFEngine(policy).generate(prompts[:1], SamplingSettings(max_new_tokens=2, temperature=0))
    assert policy.model.training
    policy.model.eval()


def test_bad_engine_options(policy):
    from rlver_plugins.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match=r"batch_size \(0\) must be >= 1"):
        HFEngine(policy, batch_size=0)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization \(1.5\) must be within"):
        VLLMEngine(policy, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match=r"cpu_kv_cache_gib \(0\) must be > 0"):
        VLLMEngine(policy, cpu_kv_cache_gib=0)


def test_the_cpu_kv_cache_is_the_size_asked_for(vllm_engine):
    """On CPU each start writes its whole KV cache: a fraction of a GiB must be honoured."""
    core = vllm_engine.llm.llm_engine.engine_core.engine_core
    caches = core.model_executor.driver_worker.worker.model_runner.kv_caches
    allocated = sum(cache.numel() * cache.element_size() for cache in caches)
    assert 0.99 * 2**29 < allocated <= 2**29  # whole blocks of 0.5 GiB (the default would be 2 GiB)


# --------------------------------------------------------------------------- the model's generation_config
# A Qwen2.5-Instruct-like generation_config.json, with top_k 1 so that any leak of it turns sampling greedy.
PICKY_GENERATION_CONFIG = {
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 1,
    "repetition_penalty": 1.05,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


@pytest.fixture(scope="module")
def picky_policy(policy, tmp_path_factory):
    """The embedded policy, loaded from a folder whose generation_config.json asks for other sampling."""
    source = Path(policy.path)
    folder = tmp_path_factory.mktemp("picky-smollm2")
    for item in source.iterdir():
        if item.name != "generation_config.json":
            (folder / item.name).symlink_to(item)
    (folder / "generation_config.json").write_text(json.dumps(PICKY_GENERATION_CONFIG))
    picky = load_policy(str(folder))
    assert picky.model.generation_config.top_k == 1  # the file was read
    return picky


@pytest.fixture(scope="module")
def picky_vllm_engine(picky_policy):
    from rlver_plugins.vllm_engine import VLLMEngine

    return VLLMEngine(picky_policy, dtype="float32", cpu_kv_cache_gib=0.5)


@pytest.fixture(params=["hf", "vllm"])
def picky_engine(request, picky_policy):
    if request.param == "hf":
        return HFEngine(picky_policy, batch_size=4)
    return request.getfixturevalue("picky_vllm_engine")


def test_model_generation_config_does_not_restrict_sampling(picky_engine, prompts):
    greedy = picky_engine.generate(prompts[:1], SamplingSettings(max_new_tokens=8, temperature=0))[0]
    samples = {
        picky_engine.generate(prompts[:1], SamplingSettings(max_new_tokens=8, seed=seed))[0].token_ids
        for seed in range(6)
    }
    assert len(samples - {greedy.token_ids}) >= 2  # the file's top_k = 1 would make every sample greedy


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_model_generation_config_does_not_change_logprobs(picky_engine, picky_policy, prompts, temperature):
    """Sampled ids and log-probs are those of plain softmax(logits / T): no repetition penalty."""
    generations = picky_engine.generate(
        prompts, SamplingSettings(max_new_tokens=16, temperature=temperature, seed=3)
    )
    for prompt, generation in zip(prompts, generations):
        expected = teacher_forced_logprobs(picky_policy, prompt, generation.token_ids, temperature)
        gap = (torch.tensor(generation.logprobs) - expected).abs().max().item()
        assert gap < TOLERANCE[engine_name(picky_engine)], gap


@pytest.mark.parametrize(
    ("temperature", "top_p", "expected"),
    [
        (1.0, 1.0, ["_SampledLogprobRecorder"]),
        (0.7, 0.9, ["_SampledLogprobRecorder", "TemperatureLogitsWarper", "TopPLogitsWarper"]),
        (0.0, 1.0, ["_SampledLogprobRecorder"]),
    ],
)
def test_hf_generate_uses_only_temperature_and_top_p(
    picky_policy, prompts, monkeypatch, temperature, top_p, expected
):
    """No top-k (neither the file's nor transformers' default 50), no penalties: just T and top-p."""
    model = picky_policy.model
    used = []

    def capture(**kwargs):
        processors = type(model)._get_logits_processor(model, **kwargs)
        used.append([type(p).__name__ for p in processors])
        return processors

    monkeypatch.setattr(model, "_get_logits_processor", capture)
    HFEngine(picky_policy).generate(
        prompts[:1], SamplingSettings(max_new_tokens=2, temperature=temperature, top_p=top_p)
    )
    assert used == [expected]
    assert model.generation_config.top_k == 1  # the model's own config is back in place


def test_prompt_seeds_make_a_sample_independent_of_its_neighbours(engine, policy, prompts):
    """The rollout's schedules batch dialogues differently; a reply must not change with that."""
    settings = SamplingSettings(max_new_tokens=16, temperature=1.0, seed=5, prompt_seeds=(11, 22, 33))
    prompts = prompts[:3]
    together = engine.generate(prompts, settings)
    apart = engine.generate([prompts[2], prompts[0]], replace(settings, prompt_seeds=(33, 11)))
    assert [apart[1].token_ids, apart[0].token_ids] == [together[0].token_ids, together[2].token_ids]
    for mine, theirs in ((apart[1], together[0]), (apart[0], together[2])):
        gap = (torch.tensor(mine.logprobs) - torch.tensor(theirs.logprobs)).abs().max().item()
        assert gap < TOLERANCE[engine_name(engine)], gap
    other = engine.generate(prompts, replace(settings, prompt_seeds=(12, 22, 34)))
    assert other[1] == together[1] and other[0] != together[0]  # each prompt follows its own seed
    with pytest.raises(ValueError, match="2 prompt seeds for 3 prompts"):
        engine.generate(prompts, replace(settings, prompt_seeds=(1, 2)))


def test_hf_prefills_each_distinct_prompt_once(policy, prompts, monkeypatch):
    """A GRPO group's members open with the same prompt: the hf engine prefills the distinct
    prompts (3 of 6 here, left-padded to one width) and copies their cache to the rows; samples
    and log-probs equal generate()'s own prefill of all six."""
    import rlver_plugins.hf_engine.engine as hf_engine

    group = [prompts[1]] * 3 + [prompts[0]] * 2 + [prompts[2]]
    settings = SamplingSettings(max_new_tokens=12, temperature=1.0, prompt_seeds=(1, 2, 3, 4, 5, 6))
    engine = HFEngine(policy, batch_size=8)
    batches = []
    hook = policy.model.get_input_embeddings().register_forward_hook(
        lambda module, args, output: batches.append(tuple(args[0].shape))
    )
    try:
        shared = engine.generate(group, settings)
        first = batches[:2]
        batches.clear()
        monkeypatch.setattr(hf_engine, "_prefill_distinct", lambda *args: None)
        plain = engine.generate(group, settings)
    finally:
        hook.remove()
    width = max(len(p) for p in group)
    assert first == [(3, width - 1), (6, 1)]  # the distinct prompts but their last token, then the rows
    assert batches[0] == (6, width)  # generate()'s own prefill: every row, every token
    assert [g.token_ids for g in shared] == [g.token_ids for g in plain]
    for mine, theirs in zip(shared, plain, strict=True):
        gap = (torch.tensor(mine.logprobs) - torch.tensor(theirs.logprobs)).abs().max().item()
        assert gap < TOLERANCE["hf"], gap


def test_prompt_seeded_sampling_keeps_to_the_nucleus_and_records_its_logprobs(engine, policy, prompts):
    settings = SamplingSettings(max_new_tokens=20, temperature=0.7, top_p=0.8, prompt_seeds=(1, 2, 3, 4))
    for prompt, generation in zip(prompts, engine.generate(prompts, settings)):
        ids = torch.tensor([list(prompt) + list(generation.token_ids)])
        with torch.no_grad():
            logits = policy.model(ids).logits[0, len(prompt) - 1 : -1].float() / 0.7
        probs = torch.softmax(logits, -1)
        chosen = torch.tensor(generation.token_ids)
        mass_before = (probs * (probs > probs.gather(1, chosen[:, None]))).sum(-1)
        assert (mass_before < 0.8 + 1e-4).all(), mass_before  # inside the top-p set
        if engine_name(engine) == "vllm":
            continue  # with top_p < 1 vLLM renormalises over the nucleus (its module docstring)
        expected = torch.log_softmax(logits, -1).gather(1, chosen[:, None]).squeeze(1)
        gap = (torch.tensor(generation.logprobs) - expected).abs().max().item()
        assert gap < TOLERANCE[engine_name(engine)], gap
