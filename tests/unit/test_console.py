"""A quiet terminal: rlver's own lines and the progress, library chatter only with --verbose."""

from __future__ import annotations

import os
import re

import pytest

from rlver.core import console

# Lines that are library chatter, not rlver's: vLLM's log format, Python warnings, Lightning tips.
CHATTER = re.compile(r"\b(INFO|WARNING)\b|Warning:|💡|Tip:|GPU available|Seed set to")


def test_verbose_flag_is_taken_out_of_the_arguments(monkeypatch):
    monkeypatch.setenv(console.VERBOSE_ENV, "")  # recorded, so the "1" set below is undone
    assert console.take_verbose_flag(["fit", "--config", "x.yaml"]) == ["fit", "--config", "x.yaml"]
    assert not console.is_verbose()
    assert console.take_verbose_flag(["fit", "--verbose", "--config", "x.yaml"]) == [
        "fit",
        "--config",
        "x.yaml",
    ]
    assert console.is_verbose()  # and so are the ranks Lightning starts, which inherit the environment


@pytest.mark.parametrize(
    "value, verbose", [("", False), ("0", False), ("no", False), ("1", True), ("yes", True)]
)
def test_verbose_environment_variable(monkeypatch, value, verbose):
    monkeypatch.setenv(console.VERBOSE_ENV, value)
    assert console.is_verbose() is verbose


def test_quiet_keeps_what_the_user_set(monkeypatch):
    monkeypatch.setenv(console.VERBOSE_ENV, "")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "")
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY")
    console.quiet_libraries()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "error"


def test_a_phase_is_one_line_and_a_note_inside_it_does_not_break_it(capsys):
    with console.phase("loading"):
        pass
    with console.phase("talking"):
        console.note("engine dtype float32")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("rlver: loading ... done in ")
    assert lines[1] == "rlver: talking ..."
    assert lines[2] == "rlver: engine dtype float32"
    assert lines[3].startswith("rlver: ... done in ")


@pytest.mark.slow
def test_a_short_fit_prints_a_screenful_and_verbose_shows_the_rest(tmp_path, tiny_model_dir, monkeypatch):
    """A laptop recipe with vLLM (curriculum, tiny model) for 2 steps: rlver's phases, one line
    per step; vLLM's own start-up log is the loudest chatter a quiet run must hide."""
    from tests.integration.test_multiprocess import run_fit, twin_config

    for name in (console.VERBOSE_ENV, "VLLM_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY", "TORCH_CPP_LOG_LEVEL"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)  # a user's fresh shell: whatever earlier tests set is gone
    config = twin_config("curriculum", tmp_path, tiny_model_dir, "", devices=1, vllm=True)
    quiet = run_fit(tmp_path, "--config", config)
    output = (quiet.stdout + quiet.stderr).splitlines()
    lines = [line for line in output if line.strip()]
    assert len(lines) <= 16, "\n".join(lines)
    assert not [line for line in lines if CHATTER.search(line)], "\n".join(lines)
    text = "\n".join(lines)
    for expected in (
        "rlver: loading ",
        "before training (greedy) ... done in",
        "step 1/2  reward ",
        "step 2/2  reward ",
        "greedy mean final emotion of 64 held-out users (test, evaluation seed 0",
        "tensorboard --logdir",
    ):
        assert expected in text, text

    # No step: the engine's start-up (and its log) is in setup; a verbose run is a fresh interpreter.
    verbose = run_fit(tmp_path, "--config", config, "--verbose", "--trainer.max_steps", "0")
    chatter = [line for line in (verbose.stdout + verbose.stderr).splitlines() if CHATTER.search(line)]
    assert len(chatter) > 20  # vLLM's start-up log among it: what the quiet run left out
    assert any("vllm" in line.lower() for line in chatter)
