"""The `rlver` command: help, errors that name the flag, and a real rollout.

The error paths run `main` in this process (they end before any model loads; a fresh interpreter
only added its ~7 s of imports to each); one of them stays a real `rlver` process, so the exit
status and the absence of a traceback are also checked where a user sees them.
"""

import json
import re

import pytest

from rlver.cli import main
from tests.conftest import REPO, run_cli


@pytest.fixture
def rlver(capsys, monkeypatch):
    """`rlver <args>` through `main` in this process, from the repo root: (status, stdout, stderr)."""
    monkeypatch.chdir(REPO)

    def run(*args):
        try:
            status = main([str(a) for a in args])
        except SystemExit as exit:  # jsonargparse's --help
            status = exit.code
        captured = capsys.readouterr()
        return status, captured.out, captured.err

    return run


def test_help_and_unknown_command(capsys):
    assert main(["--help"]) == 0
    assert "rollout" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_rollout_help_lists_the_options(rlver):
    status, out, _ = rlver("rollout", "--help")
    assert status == 0
    for flag in ("--model.simulator", "--model.rollout.max_turns", "--data.batch_size", "--limit", "--out"):
        assert flag in out


@pytest.mark.parametrize("command", ["fit", "validate", "test"])
def test_a_trainer_commands_help_is_its_own(rlver, command):
    """Each launch builds the parser of its own trainer command only (not all four of Lightning's)."""
    status, out, _ = rlver(command, "--help")
    assert status == 0
    assert "--model.simulator" in out and "--trainer.max_steps" in out and "--data.batch_size" in out
    assert "--ckpt_path" in out
    # The module builds its optimizers from --model.*: Lightning's would replace them unseen.
    assert "--optimizer" not in out and "--lr_scheduler" not in out and "--model.actor_lr" in out
    from rlver.cli import _lightning_cli_class

    assert list(_lightning_cli_class(command).subcommands()) == [command]
    assert list(_lightning_cli_class().subcommands()) == ["fit", "validate", "test", "predict"]


def test_lightnings_optimizer_flag_is_refused_by_name(rlver, tmp_path):
    status, _, err = rlver("fit", "--config", "recipes/quickstart.yaml", "--optimizer", "Adam")
    assert status != 0 and "--optimizer" in err and "--model.actor_lr" in err
    # A config Lightning saved while it offered them (`optimizer: null`) still loads.
    saved = tmp_path / "config.yaml"
    saved.write_text("optimizer: null\nlr_scheduler: null\n")
    status, out, _ = rlver("fit", "--config", "recipes/quickstart.yaml", "--config", saved, "--print_config")
    assert status == 0 and "smollm2-135m-instruct" in out


def test_unknown_simulator_is_one_clear_error(tmp_path):
    result = run_cli(
        "rollout",
        "--config",
        "recipes/quickstart.yaml",
        "--out",
        str(tmp_path / "t.jsonl"),
        "--model.simulator",
        "grumpy",
        "--model.policy",
        str(tmp_path / "missing-model"),
    )
    assert result.returncode == 2
    assert "--model.simulator: unknown simulator 'grumpy'; available: embedded" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_rollout_setting_names_the_flag(tmp_path, rlver):
    status, _, err = rlver(
        "rollout",
        "--config",
        "recipes/quickstart.yaml",
        "--out",
        tmp_path / "t.jsonl",
        "--model.rollout.max_turns",
        "0",
    )
    assert status == 2
    assert "--model.rollout: max_turns (0) must be >= 1" in err


def test_bad_profile_file_names_file_and_line(tmp_path, rlver):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    status, _, err = rlver(
        "rollout",
        "--config",
        "recipes/quickstart.yaml",
        "--out",
        tmp_path / "t.jsonl",
        "--data.test_files",
        json.dumps([str(bad)]),
    )
    assert status == 2
    assert f"{bad}:1: field 'id': expected a string, got int" in err


def test_unknown_model_folder_is_reported(tmp_path, rlver):
    (tmp_path / "model").mkdir()
    status, _, err = rlver(
        "rollout",
        "--config",
        "recipes/quickstart.yaml",
        "--out",
        tmp_path / "t.jsonl",
        "--model.policy",
        tmp_path / "model",
    )
    assert status == 2
    assert "not a Hugging Face model folder (no config.json)" in err


@pytest.mark.slow
def test_quickstart_rollout_end_to_end(tmp_path):
    out = tmp_path / "runs" / "t.jsonl"
    result = run_cli(
        "rollout",
        "--config",
        "recipes/quickstart.yaml",
        "--out",
        str(out),
        "--limit",
        "2",
        "--model.rollout.max_turns",
        "2",
        "--model.rollout.max_new_tokens",
        "24",
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["profile_id"] for r in records] == ["en-test-001", "en-test-002"]
    for record in records:
        assert record["simulator"] == {"name": "embedded", "difficulty": "normal"}
        assert record["start_emotion"] == 40
        assert 1 <= record["num_turns"] <= 2
        assert record["turns"][0]["text"]  # the profile's first_talk
        assert all("reason" in t for t in record["turns"][2::2])
    mean = sum(r["final_emotion"] for r in records) / 2
    assert re.search(rf"mean final emotion\s+{mean:.1f}", result.stdout)
    assert re.search(r"dialogues\s+2", result.stdout)
    assert "dialogues" in result.stderr  # the progress bar
