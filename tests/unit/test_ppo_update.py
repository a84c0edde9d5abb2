"""The update without a Trainer: `ppo_update` on a tiny model, one process, plain optimizers."""

from __future__ import annotations

import pytest
import torch

from rlver.modeling.batch import RolloutBatch, token_logprobs
from rlver.train.ppo_update import PPOSettings, ppo_update
from rlver.train.ranks import Lockstep
from tests.conftest import small_llama


def _tiny_llama():
    return small_llama()


def _batch(ids: torch.Tensor, mask: torch.Tensor) -> RolloutBatch:
    count, width = ids.shape
    return RolloutBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=mask,
        engine_logprobs=torch.zeros(count, width),
        sequence_dialogue=torch.arange(count),
        timeline_seq=torch.zeros(count, 1, dtype=torch.long),
        timeline_pos=torch.zeros(count, 1, dtype=torch.long),
        timeline_mask=torch.ones(count, 1),
        timeline_turn=torch.zeros(count, 1, dtype=torch.long),
    )


def test_one_update_without_a_trainer_moves_log_probs_with_the_advantages():
    model = _tiny_llama()
    ids = torch.randint(0, 512, (4, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[:, :4] = 0  # the prompt: context, not actions
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
    advantages = sign.expand_as(mask) * mask
    with torch.no_grad():
        before = token_logprobs(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ids) * mask
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    steps = []

    def optimizer_step(optimizer, counts_as_global_step):
        steps.append(counts_as_global_step)
        optimizer.step()

    settings = PPOSettings(minibatch_size=2, micro_batch_size=1, entropy_coef=0.0, grad_clip=1.0)
    metrics = ppo_update(
        _batch(ids, mask),
        before,
        None,
        advantages,
        None,
        None,
        policy_model=model,
        actor_optimizer=optimizer,
        settings=settings,
        step=0,
        lockstep=Lockstep(optimizer_step=optimizer_step),
    )
    with torch.no_grad():
        after = token_logprobs(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ids) * mask
    change = ((after - before) * mask).sum(dim=1) / mask.sum(dim=1)
    assert (change[sign[:, 0] > 0] > 0).all() and (change[sign[:, 0] < 0] < 0).all(), change
    assert steps == [False, True]  # two minibatches; only the iteration's last counts as a global step
    assert metrics["ppo/minibatches"] == 2.0
    assert metrics["ppo/clip_fraction"] == 0.0  # one small step: no ratio leaves the clip range
    assert metrics["ppo/grad_norm"] > 0 and metrics["ppo/actor_lr"] == 1e-3
    assert {"ppo/policy_loss", "ppo/entropy", "ppo/approx_kl"} <= metrics.keys()
    assert "ppo/value_loss" not in metrics  # no critic


# --------------------------------------------------------------------------- the on-policy path
def _networks(tmp_path, algorithm: str, lora: bool, kl: bool):
    """Policy (perturbed away from its reference when there is a KL), reference or None, critic or None."""
    import copy

    from rlver.modeling.critic import ValueModel
    from rlver.modeling.lora import LoraSettings, add_adapter

    policy = _tiny_llama()
    reference = None
    if kl and not lora:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    with torch.no_grad():
        for parameter in policy.parameters():  # the policy a few updates past the reference
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3)))
    if lora:
        policy = add_adapter(policy, LoraSettings(rank=4, alpha=8, target_modules=("q_proj", "v_proj")))
        with torch.no_grad():  # B starts at 0: a nonzero adapter makes the adapter-off reference differ
            for name, parameter in policy.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(std=0.1, generator=torch.Generator().manual_seed(4))
    critic = None
    if algorithm == "ppo":
        folder = tmp_path / "critic-init"
        if not folder.exists():
            _tiny_llama().save_pretrained(folder)
        torch.manual_seed(5)
        critic = ValueModel(str(folder))
    return policy, reference, critic


