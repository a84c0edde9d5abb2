"""The learning-rate schedule: linear warmup, then constant or a linear / cosine decay."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rlver.modeling.networks import OptimizerSettings, lr_factor, optimizers_and_schedulers
from rlver.train.components import checked_settings


def factors(schedule: str, warmup: int, total: int, min_ratio: float = 0.0) -> list[float]:
    return [
        lr_factor(step, schedule=schedule, warmup_steps=warmup, total_steps=total, min_ratio=min_ratio)
        for step in range(total)
    ]


def test_constant_is_warmup_then_flat():
    assert factors("constant", 0, 4) == [1.0, 1.0, 1.0, 1.0]
    assert factors("constant", 2, 5) == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_linear_falls_from_the_peak_after_warmup_towards_the_floor_at_max_steps():
    # 2 warmup updates, then 4 decaying ones: the floor is reached after the last update, so the
    # last one still learns (a schedule that hit 0 on the last update would waste it).
    assert factors("linear", 2, 6, min_ratio=0.2) == pytest.approx([0.5, 1.0, 1.0, 0.8, 0.6, 0.4])
    assert factors("linear", 0, 4) == pytest.approx([1.0, 0.75, 0.5, 0.25])


def test_cosine_is_half_way_down_at_half_the_decay():
    values = factors("cosine", 0, 8, min_ratio=0.1)
    assert values[0] == 1.0
    assert values[4] == pytest.approx(0.1 + 0.9 * 0.5)
    assert all(a > b for a, b in itertools.pairwise(values))
    assert values[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))


def test_the_optimizers_follow_the_schedule_step_by_step():
    policy, critic = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    settings = OptimizerSettings(
        actor_lr=1e-3, critic_lr=1e-2, weight_decay=0.0, actor_warmup_ratio=0.0, critic_warmup_ratio=0.5,
        lr_schedule="linear", min_lr_ratio=0.5,
    )  # fmt: skip
    optimizers, schedulers = optimizers_and_schedulers(policy, critic, settings, total_steps=4)
    seen = []
    for _ in range(4):
        seen.append([optimizer.param_groups[0]["lr"] for optimizer in optimizers])
        for optimizer in optimizers:
            optimizer.step()
        for scheduler in schedulers:
            scheduler.step()
    actor = [lrs[0] for lrs in seen]
    critic_rates = [lrs[1] for lrs in seen]
    assert actor == pytest.approx([1e-3, 0.875e-3, 0.75e-3, 0.625e-3])
    assert critic_rates == pytest.approx([0.5e-2, 1e-2, 1e-2, 0.75e-2])  # its own 2-step warmup first


@pytest.mark.parametrize(
    ("schedule", "min_ratio", "message"),
    [
        ("step", 0.0, "--model.lr_schedule ('step') must be one of constant, linear, cosine"),
        ("cosine", 1.5, "--model.min_lr_ratio (1.5) must be within [0, 1]"),
    ],
)
def test_a_bad_schedule_is_one_error_naming_the_flag(schedule, min_ratio, message):
    with pytest.raises(ValueError) as error:
        checked_settings(
            dtype="float32", group_size=4, rollout={}, ppo={}, lora=None, eval_temperature=0.0, curriculum=None,
            optimizer={"lr_schedule": schedule, "min_lr_ratio": min_ratio},
        )  # fmt: skip
    assert str(error.value) == message
