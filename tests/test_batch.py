"""Trajectories to training tensors: sequences, masks and per-dialogue timelines, by hand."""

import torch

from rlver.batch import build_batch, token_logprobs
from rlver.interfaces import ParsedReply
from rlver.rl.advantages import gae, terminal_rewards
from rlver.rollout import PolicyTurn, Trajectory
from rlver.types import Profile, UserTurn

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