def _one_update(
    tmp_path, algorithm, lora, kl, scored: bool, head_at_loss_positions: bool = True,
    prompt: int = 0, share: bool = True,
):  # fmt: skip
    """One update on 5 sequences; with `prompt` > 0 they start with that many common tokens."""
    from rlver.train.scoring import logprob_metrics, score_tokens

    policy, reference, critic = _networks(tmp_path, algorithm, lora, kl)
    generator = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 512, (5, prompt + 14), generator=generator)
    ids[:, :prompt] = ids[0, :prompt]
    mask = torch.ones_like(ids)
    mask[:, : prompt + 5] = 0
    mask[1, prompt + 10 :] = 0  # a reply that ended early
    batch = _batch(ids, mask)
    batch.engine_logprobs = -torch.rand(ids.shape, generator=generator) * mask
    settings = PPOSettings(
        micro_batch_size=2, kl_coef=0.1 if kl else 0.0, entropy_coef=0.01,
        head_at_loss_positions=head_at_loss_positions, share_prompt_prefix=share,
    )  # fmt: skip
    old, ref, values = score_tokens(
        batch, policy, micro_batch_size=2, value_model=critic, reference=reference,
        adapter_off_reference=lora and kl, with_policy=scored, head_at_loss_positions=head_at_loss_positions,
        share_prefix=share,
    )  # fmt: skip
    advantages = torch.randn(ids.shape, generator=torch.Generator().manual_seed(7)) * mask
    returns = None if critic is None else (values + advantages) * mask
    optimizers = [torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)]
    if critic is not None:
        optimizers.append(torch.optim.AdamW(critic.parameters(), lr=1e-3))
    gradients = {}

    def optimizer_step(optimizer, counts_as_global_step):
        for name, parameter in [*policy.named_parameters(), *(critic.named_parameters() if critic else [])]:
            if parameter.grad is not None:
                gradients[name] = parameter.grad.clone()
        optimizer.step()

    policy_logprobs = None if scored else torch.zeros(ids.shape)
    metrics = ppo_update(
        batch, old, ref, advantages, values, returns,
        policy_model=policy, actor_optimizer=optimizers[0], value_model=critic,
        critic_optimizer=optimizers[1] if critic is not None else None, settings=settings, step=0,
        lockstep=Lockstep(optimizer_step=optimizer_step), logprobs_out=policy_logprobs,
    )  # fmt: skip
    logprob_metrics(old if scored else policy_logprobs, batch.engine_logprobs, ref, mask, "k3", metrics)
    weights = {name: parameter.detach().clone() for name, parameter in policy.named_parameters()}
    return metrics, gradients, weights, old if scored else policy_logprobs


