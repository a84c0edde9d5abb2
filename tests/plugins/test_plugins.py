"""Plugin contract tests: loading, registration errors, `rlver plugins`, a real third-party package."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from rlver import hookimpl
from rlver.core import hookspecs
from rlver.core.plugins import REGISTRATION_HOOKS, PluginError, Registry, get_registry
from tests.conftest import REPO, run_cli

HOOK_NAMES = sorted(name for name in dir(hookspecs) if name.startswith("rlver_"))
BUILTINS = {
    "embedded_user": {"simulators": ["embedded"]},
    "sage_user": {"simulators": ["sage", "sage_official", "rlver_reference"]},
    "formats": {"formats": ["think", "nothink"]},
    "hf_engine": {"engines": ["hf"]},
    "vllm_engine": {"engines": ["vllm"]},
    "rewards": {"rewards": ["final_emotion", "format", "emotion_gain", "emotion_change", "shared_phrasing"]},
    "advantages": {"advantages": ["gae", "grpo", "turn_gae", "turn_credit"]},
}


def test_builtins_load_through_the_entry_point_group():
    described = {p["name"]: p for p in get_registry().describe()}
    for name, registers in BUILTINS.items():
        assert described[name]["registers"] == registers
        assert described[name]["module"] == f"rlver_plugins.{name}"
        assert described[name]["version"] == "0.1.0"


def test_rlver_plugins_prints_json():
    result = run_cli("plugins", check=True)
    listed = {p["name"]: p["registers"] for p in json.loads(result.stdout)}
    assert {k: listed[k] for k in BUILTINS} == BUILTINS


class _Simulators:
    def __init__(self, *names):
        self.names = names

    @hookimpl
    def rlver_register_simulators(self, register):
        for name in self.names:
            register(name, dict)


def test_duplicate_name_names_both_plugins():
    registry = Registry()
    registry.add(_Simulators("embedded"), name="first")
    with pytest.raises(
        PluginError,
        match="simulator 'embedded' is registered twice: by plugin 'first' and by plugin 'second'",
    ):
        registry.add(_Simulators("embedded"), name="second")


def test_unknown_name_lists_the_available_ones():
    registry = Registry()
    registry.add(_Simulators("calm", "grumpy"), name="p")
    with pytest.raises(
        PluginError, match=r"--model.simulator: unknown simulator 'angry'; available: calm, grumpy"
    ):
        registry.build("simulators", {"name": "angry"}, flag="--model.simulator")


def test_misspelt_hook_implementation_is_an_error():
    class Misspelt:
        @hookimpl
        def rlver_register_simulator(self, register):  # missing the final "s"
            register("x", dict)

    with pytest.raises(PluginError, match="plugin 'typo'.*rlver_register_simulator"):
        Registry().add(Misspelt(), name="typo")


def test_unknown_option_names_the_flag_and_accepted_options():
    class WithOptions:
        @hookimpl
        def rlver_register_simulators(self, register):
            def make(difficulty="normal", seed=0):
                return (difficulty, seed)

            register("opt", make)

    registry = Registry()
    registry.add(WithOptions(), name="p")
    assert registry.build("simulators", {"name": "opt", "seed": 3}, flag="--model.simulator") == ("normal", 3)
    with pytest.raises(
        PluginError, match=r"--model.simulator.mood: unknown option; accepted: difficulty, seed"
    ):
        registry.build("simulators", {"name": "opt", "mood": 1}, flag="--model.simulator")
    with pytest.raises(PluginError, match="--model.simulator: needs a 'name'"):
        registry.build("simulators", {"seed": 1}, flag="--model.simulator")


def test_every_registration_kind_and_observer_hook_is_called():
    seen = []

    class Everything:
        pass

    for kind, hook_name in REGISTRATION_HOOKS.items():

        def register_one(self, register, kind=kind):
            register(f"my_{kind}", dict)

        register_one.__name__ = hook_name
        setattr(Everything, hook_name, hookimpl(register_one))

    @hookimpl
    def rlver_on_rollout_end(self, trajectories, step):
        seen.append(("rollout", len(trajectories), step))

    @hookimpl
    def rlver_on_train_step_end(self, metrics, step):
        seen.append(("train", metrics["loss"], step))

    Everything.rlver_on_rollout_end = rlver_on_rollout_end
    Everything.rlver_on_train_step_end = rlver_on_train_step_end
    registry = Registry()
    registry.add(Everything(), name="everything")
    for kind in REGISTRATION_HOOKS:
        assert registry.names(kind) == [f"my_{kind}"]
    registry.call_observers("rlver_on_rollout_end", trajectories=[1, 2], step=None)
    registry.call_observers("rlver_on_train_step_end", metrics={"loss": 0.5}, step=7)
    assert seen == [("rollout", 2, None), ("train", 0.5, 7)]


def test_every_hook_is_documented_and_tested():
    hook_table = (REPO / "docs" / "reference" / "plugins.md").read_text()
    tests_text = "".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    assert (
        sorted([*REGISTRATION_HOOKS.values(), "rlver_on_rollout_end", "rlver_on_train_step_end"])
        == HOOK_NAMES
    )
    for name in HOOK_NAMES:
        assert f"`{name}" in hook_table, f"{name} is not documented in docs/reference/plugins.md"
        assert getattr(hookspecs, name).__doc__, f"{name} has no docstring"
        # Registration hooks are exercised above by name; each must also appear in a test.
        assert tests_text.count(name) >= 1, f"{name} has no test"


def test_disabling_a_plugin_by_environment(monkeypatch):
    monkeypatch.setenv("RLVER_DISABLE_PLUGINS", "hf_engine, vllm_engine, scripted_engine")
    registry = Registry()
    registry.load_entry_points()
    assert {"hf_engine", "vllm_engine", "scripted_engine"}.isdisjoint(registry.plugins)
    assert "embedded_user" in registry.plugins
    with pytest.raises(PluginError, match="unknown engine 'hf'; available: none installed"):
        registry.get("engines", "hf")


# --------------------------------------------------------------------------- third-party package
THIRD_PARTY_MODULE = """
import json, os
from rlver import hookimpl
from rlver.core.interfaces import UserSession, UserSimulator
from rlver.core.types import UserTurn


