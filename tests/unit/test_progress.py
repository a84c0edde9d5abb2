"""The per-step lines a log file gets: each says how long its own steps took."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import rlver.train.progress as progress
from rlver.train.progress import StepProgress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(progress.time, "perf_counter", fake)
    return fake


def run_steps(bar, trainer, clock, before_training, step_seconds, between=0.0):
    """on_train_start, `before_training` seconds of other callbacks' work, then the steps."""
    bar.on_train_start(trainer, None)
    clock.now += before_training
    for seconds in step_seconds:
        bar.on_train_batch_start(trainer, None, None, 0)
        clock.now += seconds
        trainer.global_step += 1
        bar.on_train_batch_end(trainer, None, None, None, 0)
        clock.now += between


def printed_seconds(capsys):
    lines = capsys.readouterr().out.splitlines()
    return [int(line.rsplit("(", 1)[1].split(" s)")[0]) for line in lines if line.startswith("step ")]


@pytest.fixture
def bar(monkeypatch):
    step_bar = StepProgress()
    monkeypatch.setattr(StepProgress, "_interactive", property(lambda self: False))  # a log file
    monkeypatch.setattr(step_bar, "get_metrics", lambda trainer, module: {"reward/total": 0.3})
    return step_bar


def trainer(every: int = 1):
    return SimpleNamespace(is_global_zero=True, global_step=0, max_steps=4, log_every_n_steps=every)


def test_the_first_step_does_not_count_the_evaluation_before_training(bar, clock, capsys):
    # BeforeAfter talks with the held-out users in on_train_start, after the bar's own hook
    run_steps(bar, trainer(), clock, before_training=90.0, step_seconds=[30.0, 25.0, 20.0, 28.0], between=2.0)
    assert printed_seconds(capsys) == [30, 25, 20, 28]


def test_a_line_every_n_steps_covers_its_steps_and_what_ran_between_them(bar, clock, capsys):
    run_steps(
        bar, trainer(every=2), clock, before_training=90.0, step_seconds=[30.0, 25.0, 20.0, 28.0], between=2.0
    )
    assert printed_seconds(capsys) == [57, 50]  # 30 + 2 + 25, then 20 + 2 + 28
