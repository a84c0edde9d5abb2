"""Error bars: the t interval and the paired change against hand-computed cases; BeforeAfter's use of them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rlver.evaluate.intervals import (
    mean_interval,
    paired_by_key,
    paired_change,
    per_user_means,
    training_rise,
)
from rlver.train.callbacks import BeforeAfter, heldout_scores


def test_mean_interval_matches_the_hand_computed_t_interval():
    # [1, 2, 3, 4]: mean 2.5, sample sd sqrt(5/3) = 1.29099, s.e. 0.645497, t(0.975; 3) = 3.182446.
    interval = mean_interval([1.0, 2.0, 3.0, 4.0])
    assert interval.mean == pytest.approx(2.5)
    assert interval.low == pytest.approx(2.5 - 3.182446 * 0.645497, abs=1e-5)
    assert interval.high == pytest.approx(2.5 + 3.182446 * 0.645497, abs=1e-5)
    assert interval.count == 4 and interval.excludes_zero
    # Two values 0 and 2: mean 1, s.e. 1, t(0.975; 1) = 12.7062.
    wide = mean_interval([0.0, 2.0])
    assert (wide.low, wide.high) == pytest.approx((1 - 12.7062, 1 + 12.7062), abs=1e-4)
    assert not wide.excludes_zero
    assert wide.format(signed=True) == "+1.0 [-11.7, +13.7]"


def test_degenerate_samples_have_no_width_and_empty_ones_are_refused():
    assert mean_interval([3.0]).format() == "3.0"
    same = mean_interval([2.0, 2.0, 2.0])
    assert (same.low, same.high) == (2.0, 2.0)
    with pytest.raises(ValueError, match="at least one value"):
        mean_interval([])


def test_paired_change_is_the_interval_of_per_user_differences():
    before = [30.0, 40.0, 20.0, 50.0]
    after = [31.0, 42.0, 23.0, 54.0]  # changes 1, 2, 3, 4: the case above, whatever the users' levels
    change = paired_change(before, after)
    assert change.change.mean == pytest.approx(2.5)
    assert change.change.low == pytest.approx(0.4458, abs=1e-4)
    assert change.change.high == pytest.approx(4.5542, abs=1e-4)
    assert (change.before, change.after, change.better, change.worse) == (35.0, 37.5, 4, 0)
    assert change.format() == "+2.5 [+0.4, +4.6]; 4/4 users ended happier"
    with pytest.raises(ValueError, match="as many values"):
        paired_change([1.0], [1.0, 2.0])


def test_pairing_by_profile_id_ignores_order_and_refuses_missing_users():
    change = paired_by_key({"a": 10.0, "b": 20.0}, {"b": 25.0, "a": 9.0})
    assert change.change.mean == pytest.approx(2.0) and (change.better, change.worse) == (1, 1)
    with pytest.raises(ValueError, match="unpaired: c"):
        paired_by_key({"a": 1.0, "c": 2.0}, {"a": 1.0})


def test_training_rise_compares_the_last_quarter_with_the_first_by_welch():
    # 9 steps: quarters of 2 (steps 1-2 and 8-9). First 30, 32 (mean 31, variance 2); last 34, 36.
    curve = dict(enumerate([30.0, 32.0, 0.0, 0.0, 0.0, 0.0, 0.0, 34.0, 36.0], start=1))
    rise = training_rise(curve)
    assert (rise.first, rise.last, rise.rise.mean) == (31.0, 35.0, 4.0)
    # Welch, equal variances and sizes: se sqrt(2/2 + 2/2), 2 degrees of freedom: t 4.302653.
    assert rise.rise.high - 4.0 == pytest.approx(4.302653 * 2**0.5, abs=1e-5)
    assert rise.format() == "31.0 -> 35.0 (+4.0 [-2.1, +10.1])"
    # 4-7 steps: one step a quarter, no spread, no interval; under 4 steps nothing.
    assert training_rise({1: 30.0, 2: 0.0, 3: 0.0, 4: 33.5}).format() == "30.0 -> 33.5 (+3.5)"
    assert training_rise({1: 30.0, 2: 31.0, 3: 32.0}) is None


def test_per_user_means_average_each_users_samples():
    assert per_user_means(["a", "a", "b"], [10.0, 20.0, 7.0]) == {"a": 15.0, "b": 7.0}


class _Recorder:
    """An `evaluation_rollouts` that remembers its calls and scores each dialogue from its index."""

    def __init__(self, scores):
        self.calls, self.scores = [], scores

    def __call__(self, profiles, *, seed):
        self.calls.append(([p.id for p in profiles], seed))
        return [_Dialogue(p.id, self.scores(i, p)) for i, p in enumerate(profiles)]


class _Dialogue(SimpleNamespace):
    def __init__(self, profile_id, final_emotion):
        super().__init__(profile_id=profile_id, final_emotion=final_emotion, user_turns=[], policy_turns=[])

    def to_record(self):
        return {"profile_id": self.profile_id, "final_emotion": self.final_emotion}


def _profiles(*ids):
    return [SimpleNamespace(id=i) for i in ids]


def test_heldout_scores_run_k_samples_per_user_in_one_call_and_average_them():
    evaluate = _Recorder(lambda index, profile: float(index))
    scores = heldout_scores(evaluate, _profiles("u1", "u2"), seed=5, samples=3)
    assert evaluate.calls == [(["u1", "u1", "u1", "u2", "u2", "u2"], 5)]
    assert scores == {"u1": 1.0, "u2": 4.0}


def _trainer(profiles, step, tmp_path):
    return SimpleNamespace(
        datamodule=SimpleNamespace(profiles=lambda split: profiles),
        global_step=step,
        max_steps=3,
        interrupted=False,
        global_rank=0,
        log_dir=str(tmp_path),
        default_root_dir=str(tmp_path),
        callbacks=[],
    )


def test_before_after_uses_its_own_seed_not_the_training_seed_and_prints_the_interval(tmp_path, capsys):
    profiles = _profiles("u1", "u2", "u3", "u4")
    trained = {"u1": 1.0, "u2": 2.0, "u3": 3.0, "u4": 4.0}
    modules = []
    for training_seed in (0, 1):
        module = SimpleNamespace(
            runner=SimpleNamespace(engine=SimpleNamespace(sync_weights=lambda: None)),
            rollout_settings=SimpleNamespace(seed=training_seed),
        )
        module.evaluation_rollouts = _Recorder(
            lambda i, p, m=module: 30.0 + (trained[p.id] if m.trained else 0.0)
        )
        module.trained = False
        callback = BeforeAfter(limit=0, seed=11)
        callback.on_train_start(_trainer(profiles, 0, tmp_path), module)
        module.trained = True
        callback.on_train_end(_trainer(profiles, 3, tmp_path), module)
        modules.append(module)
    # Both training seeds evaluated at the callback's seed 11, before and after.
    assert [seed for m in modules for _, seed in m.evaluation_rollouts.calls] == [11, 11, 11, 11]
    out = capsys.readouterr().out
    assert "after 3 steps  32.5  (+2.5 [+0.4, +4.6]; 4/4 users ended happier)" in out
    record = json.loads((tmp_path / "before_after.json").read_text())
    assert record["before"] == {p.id: 30.0 for p in profiles}
    # The evaluation's dialogues beside the scores, before and after, as transcripts.
    for stage, score in (("before", 30.0), ("after", 31.0)):
        lines = (tmp_path / "before_after" / f"{stage}.jsonl").read_text().splitlines()
        dialogues = [json.loads(line) for line in lines]
        assert [d["profile_id"] for d in dialogues] == ["u1", "u2", "u3", "u4"]
        assert dialogues[0]["final_emotion"] == score and dialogues[0]["evaluation_seed"] == 11
    assert record["change"]["change_low"] == pytest.approx(0.4458, abs=1e-4)
    assert record["seed"] == 11 and record["step"] == 3


def test_before_after_writes_no_transcripts_when_asked_not_to(tmp_path):
    module = SimpleNamespace(runner=SimpleNamespace(engine=SimpleNamespace(sync_weights=lambda: None)))
    module.evaluation_rollouts = _Recorder(lambda i, p: 30.0)
    BeforeAfter(transcripts=False).on_train_start(_trainer(_profiles("u1"), 0, tmp_path), module)
    assert (tmp_path / "before_after.json").is_file() and not (tmp_path / "before_after").exists()


def test_before_after_rejects_bad_settings():
    with pytest.raises(ValueError, match="samples"):
        BeforeAfter(samples=0)
    with pytest.raises(ValueError, match="limit"):
        BeforeAfter(limit=-1)


def test_before_after_keeps_the_training_curve_through_a_resume_and_prints_its_rise(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    profiles = _profiles("u1", "u2")
    module = SimpleNamespace(runner=SimpleNamespace(engine=SimpleNamespace(sync_weights=lambda: None)))
    module.evaluation_rollouts = _Recorder(lambda i, p: 30.0)
    emotions = [30.0, 32.0, 31.0, 33.0, 33.0, 34.0, 34.0, 36.0]  # quarters: 30, 32 and 34, 36

    def step(callback, trainer, number):
        trainer.global_step = number
        trainer.callback_metrics = {"rollout/final_emotion": torch.tensor(emotions[number - 1])}
        callback.on_train_batch_end(trainer, module, None, None, 0)

    first = BeforeAfter()
    trainer = _trainer(profiles, 0, tmp_path)
    first.on_train_start(trainer, module)
    for number in range(1, 6):
        step(first, trainer, number)
    saved = json.loads((tmp_path / "before_after.json").read_text())
    assert (
        saved["training_curve"] == {str(n): emotions[n - 1] for n in range(1, 6)} and saved["after"] is None
    )

    # Killed after step 5; the last checkpoint holds step 4, so step 5 is trained again.
    resumed = BeforeAfter()
    trainer = _trainer(profiles, 4, tmp_path)
    resumed.on_train_start(trainer, module)
    assert resumed.curve == {n: emotions[n - 1] for n in range(1, 5)}
    for number in range(5, 9):
        step(resumed, trainer, number)
    trainer.max_steps = 8
    resumed.on_train_end(trainer, module)
    out = capsys.readouterr().out
    assert "training reward  31.0 -> 35.0 (+4.0 [-2.1, +10.1])" in out and "of 8 steps" in out
    record = json.loads((tmp_path / "before_after.json").read_text())
    assert record["training_rise"]["mean"] == pytest.approx(4.0) and len(record["training_curve"]) == 8


class _ScoredBySimulator:
    """An `evaluation_rollouts` whose users are the training simulator's (no `simulator`) or an
    evaluator's: each scores a user from the stage (before / after) and who is judging."""

    def __init__(self, module, scores):
        self.module, self.scores, self.seen = module, scores, []

    def __call__(self, profiles, *, seed, simulator=None):
        judge = "train" if simulator is None else simulator.label
        self.seen.append(judge)
        return [_Dialogue(p.id, self.scores(judge, self.module.trained, p)) for p in profiles]