class EchoSession(UserSession):
    def __init__(self, profile, mood):
        self.profile = profile
        self._emotion = float(mood)

    @property
    def emotion(self):
        return self._emotion

    def opening(self):
        return UserTurn(text="echo opening", emotion=self._emotion)

    def respond(self, reply):
        self._emotion = min(100.0, self._emotion + 1)
        return UserTurn(text="echo: " + reply[:20], emotion=self._emotion, change=1.0, reason={"echo": True})


class EchoSimulator(UserSimulator):
    def __init__(self, mood: int = 50):
        self.mood = mood

    def open(self, profile, *, seed):
        return EchoSession(profile, self.mood)


@hookimpl
def rlver_register_simulators(register):
    register("echo", EchoSimulator)


@hookimpl
def rlver_on_rollout_end(trajectories, step):
    with open(os.environ["RLVER_TEST_ECHO_LOG"], "a") as handle:
        handle.write(json.dumps({"dialogues": len(trajectories), "step": step}) + "\\n")
"""


@pytest.fixture(scope="module")
def third_party_site(tmp_path_factory):
    """Build and install a throwaway plugin package into its own site folder."""
    source = tmp_path_factory.mktemp("rlver-echo-user")
    (source / "rlver_echo_user.py").write_text(THIRD_PARTY_MODULE)
    (source / "pyproject.toml").write_text(
        textwrap.dedent("""
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "rlver-echo-user"
        version = "0.3.0"
        [project.entry-points.rlver]
        echo_user = "rlver_echo_user"
        [tool.setuptools]
        py-modules = ["rlver_echo_user"]
    """)
    )
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    return site


def _env_with(site, **extra):
    """Variables that put the throwaway plugin's site folder on the path."""
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), **extra}


def test_third_party_plugin_is_listed(third_party_site):
    result = run_cli("plugins", check=True, env=_env_with(third_party_site))
    listed = {p["name"]: p for p in json.loads(result.stdout)}
    assert listed["echo_user"]["version"] == "0.3.0"
    assert listed["echo_user"]["registers"] == {"simulators": ["echo"]}


@pytest.mark.slow
def test_third_party_simulator_is_selectable_from_a_config(third_party_site, tmp_path):
    config = tmp_path / "echo.yaml"
    config.write_text(
        textwrap.dedent("""
        model:
          simulator: {name: echo, mood: 61}
          rollout: {max_turns: 2, max_new_tokens: 8, temperature: 0}
        data: {batch_size: 2}
    """)
    )
    out, log = tmp_path / "t.jsonl", tmp_path / "observer.jsonl"
    result = run_cli(
        "rollout",
        "--config",
        config,
        "--out",
        out,
        "--limit",
        "2",
        env=_env_with(third_party_site, RLVER_TEST_ECHO_LOG=str(log)),  # read at run time
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["simulator"] for r in records] == [{"name": "echo", "mood": 61}] * 2
    assert [r["emotions"] for r in records] == [[61.0, 62.0, 63.0]] * 2
    assert records[0]["turns"][2]["text"].startswith("echo: ")
    assert [json.loads(line) for line in log.read_text().splitlines()] == [{"dialogues": 2, "step": None}]
    assert re.search(r"mean final emotion\s+63\.0", result.stdout)


def test_hf_engine_registered_through_rlver_register_engines():
    from rlver_plugins.hf_engine import HFEngine

    registration = get_registry().get("engines", "hf")
    assert registration.factory is HFEngine and registration.plugin == "hf_engine"
    with pytest.raises(
        PluginError, match=r"--model.engine.beams: unknown option; accepted: batch_size, sort_by_length"
    ):
        get_registry().check("engines", {"name": "hf", "beams": 2}, flag="--model.engine", context={"policy"})


def test_tracing_hook_calls_by_environment():
    result = run_cli("plugins", check=True, env={"RLVER_TRACE_HOOKS": "1"})
    assert "[rlver hooks] rlver_register_simulators(register) in plugin 'embedded_user'" in result.stderr
    assert "[rlver hooks] rlver_register_engines(register) in plugin 'vllm_engine'" in result.stderr
    json.loads(result.stdout)  # tracing goes to stderr only


def test_a_component_that_does_not_implement_its_interface_is_refused_by_its_flag(monkeypatch):
    """Core reads only what the interfaces declare (issue 55): a duck-typed estimator that names
    its discount `discount` used to slip past the potential-shaping guard, which read `gamma`
    through a getattr with a default. It is refused where it is built, naming the flag."""
    from rlver.core.plugins import PluginError, get_registry, reset_registry
    from rlver.train.module import RLVERModule

    class Discounting:  # no AdvantageEstimator: nothing says what rlver may read from it
        discount = 0.9
        requires_critic = True

        def __call__(self, batch):
            raise AssertionError("never called")

    class Plugin:
        @hookimpl
        def rlver_register_advantages(self, register):
            register("discounting", Discounting)

    reset_registry()
    try:
        get_registry().add(Plugin(), name="duck-typed")
        with pytest.raises(
            PluginError, match=r"--model.advantage: built a Discounting, which does not implement"
        ):
            RLVERModule(advantage="discounting", rewards=["emotion_change"])
    finally:
        reset_registry()
