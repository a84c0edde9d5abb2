"""`rlver ablate`: the statistics against hand-computed cases, arms and plans, `--launcher print`,
`--collect` from hand-made run folders; slow part: a 2-arm x 2-seed ablation of the tiny model
end to end, killed once and rerun to completion."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlver.commands.ablate import ablate_command, ablate_parser, build_plan
from rlver.commands.ablation_runs import DONE_FILE, Arm, training_curve
from rlver.evaluate.ablation import RunScores, mean_error, paired_difference, summarize
from rlver.evaluate.ablation_report import markdown, plot_curves

# Student t quantiles from a printed table (not from scipy: the code under test uses scipy).
T_975_DF1 = 12.706204736
T_975_DF2 = 4.302652730

BEFORE = {"u1": 30.0, "u2": 30.0}


def reference_runs():
    afters = [{"u1": 30.0, "u2": 40.0}, {"u1": 32.0, "u2": 38.0}, {"u1": 28.0, "u2": 42.0}]
    curves = [{1: 20.0, 2: 22.0, 3: 24.0}, {1: 22.0, 2: 24.0, 3: 26.0}, {1: 24.0, 2: 26.0}]
    return [
        RunScores("ref", seed, after, BEFORE, curve, seconds=100.0 + seed)
        for seed, (after, curve) in enumerate(zip(afters, curves, strict=True))
    ]


def arm_runs():
    # Per-user differences to ref: seed 0: 3, 1 (mean 2); seed 1: 4, 2 (3); seed 2: 3, 5 (4).
    afters = [{"u1": 33.0, "u2": 41.0}, {"u1": 36.0, "u2": 40.0}, {"u1": 31.0, "u2": 47.0}]
    return [RunScores("new", seed, after, BEFORE, {1: 21.0, 2: 23.0}) for seed, after in enumerate(afters)]


def test_mean_error_is_the_mean_and_its_standard_error_over_seeds():
    value = mean_error([37.0, 38.0, 39.0])
    assert value.mean == pytest.approx(38.0)
    assert value.error == pytest.approx(1 / math.sqrt(3))  # sd 1 over sqrt(3) seeds
    assert math.isnan(mean_error([5.0]).error) and mean_error([5.0]).format() == "5.0"
    with pytest.raises(ValueError):
        mean_error([])


def test_paired_difference_is_a_t_interval_over_the_seeds_mean_differences():
    difference = paired_difference(reference_runs(), arm_runs())
    assert difference["per_seed"] == pytest.approx([2.0, 3.0, 4.0])
    half = T_975_DF2 * 1 / math.sqrt(3)  # seed means 2, 3, 4: sd 1, 2 degrees of freedom
    assert difference["mean"] == pytest.approx(3.0)
    assert difference["low"] == pytest.approx(3.0 - half)
    assert difference["high"] == pytest.approx(3.0 + half)
    assert difference["unit"] == "seeds" and difference["count"] == 3
    assert (difference["pairs"], difference["better"], difference["worse"]) == (6, 6, 0)
    assert difference["outside_noise"] is True  # [0.52, 5.48]


def test_one_common_seed_falls_back_to_an_interval_over_its_users():
    difference = paired_difference(reference_runs(), arm_runs()[:1])
    half = T_975_DF1 * 1.0  # differences 3, 1: mean 2, sd sqrt(2), standard error 1
    assert (difference["unit"], difference["count"], difference["mean"]) == ("users", 2, pytest.approx(2.0))
    assert difference["low"] == pytest.approx(2.0 - half) and difference["high"] == pytest.approx(2.0 + half)
    assert difference["outside_noise"] is False


def test_paired_difference_refuses_different_users_or_no_common_seed():
    other_users = [RunScores("new", 1, {"u1": 1.0, "u3": 2.0})]
    with pytest.raises(ValueError, match="arm new against ref at seed 1: not the same users.*u2, u3"):
        paired_difference(reference_runs(), other_users)
    with pytest.raises(ValueError, match="no seed finished in both arms"):
        paired_difference(reference_runs(), [RunScores("new", 9, {"u1": 1.0, "u2": 2.0})])


def test_summary_per_arm_by_hand():
    summary = summarize(reference_runs() + arm_runs(), ["ref", "new", "missing"])
    ref, new = summary["arms"]["ref"], summary["arms"]["new"]
    assert summary["reference"] == "ref" and "difference" not in ref
    assert ref["after"]["mean"] == pytest.approx(35.0) and ref["after"]["error"] == pytest.approx(0.0)
    assert new["after"]["mean"] == pytest.approx(38.0)
    assert new["gain"]["mean"] == pytest.approx(8.0) and new["before"]["mean"] == pytest.approx(30.0)
    # Curves: only the steps every seed logged (seed 2 of ref stopped logging at step 2).
    assert sorted(ref["curve"]) == ["1", "2"]
    assert ref["curve"]["1"]["mean"] == pytest.approx(22.0)
    assert ref["curve"]["1"]["error"] == pytest.approx(2 / math.sqrt(3))
    # The tail: each run's last 3 steps (22, 24, 25), then over seeds.
    assert ref["training_tail"]["mean"] == pytest.approx((22.0 + 24.0 + 25.0) / 3)
    assert ref["seconds"]["mean"] == pytest.approx(101.0) and new["seconds"] is None
    assert new["difference"]["mean"] == pytest.approx(3.0)
    assert summary["arms"]["missing"] == {"runs": 0, "seeds": []}


def test_each_run_brings_its_change_over_users_and_its_training_quarters():
    run = RunScores(
        "ref", 0, {"u1": 33.0, "u2": 37.0, "u3": 30.0}, {"u1": 30.0, "u2": 30.0, "u3": 30.0},
        {step: float(step) for step in range(1, 10)},  # 9 steps: quarters of 2 steps, 1-2 and 8-9
    )  # fmt: skip
    change = run.change()
    half = T_975_DF2 * math.sqrt(((3 - 10 / 3) ** 2 + (7 - 10 / 3) ** 2 + (10 / 3) ** 2) / 2) / math.sqrt(3)
    assert change["mean"] == pytest.approx(10 / 3)
    assert (change["low"], change["high"]) == (pytest.approx(10 / 3 - half), pytest.approx(10 / 3 + half))
    assert (change["better"], change["worse"], change["users"]) == (2, 0, 3)
    assert run.quarters() == (1.5, 8.5)
    assert run.rise() is not None and run.rise()["mean"] == pytest.approx(7.0)
    assert RunScores("ref", 0, {"u1": 1.0}, None, {1: 1.0, 2: 2.0, 3: 3.0}).quarters() is None
    assert RunScores("ref", 0, {"u1": 1.0}).change() is None


def test_the_training_rise_gets_welchs_interval_over_the_quarters_steps():
    # 8 steps: quarters of 2; first 30, 32 (mean 31, variance 2), last 34, 36 (mean 35, variance 2).
    curve = dict(enumerate([30.0, 32.0, 31.0, 33.0, 33.0, 34.0, 34.0, 36.0], start=1))
    run = RunScores("ref", 0, {"u1": 1.0}, {"u1": 0.0}, curve)
    rise = run.rise()
    # Welch with equal variances and sizes: se = sqrt(2/2 + 2/2), 2 degrees of freedom.
    assert rise["mean"] == pytest.approx(4.0)
    assert rise["high"] - 4.0 == pytest.approx(T_975_DF2 * math.sqrt(2.0))
    assert RunScores("ref", 0, {"u1": 1.0}, None, dict(enumerate([1.0] * 7, start=1))).rise() is None
    text = markdown(summarize([run], ["ref"]), title="t")
    low, high = 4.0 - T_975_DF2 * math.sqrt(2.0), 4.0 + T_975_DF2 * math.sqrt(2.0)
    assert f"31.0 -> 35.0 (+4.0 [{low:+.1f}, {high:+.1f}])" in text


def test_each_arms_gain_gets_a_t_interval_over_seeds():
    summary = summarize(reference_runs() + arm_runs(), ["ref", "new"])
    gains = summary["arms"]["new"]["gain_interval"]  # gains 7, 8, 9: sd 1
    assert gains["mean"] == pytest.approx(8.0) and gains["high"] - 8.0 == pytest.approx(
        T_975_DF2 / math.sqrt(3)
    )
    seed0 = summary["arms"]["ref"]["per_seed"]["0"]
    assert seed0["change"]["mean"] == pytest.approx(5.0) and seed0["training_quarters"] is None  # 3 steps
    text = markdown(summary, title="t")
    assert "| new | +8.0 [+5.5, +10.5] (above 0) | +7.0 |" in text
    assert "| new | 2 | 30.0 -> 39.0 | +9.0 [-92.6, +110.6] | 2/2 | n/a |" in text  # 1, 17: se 8, t(1)


def test_markdown_and_plot(tmp_path):
    summary = summarize(reference_runs() + arm_runs(), ["ref", "new"])
    text = markdown(summary, title="t")
    assert "| ref | 0, 1, 2 | 2 | 30.0 ± 0.0 | 35.0 ± 0.0 | +5.0 ± 0.0 |" in text
    assert "| new | +3.0 [+0.5, +5.5], **outside the noise** (t over 3 seeds; 6/6 pairs better) |" in text
    assert "| 1 | 22.0 ± 1.2 | 21.0 ± 0.0 |" in text
    plot_curves(summary, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- BeforeAfter for ablations
@dataclass(frozen=True)
class _Profile:
    id: str
    extra: dict = field(default_factory=dict)


def test_before_after_keeps_its_before_for_a_resumed_run_and_can_pin_the_users_difficulty(tmp_path):
    from rlver.train.callbacks import BeforeAfter
    from tests.unit.test_intervals import _Recorder, _trainer

    profiles = [_Profile("u1"), _Profile("u2", {"difficulty": "easy"})]
    seen = []
    levels = {"normal": 40.0, "hard": 30.0, "easy": 50.0}

    def scores(index, profile):
        seen.append(profile.extra.get("difficulty"))
        return levels[profile.extra.get("difficulty", "normal")] + len(seen)

    module = SimpleNamespace(runner=SimpleNamespace(engine=SimpleNamespace(sync_weights=lambda: None)))
    module.evaluation_rollouts = _Recorder(scores)
    first = BeforeAfter(difficulty="hard")
    first.on_train_start(_trainer(profiles, 0, tmp_path), module)
    assert seen == ["hard", "hard"]  # every user at the pinned level, whatever the profile asked
    saved = json.loads((tmp_path / "before_after.json").read_text())
    assert saved["before"] == {"u1": 31.0, "u2": 32.0} and saved["after"] is None

    # Killed here; the resumed run (step 2) takes the saved "before" and pairs against it.
    resumed = BeforeAfter(difficulty="hard")
    resumed.on_train_start(_trainer(profiles, 2, tmp_path), module)
    assert resumed.before == {"u1": 31.0, "u2": 32.0} and len(seen) == 2
    resumed.on_train_end(_trainer(profiles, 3, tmp_path), module)
    record = json.loads((tmp_path / "before_after.json").read_text())
    assert record["after"] == {"u1": 33.0, "u2": 34.0} and record["change"]["change_mean"] == 2.0
    # Other evaluation settings are other users: their saved "before" is not reused.
    other = BeforeAfter(seed=5, difficulty="hard")
    other.on_train_start(_trainer(profiles, 2, tmp_path), module)
    assert other.before is None
    with pytest.raises(
        ValueError, match="BeforeAfter difficulty .'brutal'. must be one of easy, normal, hard"
    ):
        BeforeAfter(difficulty="brutal")


# --------------------------------------------------------------------------- arms, plans, launchers
def test_arm_specs_recipe_file_flags_or_nothing(tmp_path):
    recipe = tmp_path / "arm.yaml"
    recipe.write_text("model: {actor_lr: 1.0e-5}\n")
    assert Arm.parse("base", "", "--arm") == Arm("base")
    arm = Arm.parse("lr", f"{recipe} --model.actor_lr '5e-5'", "--arm")
    assert (arm.recipe, arm.flags) == (str(recipe), ("--model.actor_lr", "5e-5"))
    with pytest.raises(ValueError, match="arm x: recipe file nope.yaml not found"):
        Arm.parse("x", "nope.yaml", "--arm")
    with pytest.raises(ValueError, match="expected a recipe file .* got 'model.actor_lr'"):
        Arm.parse("x", "model.actor_lr 1", "--arm")
    with pytest.raises(ValueError, match="plain folder name"):
        Arm.parse("a/b", "", "--arm")


def plan_for(tmp_path, *flags):
    return build_plan(ablate_parser().parse_args(["--config", "recipes/quickstart.yaml", *flags]))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "--arm: at least one arm"),
        (["--arm", "a"], "expected NAME=SPEC"),
        (["--arm", "a=", "--arm", "a=--model.actor_lr 1"], "given twice: a"),
        (["--arm", "a=", "--seeds", "1", "1"], "--seeds"),
        (["--arm", "a=", "--steps", "0"], "--steps"),
        (["--arm", "a=", "--parallel", "0"], "--parallel"),
        (["--arm", "a=", "--arms", "missing.yaml"], "--arms: missing.yaml not found"),
    ],
)
def test_bad_inputs_get_one_error_naming_the_flag(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        plan_for(tmp_path, *flags)
    with pytest.raises(ValueError, match="--config: nope.yaml not found"):
        build_plan(ablate_parser().parse_args(["--config", "nope.yaml", "--arm", "a="]))


def test_the_shipped_arms_files_parse():
    expected = {"turn_credit": 4, "environment": 2, "overlap": 2}
    expected |= {"quickstart_levers": 2, "quickstart_steps": 2, "quickstart_kl": 2, "quickstart_entropy": 2}
    expected |= {"quickstart_replies": 2, "quickstart_three_turns": 4, "quickstart_exploration": 5}
    expected |= {"quickstart_phrasing": 2}
    shipped = sorted(Path("recipes/ablations").glob("*.yaml"))
    assert {path.stem for path in shipped} >= set(expected), shipped
    for path in shipped:
        plan = build_plan(ablate_parser().parse_args(["--arms", str(path)]))
        assert plan.seeds == (0, 1, 2), path
        assert len(plan.arms) == expected.get(path.stem, len(plan.arms)) >= 2, path
        # every arm's run trains the recipes' 28 steps, or says its own count
        assert plan.steps == 28 or all("--trainer.max_steps" in arm.flags for arm in plan.arms), path


def test_launcher_print_writes_one_fit_a_line_resuming_and_skipping(tmp_path, capsys):
    out = tmp_path / "abl"
    flags = ["--config", "recipes/quickstart.yaml", "--arm", "ref=", "--arm", "lr=--model.actor_lr 5e-5"]
    flags += ["--seeds", "0", "1", "--steps", "3", "--out", str(out), "--launcher", "print"]
    (out / "ref" / "seed-1" / "checkpoints").mkdir(parents=True)
    (out / "ref" / "seed-1" / "checkpoints" / "last.ckpt").write_bytes(b"")
    write_run(out / "lr" / "seed-1", {"u": 1.0}, {"u": 2.0}, [{1: 1.0}], max_steps=3)
    (out / "lr" / "seed-1" / DONE_FILE).write_text("{}")
    assert ablate_command(flags) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3  # 2 arms x 2 seeds, one finished
    assert lines[0] == (
        "rlver fit --config recipes/quickstart.yaml --seed_everything 0 "
        f"--trainer.max_steps 3 --trainer.max_time null --trainer.default_root_dir {out}/ref/seed-0"
    )
    assert lines[1].endswith(f"default_root_dir {out}/lr/seed-0 --model.actor_lr 5e-5")
    assert lines[2].endswith(f"{out}/ref/seed-1 --ckpt_path last")
    assert json.loads((out / "ablation.json").read_text())["arms"] == {
        "ref": "",
        "lr": "--model.actor_lr 5e-5",
    }


def test_launcher_print_with_drop_checkpoints_deletes_them_only_after_a_run_that_ended_well(tmp_path, capsys):
    out = tmp_path / "abl dir"  # a space: the line must still split into the right words
    flags = ["--config", "recipes/quickstart.yaml", "--arm", "ref=", "--seeds", "0", "--steps", "3"]
    flags += ["--out", str(out), "--launcher", "print", "--drop-checkpoints"]
    assert ablate_command(flags) == 0
    (line,) = capsys.readouterr().out.splitlines()
    fit, separator, removal = line.partition(" && ")
    assert separator and shlex.split(fit)[:2] == ["rlver", "fit"]
    assert shlex.split(removal) == ["rm", "-rf", f"{out}/ref/seed-0/checkpoints"]


def test_a_killed_run_is_said_at_once_with_its_signal_and_the_next_run_goes_on(tmp_path, capsys, monkeypatch):
    import rlver.commands.ablate as ablate

    calls = []

    def fake_fit(arguments, environment, cores, log_path, label, progress, started):
        calls.append(label)
        return (
            -9 if len(calls) == 1 else 1
        )  # the first: SIGKILL (the OOM killer's signal); the second: a crash

    monkeypatch.setattr(ablate, "_fit", fake_fit)
    flags = ["--config", "recipes/quickstart.yaml", "--arm", "ref=", "--seeds", "0", "1", "--steps", "3"]
    assert ablate_command([*flags, "--out", str(tmp_path / "out")]) == 1
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if "ref seed" in line]
    assert lines[0].endswith("ref seed 0: starting (" + str(tmp_path / "out" / "ref" / "seed-0") + ")")
    assert (
        "[1/2] ref seed 0: rlver fit was killed by SIGKILL (the kernel's out-of-memory killer sends it"
        in lines[1]
    )
    assert "ref seed 1: starting" in lines[2]  # said before the next run started
    assert "[2/2] ref seed 1: rlver fit exited with status 1; see" in lines[3]
    assert err.count("rlver ablate: error:") >= 2  # and again at the end
    assert (
        ablate._exit_reason(-15) == "was killed by SIGTERM"
        and ablate._exit_reason(-99) == "was killed by signal 99"
    )


def write_run(folder, before, after, curve_sessions, max_steps):
    """A run folder as `rlver fit` leaves it: before_after.json, config.yaml, TensorBoard events."""
    from torch.utils.tensorboard import SummaryWriter

    log = folder / "tensorboard"
    log.mkdir(parents=True)
    (log / "config.yaml").write_text(f"trainer:\n  max_steps: {max_steps}\n")
    record = {"step": max_steps, "before": before, "after": after}
    (log / "before_after.json").write_text(json.dumps(record))
    for number, session in enumerate(curve_sessions):  # a resumed run: a second events file
        writer = SummaryWriter(str(log), filename_suffix=f".{number}")
        for step, value in session.items():
            writer.add_scalar("rollout/final_emotion", value, step)
        writer.close()
        for path in log.glob(f"events.out.tfevents.*.{number}"):
            os.utime(path, (1000 + number, 1000 + number))


def test_collect_builds_the_tables_from_run_folders_made_anywhere(tmp_path, capsys):
    out = tmp_path / "made-elsewhere"
    users = {"u1": 30.0, "u2": 40.0}
    write_run(
        out / "a" / "seed-0", users, {"u1": 31.0, "u2": 41.0}, [{0: 10.0, 1: 11.0, 2: 99.0}, {2: 12.0}], 3
    )
    write_run(out / "a" / "seed-1", users, {"u1": 32.0, "u2": 42.0}, [{0: 10.0, 1: 11.0, 2: 13.0}], 3)
    write_run(out / "b" / "seed-0", users, {"u1": 33.0, "u2": 45.0}, [{0: 10.0, 1: 12.0, 2: 14.0}], 3)
    unfinished = out / "b" / "seed-1"
    write_run(unfinished, users, {"u1": 0.0, "u2": 0.0}, [{0: 1.0}], 3)
    record = json.loads((unfinished / "tensorboard" / "before_after.json").read_text())
    (unfinished / "tensorboard" / "before_after.json").write_text(json.dumps({**record, "step": 1}))
    # The resumed session's step 2 replaces the first session's.
    assert training_curve(out / "a" / "seed-0" / "tensorboard") == {0: 10.0, 1: 11.0, 2: 12.0}

    assert ablate_command(["--collect", str(out)]) == 0
    assert "rlver ablate: 3 finished run(s)" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["reference"] == "a"  # no plan: arms by folder name
    assert results["arms"]["a"]["runs"] == 2 and results["arms"]["b"]["seeds"] == [0]
    difference = results["arms"]["b"]["difference"]
    assert (difference["unit"], difference["mean"]) == ("users", pytest.approx(3.0))  # 2, 4 at seed 0
    assert results["arms"]["a"]["curve"]["2"]["mean"] == pytest.approx(12.5)
    assert "| b | +3.0 [" in (out / "results.md").read_text()
    assert (out / "curves.png").is_file()
    with pytest.raises(ValueError, match="--collect: .* is not a folder"):
        ablate_command(["--collect", str(tmp_path / "none")])


def test_the_train_x_evaluation_matrix_pairs_each_evaluator_over_seeds(tmp_path, capsys):
    """Issue 56 (4): arms trained against different users, each scored by its training simulator
    and by `strict` (BeforeAfter's evaluator): one row per arm, one column per evaluator, the gain
    with a t interval over seeds and the paired difference to the reference arm."""
    out = tmp_path / "matrix"
    users = {"u1": 30.0, "u2": 40.0}
    # arm "soft" gains +4/+6 on its own simulator and +0/+1 on strict; "hard" +1/+2 and +2/+3
    for arm, own, strict in (("soft", (4.0, 6.0), (0.0, 1.0)), ("hard", (1.0, 2.0), (2.0, 3.0))):
        for seed in (0, 1):
            folder = out / arm / f"seed-{seed}"
            write_run(folder, users, {u: v + own[seed] for u, v in users.items()}, [{0: 1.0}], 3)
            path = folder / "tensorboard" / "before_after.json"
            record = json.loads(path.read_text())
            strict_after = {u: v + strict[seed] for u, v in users.items()}
            record["evaluations"] = {"strict": {"before": users, "after": strict_after}}
            path.write_text(json.dumps(record))
    assert ablate_command(["--collect", str(out)]) == 0
    capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    assert results["arms"]["hard"]["after"]["mean"] == pytest.approx(36.5)  # the training simulator's only
    matrix = results["evaluation_matrix"]
    assert matrix["evaluators"] == ["train", "strict"] and matrix["reference"] == "hard"
    soft = matrix["cells"]["soft"]
    assert soft["train"]["gain"]["mean"] == pytest.approx(5.0) and soft["strict"]["gain"][
        "mean"
    ] == pytest.approx(0.5)
    assert soft["strict"]["gain_interval"]["count"] == 2  # over the two seeds
    assert soft["strict"]["difference"]["mean"] == pytest.approx(-2.0)  # 0 - 2, 1 - 3: paired by seed
    assert soft["strict"]["difference"]["unit"] == "seeds"
    report = (out / "results.md").read_text()
    assert "| arm | on train | on strict |" in report
    row = next(line for line in report.splitlines() if line.startswith("| soft | ") and "gain" in line)
    assert "gain +5.0 [" in row and "gain +0.5 [" in row and "Δ -2.0 [" in row


# --------------------------------------------------------------------------- end to end (slow)
def tiny_quickstart(folder, model_dir):
    """The quickstart on the tiny model (hf engine, float32, short replies), checkpointing every step,
    its BeforeAfter on 2 held-out users."""
    import yaml

    from tests.conftest import REPO

    config = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    config["trainer"]["precision"] = "32-true"
    config["trainer"]["callbacks"] = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"save_last": True, "save_top_k": 0, "every_n_train_steps": 1},
        },
        {"class_path": "rlver.train.callbacks.BeforeAfter", "init_args": {"split": "test", "limit": 2}},
    ]
    config["model"].update(policy=str(model_dir), engine="hf", log_samples_every_n_steps=0)
    config["model"]["rollout"].update(max_new_tokens=8, max_context_tokens=1024)
    path = folder / "tiny_quickstart.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.mark.slow
def test_a_two_arm_two_seed_ablation_killed_once_then_rerun_to_completion(tmp_path, tiny_model_dir):
    from tests.conftest import run_rlver, start_rlver

    out = tmp_path / "ablation"
    argv = ["ablate", "--config", str(tiny_quickstart(tmp_path, tiny_model_dir)), "--arm", "ref="]
    argv += ["--arm", "fast=--model.actor_lr 1.0e-3", "--seeds", "0", "1", "--steps", "3", "--out", str(out)]
    env = dict(os.environ)

    # Killed (the whole process group, its `rlver fit` with it) once the first run has a checkpoint.
    process = start_rlver(argv, cwd=tmp_path, env=env, new_session=True)
    checkpoint = out / "ref" / "seed-0" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 1200
    while not checkpoint.is_file():
        assert process.poll() is None, process.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    output, _ = process.communicate(timeout=60)
    assert "[1/4] ref seed 0: starting" in output, output[-3000:]
    assert not (out / "ref" / "seed-0" / DONE_FILE).exists()

    # Rerun (two runs at once): the killed run resumes, the others start, the tables come out.
    result = run_rlver([*argv, "--parallel", "2"], cwd=tmp_path, env=env)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-4000:]
    assert "ref seed 0: resuming from last.ckpt" in text, text[-4000:]
    assert re.search(r"ref seed 1: step 2/3, run ETA \d+ min, all ETA \d+ min", text), text[-4000:]
    results = json.loads((out / "results.json").read_text())
    for arm in ("ref", "fast"):
        row = results["arms"][arm]
        assert (row["runs"], row["seeds"], row["users"]) == (2, [0, 1], 2), row
        assert row["before"] is not None  # the resumed run kept the "before" of its first start
        assert len(row["curve"]) == 3  # every step, the resumed run's too
    for run in results["runs"]:
        assert run["before"] is not None and len(run["after"]) == 2 and len(run["curve"]) == 3
        assert (out / run["arm"] / f"seed-{run['seed']}" / DONE_FILE).is_file()
    # The untrained policy, the same evaluation seed: the same "before" in every run.
    assert len({json.dumps(run["before"], sort_keys=True) for run in results["runs"]}) == 1
    difference = results["arms"]["fast"]["difference"]
    assert (difference["unit"], difference["count"], difference["pairs"]) == ("seeds", 2, 4)
    assert difference["low"] <= difference["mean"] <= difference["high"]
    table = (out / "results.md").read_text()
    assert "| ref | 0, 1 | 2 |" in table and "| fast | " in table and "t over 2 seeds" in table
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"

    # Done: a third call trains nothing; --collect rebuilds the same numbers.
    again = run_rlver(argv, cwd=tmp_path, env=env)
    assert again.returncode == 0 and "4 run(s) already finished" in again.stdout, again.stdout[-2000:]
    assert "starting" not in again.stdout
    (out / "results.json").unlink()
    assert run_rlver(["ablate", "--collect", str(out)], cwd=tmp_path, env=env).returncode == 0
    assert json.loads((out / "results.json").read_text())["arms"] == results["arms"]


def test_parallel_runs_get_disjoint_cores():
    from rlver.commands.ablate import core_slots

    cores = sorted(os.sched_getaffinity(0))
    slots = core_slots(len(cores))
    shares = [slots.get_nowait() for _ in range(len(cores))]
    assert sorted(core for share in shares for core in share) == cores and all(len(s) == 1 for s in shares)
    more = core_slots(len(cores) + 1)  # more runs than cores: every run still gets one
    assert all(more.get_nowait() for _ in range(len(cores) + 1))


def test_a_longer_rerun_continues_finished_runs(tmp_path):
    from rlver.commands.ablation_runs import is_finished

    folder = tmp_path / "a" / "seed-0"
    write_run(folder, {"u": 1.0}, {"u": 2.0}, [{1: 1.0}], max_steps=3)
    assert is_finished(folder) and is_finished(folder, 3)  # by its before_after.json and config.yaml
    (folder / DONE_FILE).write_text("{}")
    assert is_finished(folder, 3) and not is_finished(folder, 5)
    (folder / "tensorboard" / "before_after.json").write_text(json.dumps({"step": 0, "after": None}))
    assert not is_finished(tmp_path / "a" / "seed-0", 3)  # a marker without scores is not a result


def test_drop_checkpoints_deletes_finished_runs_checkpoints_and_keeps_an_unfinished_ones(
    tmp_path, capsys, monkeypatch
):
    import rlver.commands.ablate as ablate

    out = tmp_path / "out"
    earlier = out / "ref" / "seed-0"  # finished by an earlier call without the flag
    write_run(earlier, {"u": 1.0}, {"u": 2.0}, [{1: 1.0}], max_steps=3)
    (earlier / DONE_FILE).write_text("{}")
    (earlier / "checkpoints").mkdir()
    (earlier / "checkpoints" / "last.ckpt").write_bytes(b"x" * 1000)

    def fake_fit(arguments, environment, cores, log_path, label, progress, started):
        folder = Path(arguments[arguments.index("--trainer.default_root_dir") + 1])
        (folder / "checkpoints").mkdir()
        (folder / "checkpoints" / "last.ckpt").write_bytes(b"x" * 2000)
        if folder.name == "seed-2":
            return 1  # crashed: its checkpoint is what a rerun resumes from
        write_run(folder, {"u": 1.0}, {"u": 3.0}, [{1: 1.0}], max_steps=3)
        return 0

    monkeypatch.setattr(ablate, "_fit", fake_fit)
    flags = ["--config", "recipes/quickstart.yaml", "--arm", "ref=", "--seeds", "0", "1", "2", "--steps", "3"]
    assert ablate_command([*flags, "--out", str(out), "--drop-checkpoints"]) == 1
    output = capsys.readouterr().out
    assert "1 run(s) already finished" in output and "their checkpoints deleted (0.0 GB)" in output
    assert "ref seed 1: finished in 0.0 min; checkpoints deleted (0.0 GB)" in output
    assert not (earlier / "checkpoints").exists() and not (out / "ref" / "seed-1" / "checkpoints").exists()
    assert (out / "ref" / "seed-2" / "checkpoints" / "last.ckpt").is_file()
    assert (out / "ref" / "seed-1" / "tensorboard" / "before_after.json").is_file()  # the scores stay
