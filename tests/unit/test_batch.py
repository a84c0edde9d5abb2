"""Trajectories to training tensors: sequences, masks and per-dialogue timelines, by hand."""

import pytest
import torch

from rlver.core.interfaces import ParsedReply
from rlver.core.types import Profile, UserTurn
from rlver.modeling.batch import build_batch, token_logprobs
from rlver.rl.advantages import gae, terminal_rewards
from rlver.rollout.runner import PolicyTurn, Trajectory

PROFILE = Profile("p", "player", "scene", "passive", ("a",), "You want deep empathy.")


def trajectory(turns):
    t = Trajectory(PROFILE, 0, "system")
    t.user_turns = [UserTurn("u", 40.0)] * (len(turns) + 1)
    t.policy_turns = [PolicyTurn(p, r, [-0.5] * len(r), "stop", "x", ParsedReply("x")) for p, r in turns]
    return t


def test_timelines_span_turns_and_skip_user_tokens():
    packed = trajectory([([1, 2], [3, 4]), ([1, 2, 3, 4, 5], [6])])  # one sequence: 1 2 [3 4] 5 [6]
    split = trajectory([([7], [8]), ([9], [10, 11])])  # history re-rendered: two sequences
    batch = build_batch([packed, split], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 0, 0, 0, 0], [9, 10, 11, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 1], [0, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]
    assert batch.sequence_dialogue.tolist() == [0, 1, 1]
    assert batch.timeline_mask.tolist() == [[1, 1, 1], [1, 1, 1]]
    assert batch.timeline_seq.tolist() == [[0, 0, 0], [1, 2, 2]]
    assert batch.timeline_pos.tolist() == [[2, 3, 5], [1, 1, 2]]
    assert batch.to_timeline(batch.input_ids.float()).tolist() == [[3, 4, 6], [8, 10, 11]]


def test_advantages_land_only_on_policy_tokens():
    batch = build_batch([trajectory([([1, 2], [3, 4]), ([1, 2, 3, 4, 5], [6])])], pad_id=0)
    rewards = terminal_rewards(torch.tensor([0.8]), batch.timeline_mask)
    values = torch.tensor([[0.5, 0.6, 0.7]])
    advantages, _ = gae(rewards, values, batch.timeline_mask)
    on_sequences = batch.to_sequences(advantages)
    assert torch.allclose(on_sequences, torch.tensor([[0.0, 0.0, 0.3, 0.2, 0.0, 0.1]]))
    assert (on_sequences * (1 - batch.loss_mask)).abs().sum() == 0  # nothing on user or prompt tokens


def test_token_logprobs_are_shifted_by_one():
    logits = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]]))
    ids = torch.tensor([[0, 1, 1]])
    expected = torch.tensor([[0.0, torch.log(torch.tensor(0.5)), torch.log(torch.tensor(0.1))]])
    assert torch.allclose(token_logprobs(logits, ids), expected)


def _one_pass(logits, targets, temperature):
    """The log-probs and entropies as one float32 pass over the whole tensor computes them."""
    scaled = logits.float() / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    picked = logprobs.gather(2, targets[..., None]).squeeze(2)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return picked, entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocabulary_chunks_give_the_one_pass_values_and_gradients(monkeypatch, dtype):
    """5 rows a chunk over (3, 7, 11) logits: positions in chunks of 1 (target log-probs) and
    rows of 5 (entropy): the same numbers and the same gradient as one pass over everything."""
    import rlver.modeling.batch
    from rlver.rl.losses import entropy_from_logits

    monkeypatch.setattr(rlver.modeling.batch, "VOCAB_ROWS_PER_CHUNK", 5)
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(3, 7, 11, generator=generator).to(dtype)
    targets = torch.randint(0, 11, (3, 7), generator=generator)
    weights = torch.randn(3, 7, generator=generator)
    results = []
    for chunked in (True, False):
        logits = base.clone().requires_grad_(True)
        if chunked:
            picked = rlver.modeling.batch.target_logprobs(logits, targets, temperature=0.7)
            entropy = rlver.modeling.batch.in_vocab_chunks(
                entropy_from_logits, logits.reshape(21, 11), dim=0, temperature=0.7
            ).reshape(3, 7)
        else:
            picked, entropy = _one_pass(logits, targets, 0.7)
        ((picked * weights).sum() + (entropy * weights).sum()).backward()
        results.append((picked.detach(), entropy.detach(), logits.grad))
    (picked, entropy, grad), (picked_1, entropy_1, grad_1) = results
    torch.testing.assert_close(picked, picked_1, rtol=1e-5, atol=1e-5)  # float32 maths on equal inputs
    torch.testing.assert_close(entropy, entropy_1, rtol=1e-5, atol=1e-5)
    ulp = 1e-5 if dtype == torch.float32 else 2**-7  # bf16 gradients: summed in another order
    torch.testing.assert_close(grad, grad_1, rtol=ulp, atol=ulp)
    assert results[0][2].dtype == dtype  # the gradient arrives in the logits' own dtype


def test_the_backward_keeps_the_logits_not_their_float32_copy(monkeypatch):
    """What autograd saves for the backward, in bytes: chunked, the bf16 logits themselves (each
    chunk's float32 work is recomputed); one pass keeps a float32 copy and the log-softmax too."""
    import rlver.modeling.batch

    monkeypatch.setattr(rlver.modeling.batch, "VOCAB_ROWS_PER_CHUNK", 8)
    logits = torch.randn(2, 64, 1000).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 1000, (2, 64))

    def saved_bytes(compute):
        seen = {}

        def pack(tensor):
            seen[(tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))] = (
                tensor.numel() * tensor.element_size()
            )
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            compute()
        return sum(seen.values())

    logits_bytes = logits.numel() * logits.element_size()
    chunked = saved_bytes(lambda: rlver.modeling.batch.target_logprobs(logits, targets, 0.7).sum())
    one_pass = saved_bytes(lambda: _one_pass(logits, targets, 0.7)[0].sum())
    assert chunked <= logits_bytes * 1.05, (chunked, logits_bytes)
    assert one_pass >= logits_bytes * 4, (one_pass, logits_bytes)  # bf16 -> float32 copy and log-softmax
