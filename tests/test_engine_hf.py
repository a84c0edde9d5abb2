"""The hf engine with the real SmolLM2: exact ids and log-probs, stops, limits, seeds."""

import pytest
import torch
from rlver_plugins.hf_engine import HFEngine

from rlver.interfaces import SamplingSettings

pytestmark = pytest.mark.slow

CHATS = [
    "I feel sad today.",
    "My boss shouted at me in front of everyone.",
    "hi",
    "Nobody came to my birthday.",
]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for c in CHATS
    ]


def teacher_forced_logprobs(policy, prompt, response, temperature):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = policy.model(ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_are_those_of_the_sampled_ids(policy, prompts, temperature):
    generations = HFEngine(policy, batch_size=4).generate(
        prompts, SamplingSettings(max_new_tokens=20, temperature=temperature, seed=11)
    )
    for prompt, generation in zip(prompts, generations):
        assert len(generation.token_ids) == len(generation.logprobs) > 0
        expected = teacher_forced_logprobs(policy, prompt, generation.token_ids, temperature)
        assert torch.allclose(torch.tensor(generation.logprobs), expected, atol=1e-4)


def test_greedy_picks_the_argmax(policy, prompts):
    (generation,) = HFEngine(policy).generate(prompts[:1], SamplingSettings(max_new_tokens=8, temperature=0))
    ids = torch.tensor([list(prompts[0]) + list(generation.token_ids)])
    with torch.no_grad():
        logits = policy.model(ids).logits[0, len(prompts[0]) - 1 : -1]
    assert logits.argmax(-1).tolist() == list(generation.token_ids)


def test_stop_and_length_are_respected(policy, prompts):
    engine = HFEngine(policy, batch_size=2)
    stops = set(policy.stop_token_ids)
    generations = engine.generate(prompts * 2, SamplingSettings(max_new_tokens=40, temperature=1.0, seed=2))
    reasons = {g.finish_reason for g in generations}
    assert reasons <= {"stop", "length"}
    for generation in generations:
        ids = list(generation.token_ids)
        if generation.finish_reason == "stop":
            assert ids[-1] in stops and not stops & set(ids[:-1])
        else:
            assert len(ids) == 40 and not stops & set(ids)
    short = engine.generate(prompts, SamplingSettings(max_new_tokens=3, temperature=1.0, seed=2))
    assert all(len(g.token_ids) <= 3 for g in short)
    assert all(
        g.finish_reason == "length" for g in short if len(g.token_ids) == 3 and g.token_ids[-1] not in stops
    )


def test_seeded_and_order_preserving(policy, prompts):
    engine = HFEngine(policy, batch_size=3)
    settings = SamplingSettings(max_new_tokens=12, temperature=1.0, seed=5)
    first = engine.generate(prompts, settings)
    assert engine.generate(prompts, settings) == first
    other = engine.generate(prompts, SamplingSettings(max_new_tokens=12, temperature=1.0, seed=6))
    assert other != first
    # results come back in prompt order even though the engine sorts by length
    greedy = engine.generate(prompts, SamplingSettings(max_new_tokens=6, temperature=0))
    alone = [engine.generate([p], SamplingSettings(max_new_tokens=6, temperature=0))[0] for p in prompts]
    assert [g.token_ids for g in greedy] == [a.token_ids for a in alone]


def test_training_mode_is_restored(policy, prompts):
    policy.model.train()
    HFEngine(policy).generate(prompts[:1], SamplingSettings(max_new_tokens=2, temperature=0))
    assert policy.model.training
    policy.model.eval()


def test_bad_inputs(policy):
    with pytest.raises(ValueError, match=r"batch_size \(0\) must be >= 1"):
        HFEngine(policy, batch_size=0)
    with pytest.raises(ValueError, match="at least one token"):
        HFEngine(policy).generate([[]], SamplingSettings())
