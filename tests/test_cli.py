"""The `rlver` command: help, errors that name the flag, and a real rollout."""

import json
import re

import pytest

from rlver.cli import main
from tests.conftest import run_cli


def test_help_and_unknown_command(capsys):
    assert main(["--help"]) == 0
    assert "rollout" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_rollout_help_lists_the_options():
    result = run_cli("rollout", "--help")
    assert result.returncode == 0
    for flag in ("--model.simulator", "--model.rollout.max_turns", "--data.batch_size", "--limit", "--out"):
        assert flag in result.stdout


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


def test_bad_rollout_setting_names_the_flag(tmp_path):
    result = run_cli(
        "rollout",
        "--config",
        "recipes/quickstart.yaml",
        "--out",
        str(tmp_path / "t.jsonl"),
        "--model.rollout.max_turns",
        "0",
    )
    assert result.returncode == 2
    assert "--model.rollout: max_turns (0) must be >= 1" in result.stderr


def test_bad_profile_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    result = run_cli(
        "rollout",
        "--config",
        "recipes/quickstart.yaml",
        "--out",
        str(tmp_path / "t.jsonl"),
        "--data.test_files",
        json.dumps([str(bad)]),
    )
    assert result.returncode == 2
    assert f"{bad}:1: field 'id': expected a string, got int" in result.stderr


def test_unknown_model_folder_is_reported(tmp_path):
    (tmp_path / "model").mkdir()
    result = run_cli(
        "rollout",
        "--config",
        "recipes/quickstart.yaml",
        "--out",
        str(tmp_path / "t.jsonl"),
        "--model.policy",
        str(tmp_path / "model"),
    )
    assert result.returncode == 2
    assert "not a Hugging Face model folder (no config.json)" in result.stderr


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
