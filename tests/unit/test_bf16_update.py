"""What the update learns must not depend on the machine's arithmetic (issue 53).

On the real SmolLM2-135M and a real sampled GRPO group: the update the quickstart's `precision:
auto` resolves to on each CPU class takes the same first AdamW step as float32's, and where bf16
computes (a GPU recipe, or a CPU by request) the head's logits are float32. Measured here
(tools/bf16_gradient.py, docs/performance.md): float32 against float32 with another
summation order, AdamW first-step cosine 1.0000; bf16-mixed (emulated bf16 on AVX2) 0.97; the
bound 0.995 lies between. Before issue 53 `auto` gave bf16-mixed on the AMX and AVX512-BF16
classes, and the first test failed there.
"""

from __future__ import annotations

import pytest
import torch

import rlver.modeling.precision as precision_module
from rlver.modeling.precision import float32_head, output_head, resolve_precision

pytestmark = pytest.mark.slow

AVX512 = {"avx2", "avx512f", "avx512bw", "avx512vl"}
CPU_CLASSES = {
    "bf16 with AMX (Xeon)": ("AVX512", AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile"}),
    "bf16 without AMX (Zen 4/5)": ("AVX512", AVX512 | {"avx512_bf16"}),
    "no native bf16 (AVX2)": ("AVX2", {"avx2", "fma"}),
}
ADAM_STEP_BOUND = 0.995


@pytest.fixture(scope="module")
def group(policy):
    """One user's opening and 4 sampled replies (24 tokens at 0.7), with GRPO advantages."""
    from rlver_plugins.hf_engine import HFEngine

    from rlver.train.precision_probe import sampled_batch

    chat = [
        {"role": "system", "content": "You are a warm, attentive friend. Reply briefly."},
        {"role": "user", "content": "My sister forgot my birthday again and I feel invisible."},
    ]
    return sampled_batch(policy.tokenizer, HFEngine(policy), [chat], seed=3)


@pytest.fixture(scope="module")
def float32_gradient(policy, group):
    from rlver.train.precision_probe import update_gradient

    return update_gradient(policy.model, *group)


@pytest.mark.parametrize("cpu", sorted(CPU_CLASSES))
def test_the_quickstarts_update_on_every_cpu_class_steps_as_float32_does(
    cpu, policy, group, float32_gradient, monkeypatch
):
    from rlver.train.precision_probe import compare_gradients, update_gradient

    capability, flags = CPU_CLASSES[cpu]
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(precision_module, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(precision_module.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    chosen, _ = resolve_precision("auto", "cpu")  # the quickstart's trainer.precision
    grads = update_gradient(policy.model, *group, precision=str(chosen))
    agreement = compare_gradients(grads, float32_gradient)
    assert agreement["adam_step_cosine"] >= ADAM_STEP_BOUND, (cpu, chosen, agreement)


def test_the_bound_separates_summation_order_from_bf16(policy, group, float32_gradient):
    """The bound is not loose: float32 in other micro-batches is within it, bf16-mixed (this
    machine's bf16 kernels) is measured beside it, and its gradient still points the same way."""
    from rlver.train.precision_probe import compare_gradients, update_gradient

    reordered = compare_gradients(update_gradient(policy.model, *group, micro_batch_size=3), float32_gradient)
    assert reordered["adam_step_cosine"] >= 0.9999
    bf16 = compare_gradients(update_gradient(policy.model, *group, precision="bf16-mixed"), float32_gradient)
    assert bf16["cosine"] > 0.99  # the gradient itself barely moves ...
    assert bf16["adam_step_cosine"] < reordered["adam_step_cosine"]  # ... the step it takes does


def test_under_bf16_the_head_computes_float32_logits_and_halves_the_logprob_error(policy, group):
    """The GPU recipes' path (and bf16 by request on a CPU): the backbone in bf16, the head's
    logits in float32 from its hidden state. On the sampled tokens the trainer's log-prob error
    against float32 falls (measured: mean 0.037 -> 0.020, p99 0.21 -> 0.10 on 4 replies)."""
    from rlver.train.precision_probe import sampled_logprobs

    batch, _ = group
    model = policy.model
    assert isinstance(output_head(model), torch.nn.Linear)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = torch.randn(2, 3, model.config.hidden_size).to(torch.bfloat16)
        with float32_head(model):  # as load_policy and load_networks install it
            logits = output_head(model)(hidden)
        assert logits.dtype == torch.float32
    weight = output_head(model).weight
    torch.testing.assert_close(logits, hidden.float() @ weight.float().T)  # float32 maths, autocast off
    mask = batch.loss_mask.bool()
    exact = sampled_logprobs(model, batch)
    bf16_head = (sampled_logprobs(model, batch, precision="bf16-mixed", head_in_float32=False) - exact)[mask]
    float32 = (sampled_logprobs(model, batch, precision="bf16-mixed") - exact)[mask]
    assert float32.abs().mean() < 0.8 * bf16_head.abs().mean()


def test_float32_runs_are_bitwise_unchanged_by_the_float32_head(policy, group):
    from rlver.train.precision_probe import sampled_logprobs

    batch, _ = group
    with_head = sampled_logprobs(policy.model, batch, head_in_float32=True)
    without = sampled_logprobs(policy.model, batch, head_in_float32=False)
    assert torch.equal(with_head, without)