def test_before_after_scores_the_policy_with_users_it_never_trained_against(tmp_path, capsys, monkeypatch):
    """Issue 56 (4): the training simulator says +4, the other evaluator sees no gain: both are
    printed with their paired change, and `evaluations` in before_after.json keeps the other's."""
    from rlver.core import plugins

    built = []

    class FakeRegistry:
        def check(self, kind, spec, flag):
            assert kind == "simulators" and flag.startswith("BeforeAfter evaluators[")

        def build(self, kind, spec, flag):
            built.append(spec)
            return SimpleNamespace(label="strict", close=lambda: built.append("closed"))

    monkeypatch.setattr(plugins, "get_registry", FakeRegistry)
    profiles = _profiles("u1", "u2", "u3")
    module = SimpleNamespace(
        runner=SimpleNamespace(engine=SimpleNamespace(sync_weights=lambda: None)), trained=False
    )
    gains = {"u1": 3.0, "u2": 4.0, "u3": 5.0}
    module.evaluation_rollouts = _ScoredBySimulator(
        module, lambda judge, trained, p: 30.0 + (gains[p.id] if trained and judge == "train" else 0.0)
    )
    callback = BeforeAfter(evaluators=[{"name": "embedded", "judge": "rubric", "label": "strict"}])
    assert callback.evaluators == {"strict": {"name": "embedded", "judge": "rubric"}}
    callback.on_train_start(_trainer(profiles, 0, tmp_path), module)
    module.trained = True
    callback.on_train_end(_trainer(profiles, 3, tmp_path), module)
    assert module.evaluation_rollouts.seen == ["train", "strict", "train", "strict"]
    assert built == [{"name": "embedded", "judge": "rubric"}, "closed"]  # built once, closed at the end
    out = capsys.readouterr().out
    assert "after 3 steps  34.0  (+4.0 [+1.5, +6.5]; 3/3 users ended happier)" in out
    assert "on strict  30.0 -> 30.0  (+0.0 [+0.0, +0.0]; 0/3 users ended happier)" in out
    record = json.loads((tmp_path / "before_after.json").read_text())
    strict = record["evaluations"]["strict"]
    assert strict["before"] == strict["after"] == {"u1": 30.0, "u2": 30.0, "u3": 30.0}
    assert strict["change"]["change_mean"] == 0.0 and strict["spec"] == {
        "name": "embedded",
        "judge": "rubric",
    }
    assert (tmp_path / "before_after" / "after.strict.jsonl").is_file()


def test_before_after_refuses_evaluators_that_share_a_label():
    from rlver.core.plugins import PluginError

    with pytest.raises(ValueError, match=r"BeforeAfter evaluators\[1\]: the label 'embedded' is taken"):
        BeforeAfter(evaluators=["embedded", "embedded"])
    with pytest.raises(PluginError, match=r"BeforeAfter evaluators\[0\]: unknown simulator"):
        BeforeAfter(evaluators=[{"name": "no_such_simulator"}])
