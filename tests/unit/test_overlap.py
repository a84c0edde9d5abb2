"""The overlapped mode's parts: the behaviour correction, the pending rollout, its checkpoint copy."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from rlver.core.interfaces import ParsedReply
from rlver.core.trajectory import PolicyTurn, Trajectory
from rlver.core.types import UserTurn
from rlver.rollout.overlap import (
    OverlapSettings,
    RolloutPipeline,
    behaviour_correction,
    trajectories_from_json,
    trajectories_to_json,
)
from tests.unit.test_rollout import make_profile


def test_the_correction_weights_each_token_by_its_truncated_behaviour_ratio():
    advantages = torch.tensor([[1.0, -2.0, 3.0, 5.0]])
    proximal = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    behaviour = torch.tensor([[-1.0, -1.5, -0.5, -9.0]])  # ratios 1, e^0.5, e^-0.5, e^8 (truncated)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last position is no policy token
    metrics = {}
    corrected = behaviour_correction(advantages, proximal, behaviour, mask, 1, 1.5, metrics)
    expected = [1.0, -2.0 * 1.5, 3.0 * math.exp(-0.5), 5.0]  # e^0.5 = 1.65 > 1.5: truncated
    assert corrected[0].tolist() == pytest.approx(expected)
    assert metrics["offpolicy/importance_weight_mean"] == pytest.approx(
        (1 + math.exp(0.5) + math.exp(-0.5)) / 3
    )
    assert metrics["offpolicy/importance_weight_max"] == pytest.approx(math.exp(0.5))
    assert metrics["offpolicy/truncated_fraction"] == pytest.approx(1 / 3)
    assert metrics["offpolicy/staleness"] == 1.0


def test_settings_are_checked():
    with pytest.raises(ValueError, match="max_importance_weight .0.5. must be >= 1"):
        OverlapSettings(max_importance_weight=0.5)
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"--model.overlap.max_staleness .* must be an integer >= 1"):
            OverlapSettings(max_staleness=bad)
    assert OverlapSettings(max_staleness=3).max_staleness == 3


def trajectory(name):
    profile = make_profile(name, note="kept")
    turns = [PolicyTurn([1, 2], [3, 4], [-0.1234567890123, -2.5e-9], "stop", "hi", ParsedReply("hi"))]
    return Trajectory(
        profile, 7, "sys", [UserTurn("open", 40.0), UserTurn("ok", 45.0, 5.0, {"why": ["x"]})], turns,
        termination="max_turns", components={"engine": "hf"}, difficulty="hard",
    )  # fmt: skip


def test_the_checkpoint_copy_of_pending_dialogues_is_exact():
    trajectories = [trajectory("a"), trajectory("b")]
    again = trajectories_from_json(trajectories_to_json(trajectories))
    assert again == trajectories
    assert again[0].profile.extra == {"note": "kept"} and again[0].policy_turns[0].logprobs[1] == -2.5e-9
    assert [t.sequences[0].input_ids for t in again] == [[1, 2, 3, 4]] * 2


def test_a_pending_rollout_is_used_only_for_its_own_step_and_profiles():
    pipeline = RolloutPipeline()
    profiles = [make_profile("a"), make_profile("b")]
    pipeline.start(3, profiles, weights_step=2, run=lambda timings: [trajectory("a"), trajectory("b")])
    assert pipeline.matching(4, profiles) is None
    assert pipeline.matching(3, profiles[:1]) is None
    pending = pipeline.matching(3, profiles)
    assert pending.weights_step == 2 and [t.profile.id for t in pending.result()] == ["a", "b"]
    assert pipeline.pending == {3: pending}  # kept until the step goes on: a stop checkpoints it
    pipeline.finish(3)
    pipeline.start(4, profiles, weights_step=3, run=lambda timings: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        pipeline.matching(4, profiles)  # the background rollout's error surfaces in the step
    pipeline.drop()
    assert pipeline.pending == {}


def test_rollouts_of_several_steps_run_at_once_each_with_its_timings():
    """max_staleness 2: two steps' rollouts in flight together (each waits for the other to
    have started: run one at a time, this would never finish)."""
    pipeline = RolloutPipeline(workers=2)
    profiles = [make_profile("a")]
    started = [threading.Event(), threading.Event()]

    def run(index):
        def body(timings):
            started[index].set()
            assert started[1 - index].wait(timeout=60), "the other step's rollout never started"
            timings.update(generate=float(index), simulator=10.0 + index)
            return [trajectory("a")]

        return body

    first = pipeline.start(5, profiles, weights_step=4, run=run(0))
    second = pipeline.start(6, profiles, weights_step=4, run=run(1))
    pipeline.wait()
    assert list(pipeline.pending) == [5, 6]
    assert pipeline.matching(5, profiles) is first and first.timings == {"generate": 0.0, "simulator": 10.0}
    pipeline.finish(5)
    assert pipeline.matching(6, profiles) is second and second.timings["simulator"] == 11.0
    pipeline.finish(6)
    assert not pipeline.pending