@pytest.mark.parametrize("kl", [False, True], ids=["no-kl", "kl"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
@pytest.mark.parametrize("head", ["every-position", "loss-positions"])
def test_the_on_policy_update_without_a_scoring_pass_equals_the_scored_one(
    tmp_path, monkeypatch, algorithm, lora, kl, head
):
    """One optimizer step from the sampling policy: the update's own detached log-probs stand in
    for the scoring pass's; loss, gradients, weights after the step and logged metrics agree with
    the path rlver took before (a scoring pass, the head at every position). The new path does its
    vocabulary maths in chunks of 3 rows (1 position of a 2-row micro-batch), recomputed in the
    backward; the old one in one pass."""
    import rlver.modeling.batch

    scored = _one_update(tmp_path, algorithm, lora, kl, scored=True, head_at_loss_positions=False)
    monkeypatch.setattr(rlver.modeling.batch, "VOCAB_ROWS_PER_CHUNK", 3)
    unscored = _one_update(
        tmp_path, algorithm, lora, kl, scored=False, head_at_loss_positions=head != "every-position"
    )
    metrics, gradients, weights, logprobs = scored
    metrics_b, gradients_b, weights_b, logprobs_b = unscored
    torch.testing.assert_close(logprobs_b, logprobs, atol=1e-5, rtol=0)
    assert metrics.keys() == metrics_b.keys()
    assert ("ppo/kl" in metrics) == kl and ("ppo/value_loss" in metrics) == (algorithm == "ppo")
    for name, value in metrics.items():
        assert metrics_b[name] == pytest.approx(value, abs=1e-5, rel=1e-4), name
    assert metrics_b["ppo/clip_fraction"] == 0.0 and metrics_b["ppo/approx_kl"] == 0.0  # ratio exactly 1
    assert gradients.keys() == gradients_b.keys() and gradients
    for name in gradients:
        torch.testing.assert_close(gradients_b[name], gradients[name], atol=1e-6, rtol=1e-4)
    # AdamW's first step is lr x g / (|g| + 1e-8): where a gradient is near 1e-8, float32 noise in
    # it (within the tolerance above) moves the weight by a visible part of lr = 1e-3.
    for name in weights:
        torch.testing.assert_close(weights_b[name], weights[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scored", [True, False], ids=["scored", "on-policy"])
@pytest.mark.parametrize("kl", [False, True], ids=["no-kl", "kl"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_prompt_the_sequences_share_run_once_gives_the_same_update(
    tmp_path, monkeypatch, algorithm, lora, kl, scored
):
    """Five sequences opening with the same 40 tokens (a GRPO group's prompt): scoring's passes
    (policy, reference, the adapter-off reference) and the update's run the prompt once per
    micro-batch; log-probs, metrics, gradients and weights after the step equal the plain passes'."""
    import rlver.modeling.shared_prefix

    lengths = []
    original = rlver.modeling.shared_prefix.causal_lm_logits

    def counting(model, input_ids, *args, **kwargs):
        calls = []
        hook = model.get_input_embeddings().register_forward_hook(lambda m, a, o: calls.append(a[0].shape))
        try:
            return original(model, input_ids, *args, **kwargs)
        finally:
            hook.remove()
            lengths.append([tuple(shape) for shape in calls])

    monkeypatch.setattr(rlver.modeling.loss_positions, "causal_lm_logits", counting)
    plain = _one_update(tmp_path, algorithm, lora, kl, scored, prompt=40, share=False)
    assert all(calls == [calls[0]] and calls[0][1] == 54 for calls in lengths), lengths  # whole rows
    lengths.clear()
    shared = _one_update(tmp_path, algorithm, lora, kl, scored, prompt=40, share=True)
    # the update's sorted minibatch: micro-batches of 2, 2 and 1; a lone sequence runs whole
    assert [(1, 40), (2, 14)] in lengths and [(1, 54)] in lengths, lengths
    assert all(calls in ([(1, 40), (2, 14)], [(1, 54)]) for calls in lengths), lengths
    metrics, gradients, weights, logprobs = plain
    metrics_b, gradients_b, weights_b, logprobs_b = shared
    torch.testing.assert_close(logprobs_b, logprobs, atol=1e-5, rtol=0)
    assert metrics.keys() == metrics_b.keys()
    for name, value in metrics.items():
        assert metrics_b[name] == pytest.approx(value, abs=1e-5, rel=1e-4), name
    assert gradients.keys() == gradients_b.keys() and gradients
    for name in gradients:
        torch.testing.assert_close(gradients_b[name], gradients[name], atol=1e-6, rtol=1e-4)
    # AdamW's first step divides by |g| + 1e-8: where g is below ~1e-6, rounding noise in it
    # moves the weight by a visible part of lr, so the weights are compared where g is not.
    for name in weights:
        clear = (
            gradients[name].abs() > 1e-6 if name in gradients else torch.ones_like(weights[name], dtype=bool)
        )
        torch.testing.assert_close(weights_b[name][clear], weights[name][clear], atol=1e-5, rtol=1e-5)


def test_a_shared_prompt_needs_a_plain_cache_no_checkpointing_and_enough_tokens():
    """The cases the shared pass leaves to the plain one: too short a common prompt, a needed
    logit inside it, gradient checkpointing in training (its layers drop the cache) and a model
    whose cache is not plain full attention (found once, then remembered)."""
    from rlver.modeling.shared_prefix import MIN_SHARED_TOKENS, causal_lm_logits, shared_prefix_length

    ids = torch.randint(0, 512, (3, 60), generator=torch.Generator().manual_seed(8))
    ids[:, :45] = ids[0, :45]
    attention = torch.ones_like(ids)
    attention[2, 50:] = 0
    assert shared_prefix_length(ids, attention, 59) == 45
    assert shared_prefix_length(ids, attention, 20) == 20  # the logit at 20 is needed
    assert shared_prefix_length(ids[:1], attention[:1], 59) == 0  # one row shares with nobody
    short = ids.clone()
    short[1, MIN_SHARED_TOKENS - 1] += 1
    assert shared_prefix_length(short, attention, 59) == MIN_SHARED_TOKENS - 1

    def batches(model, input_ids, positions):
        calls = []
        hook = model.get_input_embeddings().register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
        logits = causal_lm_logits(model, input_ids, attention, positions)
        hook.remove()
        return calls, logits

    model = _tiny_llama()
    positions = torch.arange(45, 59)
    assert batches(model, ids, positions)[0] == [1, 3]
    assert batches(model, short, positions)[0] == [3]
    model.gradient_checkpointing_enable()
    model.train()
    assert batches(model, ids, positions)[0] == [3]
    model.eval()  # no checkpointing outside training: shared again
    assert batches(model, ids, positions)[0] == [1, 3]

    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, sliding_window=16,
    )  # fmt: skip
    windowed = MistralForCausalLM(config).eval()
    calls, logits = batches(windowed, ids, positions)
    assert calls == [1, 3]  # tried: its cache is a sliding window, so the plain pass ran
    expected = windowed(input_ids=ids, attention_mask=attention, logits_to_keep=positions).logits
    torch.testing.assert_close(logits, expected)
    assert batches(windowed, ids, positions)[0] == [3]  # remembered


def test_several_optimizer_steps_keep_the_scoring_pass():
    from rlver.train.scoring import has_active_dropout, on_policy_update

    model = _tiny_llama()
    one_step = PPOSettings()
    assert on_policy_update(one_step, 8, model, lambda value: value)
    assert not on_policy_update(PPOSettings(ppo_epochs=2), 8, model, lambda value: value)
    assert not on_policy_update(PPOSettings(minibatch_size=4), 8, model, lambda value: value)
    # the fullest rank decides: 4 here, 9 on another rank
    assert not on_policy_update(PPOSettings(minibatch_size=8), 4, model, lambda value: max(value, 9))
    assert on_policy_update(PPOSettings(minibatch_size=8), 4, model, lambda value: max(value, 8))
    in_reward = PPOSettings(kl_coef=0.1, kl_mode="in-reward")
    assert not on_policy_update(in_reward, 8, model, lambda value: value)  # the KL enters the advantages
    assert not has_active_dropout(model)
    model.config.attention_dropout = 0.1  # train-mode log-probs differ from the sampling policy's
    assert has_active_dropout(model) and not on_policy_update(one_step, 8, model, lambda value: value)

    ids = torch.randint(0, 512, (4, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    with pytest.raises(ValueError, match="old log-probs are needed: 2 optimizer steps"):
        ppo_update(
            _batch(ids, mask), None, None, mask.float(), None, None,
            policy_model=_tiny_llama(), actor_optimizer=torch.optim.SGD(_tiny_llama().parameters(), lr=0.1),
            settings=PPOSettings(ppo_epochs=2), step=0,
        )  # fmt: skip


# --------------------------------------------------------------------------- the head where the loss reads
@pytest.mark.parametrize("rows_per_chunk", [1024, 5])
def test_log_probs_and_entropy_at_the_loss_positions_equal_the_full_heads(monkeypatch, rows_per_chunk):
    """Also with the vocabulary maths in chunks of 5 rows (positions 1 at a time for 3 rows)."""
    import rlver.modeling.batch
    from rlver.modeling.batch import token_logprobs
    from rlver.modeling.loss_positions import loss_positions, policy_logprobs
    from rlver.rl.losses import entropy_from_logits

    model = _tiny_llama()
    ids = torch.randint(0, 512, (3, 16), generator=torch.Generator().manual_seed(2))
    attention = torch.ones_like(ids)
    mask = torch.zeros_like(ids)
    mask[0, 5:9] = 1  # different replies in different rows: the head runs at their union only
    mask[1, 12:] = 1
    assert loss_positions(mask).tolist() == [4, 5, 6, 7, 11, 12, 13, 14]
    for temperature in (1.0, 0.7):
        full = model(input_ids=ids, attention_mask=attention).logits
        expected = token_logprobs(full, ids, temperature) * mask
        expected_entropy = entropy_from_logits(full[:, :-1][mask[:, 1:].bool()], temperature).mean()
        monkeypatch.setattr(rlver.modeling.batch, "VOCAB_ROWS_PER_CHUNK", rows_per_chunk)
        got, entropy = policy_logprobs(model, ids, attention, mask, temperature, with_entropy=True)
        monkeypatch.undo()
        torch.testing.assert_close(got * mask, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=0)
        assert (got[:, :5] == 0).all()  # no row's loss reads before position 5: never computed

    calls = []
    model.lm_head.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[1]))
    policy_logprobs(model, ids, attention, mask)
    assert calls == [8]  # 8 of 15 positions went through the head


def test_a_model_without_logits_to_keep_gets_every_positions_head_and_a_placeholder_keeps_the_head_in_the_graph():
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlver.modeling.batch import token_logprobs
    from rlver.modeling.loss_positions import accepts_logits_to_keep, policy_logprobs

    class PlainForward(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask)

    model = _tiny_llama()
    assert accepts_logits_to_keep(model) and not accepts_logits_to_keep(PlainForward(model))
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(3))
    attention, mask = torch.ones_like(ids), torch.ones_like(ids)
    got, _ = policy_logprobs(PlainForward(model), ids, attention, mask)
    torch.testing.assert_close(got, token_logprobs(model(input_ids=ids).logits, ids), atol=1e-5, rtol=0)

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=False)  # fmt: skip
    untied = LlamaForCausalLM(config)
    placeholder = torch.zeros_like(ids)  # nothing to learn, the collectives still run
    logprobs, entropy = policy_logprobs(untied, ids % 64, attention, placeholder, with_entropy=True)
    ((logprobs * placeholder).sum() + entropy).backward()
    assert untied.lm_head.weight.grad is not None  # every rank's backward reaches the same parameters


def test_a_shared_prompt_with_right_padded_rows_of_unequal_prompts_gives_each_rows_own_log_probs():
    """A group's rows share 40 opening tokens, then their prompts go on for 0, 6 and 11 more tokens
    and their replies end at different lengths, right-padded: the shared pass's log-probs and
    gradient at every row's loss positions equal each row run alone, without padding (issue 42)."""
    from rlver.modeling.loss_positions import policy_logprobs

    model = _tiny_llama()
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 512, (3, 70), generator=generator)
    ids[:, :40] = ids[0, :40]
    prompt_ends, real_lengths = [40, 46, 51], [58, 70, 63]  # each row's own prompt, then reply, then padding
    attention, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, (prompt_end, length) in enumerate(zip(prompt_ends, real_lengths, strict=True)):
        attention[row, :length] = 1
        mask[row, prompt_end:length] = 1
        ids[row, length:] = 0  # the pad id
    batch_logprobs, entropy = policy_logprobs(
        model, ids, attention, mask, with_entropy=True, share_prefix=True
    )
    plain, plain_entropy = policy_logprobs(model, ids, attention, mask, with_entropy=True, share_prefix=False)
    torch.testing.assert_close(batch_logprobs * mask, plain * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, plain_entropy, atol=1e-5, rtol=0)
    for row, length in enumerate(real_lengths):
        alone, _ = policy_logprobs(
            model, ids[row : row + 1, :length], attention[row : row + 1, :length], mask[row : row + 1, :length],
            share_prefix=False,
        )  # fmt: skip
        torch.testing.assert_close(
            (batch_logprobs * mask)[row, :length], (alone * mask[row, :length])[0], atol=1e-5, rtol=0
        )

    def gradient(share):
        model.zero_grad()
        logprobs, _ = policy_logprobs(model, ids, attention, mask, share_prefix=share)
        (logprobs * mask).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    calls = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, a, o: calls.append(tuple(a[0].shape)))
    shared_gradient = gradient(True)
    hook.remove()
    # the common tokens once, up to the first logit a loss reads (row 0's token 40 is read at 39)
    assert calls == [(1, 39), (3, 31)]
    plain_gradient = gradient(False)
    for name, value in plain_gradient.items():
        torch.testing.assert_close(shared_gradient[name], value, atol=1e-6, rtol=1e-4)


def test_minibatch_plan_by_hand():
    """ppo_epochs fresh shuffles seeded by the step, each cut into ceil(most / size) minibatches;
    a rank with fewer sequences than the fullest one gets shorter or empty minibatches."""
    from rlver.train.ppo_update import plan_minibatches

    generator = torch.Generator().manual_seed(7)
    first, second = (torch.randperm(5, generator=generator).tolist() for _ in range(2))
    plan = plan_minibatches(5, 5, PPOSettings(ppo_epochs=2, minibatch_size=2), step=7)
    assert plan == [first[0:2], first[2:4], first[4:5], second[0:2], second[2:4], second[4:5]]
    # the fullest rank holds 8: four slots of 2 on every rank; this rank's 3 fill two of them
    short = plan_minibatches(3, 8, PPOSettings(minibatch_size=2), step=0)
    assert len(short) == 4 and [len(rows) for rows in short] == [2, 1, 0, 0]
    assert sorted(row for rows in short for row in rows) == [0, 1, 2]
    # minibatch_size 0: one minibatch a epoch of everything this rank holds
    assert [sorted(rows) for rows in plan_minibatches(3, 4, PPOSettings(), step=1)] == [[0, 1, 2]]
    assert plan_minibatches(0, 0, PPOSettings(), step=0) == []


def test_micro_batch_plan_by_hand():
    from rlver.train.ppo_update import plan_micro_batches

    assert plan_micro_batches([4, 1, 3], 2, 2) == [[4, 1], [3]]
    assert plan_micro_batches([4, 1, 3], 2, 4) == [[4, 1], [3], [], []]  # padded to every rank's count
    prompts = {4: [9, 1], 1: [2, 5], 3: [9, 0]}
    assert plan_micro_batches([4, 1, 3], 2, 2, sort_key=prompts.__getitem__) == [[1, 3], [4]]
    assert plan_micro_batches([], 2, 1) == [[]]


def test_update_metrics_weigh_micro_batches_and_average_minibatch_norms():
    from rlver.train.ppo_update import UpdateMetrics

    metrics = UpdateMetrics(("policy_loss",))
    metrics.add_micro_batch({"policy_loss": 1.0}, 3.0)  # 3 tokens
    metrics.add_micro_batch({"policy_loss": 5.0}, 1.0)  # 1 token
    metrics.add_gradient_norm("ppo/grad_norm", 2.0)
    metrics.add_gradient_norm("ppo/grad_norm", 4.0)
    assert metrics.result(Lockstep()) == {"ppo/grad_norm": 3.0, "ppo/policy_loss": 2.0}
