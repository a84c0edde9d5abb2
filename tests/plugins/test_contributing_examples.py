"""CONTRIBUTING.md's "A new reward" and "A new advantage estimator" run as written: their code
blocks are executed as plugin modules, checked on hand-made inputs, then trained with in a short
fit whose observer hooks (`rlver_on_rollout_end`, `rlver_on_train_step_end`) record what rlver
handed them."""

from __future__ import annotations

import re
import types

import pytest
import torch

from rlver import hookimpl
from rlver.core.interfaces import AdvantageBatch
from rlver.core.plugins import get_registry, reset_registry
from tests.conftest import REPO


def example(heading: str) -> types.ModuleType:
    """The python block under `### <heading>` in CONTRIBUTING.md, as a module."""
    text = (REPO / "CONTRIBUTING.md").read_text()
    section = text.split(f"### {heading}\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    module = types.ModuleType(f"contributing_{heading.lower().replace(' ', '_')}")
    exec(compile(code, f"CONTRIBUTING.md: {heading}", "exec"), module.__dict__)
    return module


@pytest.fixture
def registry():
    reset_registry()
    registry = get_registry()
    registry.add(example("A new reward"), name="example-reward")
    registry.add(example("A new advantage estimator"), name="example-advantage")
    yield registry
    reset_registry()


def test_the_reward_example_pays_each_questioning_turn(registry):
    from types import SimpleNamespace

    reward = registry.build("rewards", {"name": "question_bonus", "bonus": 0.5}, flag="--model.rewards")

    def turn(text):
        return SimpleNamespace(parsed=SimpleNamespace(visible=text))

    dialogues = [
        SimpleNamespace(policy_turns=[turn("How do you feel?"), turn("I see.")]),
        SimpleNamespace(policy_turns=[turn("Tell me more.")]),
    ]
    assert reward(dialogues) == [[0.5, 0.0], [0.0]]


def test_the_estimator_example_centres_each_group_on_its_mean(registry):
    estimator = registry.build("advantages", "group_mean_baseline", flag="--model.advantage")
    assert estimator.requires_groups and not estimator.requires_critic and estimator.gamma == 1.0
    token_rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0], [0.0, 5.0], [0.0, 5.0]])
    batch = AdvantageBatch(
        token_rewards=token_rewards,
        values=None,
        mask=torch.ones(4, 2),
        group_ids=torch.tensor([0, 0, 1, 1]),
        valid=torch.tensor([True, True, True, False]),
    )
    advantages = estimator(batch).advantages
    assert advantages[:, 0].tolist() == [-1.0, 1.0, 0.0, 0.0]  # group 1: its one valid dialogue is the mean
    assert advantages[3].abs().sum() == 0  # an invalid dialogue gets nothing


class ObserverRecorder:
    def __init__(self) -> None:
        self.rollouts: list[tuple[int | None, int]] = []
        self.steps: list[tuple[int, dict[str, float]]] = []

    @hookimpl
    def rlver_on_rollout_end(self, trajectories, step):
        self.rollouts.append((step, len(trajectories)))

    @hookimpl
    def rlver_on_train_step_end(self, metrics, step):
        self.steps.append((step, dict(metrics)))


@pytest.mark.slow
def test_a_fit_trains_with_both_examples_and_calls_the_observer_hooks(registry, tmp_path, tiny_model_dir):
    from rlver.data.datamodule import ProfileDataModule
    from rlver.rollout.runner import RolloutSettings
    from rlver.train.module import RLVERModule
    from rlver.train.trainer import Trainer

    recorder = ObserverRecorder()
    registry.add(recorder, name="example-observers")
    module = RLVERModule(
        policy=str(tiny_model_dir),
        simulator={"name": "embedded", "judge": "rubric"},
        rewards=["final_emotion", {"name": "question_bonus", "weight": 0.1}],
        advantage="group_mean_baseline",
        group_size=2,
        rollout=RolloutSettings(max_turns=2, max_new_tokens=8),
        log_samples_every_n_steps=0,
    )
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, ProfileDataModule(batch_size=2, limit=8))
    assert recorder.rollouts == [(0, 4), (1, 4)]  # 2 profiles x group 2, each step
    assert [step for step, _ in recorder.steps] == [0, 1]
    for _, metrics in recorder.steps:
        assert "reward/question_bonus" in metrics and "reward/final_emotion" in metrics
        assert metrics["ppo/grad_norm"] >= 0
