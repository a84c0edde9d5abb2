"""The flat layout's import paths keep working after issue 40 where old things are read
(`rlver.core.legacy_paths`: configs, checkpoints, plugins), each with a warning naming the release
that drops them; a plain `import rlver` installs no import hook.

What names them: recipes and configs saved beside checkpoints (`class_path: rlver.callbacks.BeforeAfter`),
pickles, and plugins written against CONTRIBUTING's imports of the time (`rlver.interfaces`,
`rlver.types`, `rlver.emotion`, `rlver.hookspecs`, `rlver.rollout.Trajectory`).
"""

from __future__ import annotations

import importlib
import importlib.util
import pickle
import sys
import textwrap

import pytest
import yaml

from rlver.core.legacy_paths import MOVED_MODULES, REMOVED_IN, legacy_module_paths
from tests.conftest import REPO

# Every module of the flat rlver/ folder (commit ede2239), besides the packages data/ and rl/.
FLAT_LAYOUT = [
    "agreement",
    "allocator",
    "architectures",
    "batch",
    "callbacks",
    "checkpoint_io",
    "checkpoint_state",
    "cli",
    "components",
    "console",
    "critic",
    "curriculum",
    "distributed",
    "emotion",
    "evaluation",
    "export",
    "full_weights",
    "grad_clip",
    "hookspecs",
    "interfaces",
    "intervals",
    "lora",
    "loss_positions",
    "memory_plan",
    "models",
    "module",
    "networks",
    "overlap",
    "plugins",
    "ppo_update",
    "precision",
    "progress",
    "rank_watch",
    "ranks",
    "resume",
    "rollout",
    "rollout_schedule",
    "run_log",
    "score",
    "scoring",
    "seeding",
    "shared_prefix",
    "step_rollouts",
    "stopping",
    "trainer",
    "training_shape",
    "trajectory",
    "transcripts",
    "types",
]
# rlver.cli stayed where it was; rlver.rollout is a package now, forwarding the old module's names.
NOT_MOVED = {"rlver.cli", "rlver.rollout"}
OLD_ROLLOUT_NAMES = [
    "PolicyTurn", "RolloutRunner", "RolloutSettings", "StopRequested", "TokenSequence", "Trajectory",
    "dialogue_seed", "pack_sequences", "summarize",
]  # fmt: skip


def test_every_flat_module_has_a_home():
    old = {f"rlver.{name}" for name in FLAT_LAYOUT}
    assert set(MOVED_MODULES) | NOT_MOVED == old
    for new in MOVED_MODULES.values():
        assert importlib.util.find_spec(new) is not None, new


@pytest.mark.parametrize(("old", "new"), sorted(MOVED_MODULES.items()))
def test_an_old_module_path_is_the_new_module_with_a_warning(monkeypatch, old, new):
    monkeypatch.delitem(sys.modules, old, raising=False)  # as in a fresh process
    message = f"^{old} moved to {new}; import it from there \\(the old path goes in rlver {REMOVED_IN}\\)$"
    with legacy_module_paths(), pytest.warns(DeprecationWarning, match=message):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)  # the same module: classes stay identical


def test_outside_what_reads_old_things_an_old_path_is_not_found(monkeypatch):
    """The shim is scoped (as Lightning scopes its own to loading a checkpoint): `import rlver`
    leaves sys.meta_path alone, and an old name imports only inside `legacy_module_paths()`."""
    import rlver  # noqa: F401

    monkeypatch.delitem(sys.modules, "rlver.callbacks", raising=False)
    assert not [finder for finder in sys.meta_path if "legacy_paths" in type(finder).__module__]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("rlver.callbacks")
    with legacy_module_paths(), pytest.warns(DeprecationWarning):
        importlib.import_module("rlver.callbacks")
    assert not [finder for finder in sys.meta_path if "legacy_paths" in type(finder).__module__]


def test_a_checkpoint_pickling_an_old_module_path_loads(tmp_path):
    """Lightning's hparams may hold pickled settings objects of the flat layout (weights_only=False)."""
    import torch

    from rlver.checkpoint.io import ShardedCheckpointReader, read_checkpoint_state
    from rlver.core.types import UserTurn

    path = tmp_path / "old.ckpt"
    torch.save(
        {"hyper_parameters": {"turn": UserTurn(text="hi", emotion=55.0)}},
        path,
        pickle_protocol=0,
        _use_new_zipfile_serialization=False,
    )  # no zip: the bytes may change length
    data = path.read_bytes()
    assert b"rlver.core.types\n" in data
    sys.modules.pop("rlver.types", None)
    path.write_bytes(data.replace(b"rlver.core.types\n", b"rlver.types\n"))
    for loaded in (
        read_checkpoint_state(path, weights_only=False),
        ShardedCheckpointReader().load_checkpoint(path, weights_only=False),
    ):
        assert loaded["hyper_parameters"]["turn"] == UserTurn(text="hi", emotion=55.0)


def test_the_old_rollout_module_names_come_from_the_package(monkeypatch):
    import rlver.rollout

    for name in OLD_ROLLOUT_NAMES:
        monkeypatch.delattr(rlver.rollout, name, raising=False)
        with pytest.warns(DeprecationWarning, match=f"^rlver.rollout.{name} moved to rlver\\."):
            value = getattr(rlver.rollout, name)
        assert value is getattr(importlib.import_module("rlver.rollout.runner"), name)
    with pytest.raises(AttributeError, match="no attribute 'run_lockstep'"):
        rlver.rollout.run_lockstep  # noqa: B018 - never a name of the old module


def test_a_pickle_naming_an_old_module_loads():
    from rlver.core.types import UserTurn

    turn = UserTurn(text="hi", emotion=55.0)
    written = pickle.dumps(turn, protocol=0)  # text opcodes: the module path is a plain line
    assert b"rlver.core.types\n" in written
    old = written.replace(b"rlver.core.types\n", b"rlver.types\n")
    with legacy_module_paths():
        assert pickle.loads(old) == turn


def test_a_recipe_with_the_old_class_paths_parses(tmp_path):
    from jsonargparse import Namespace

    from rlver.cli import parse_recipe
    from rlver.parallel.sharding import AnyDeviceFSDPStrategy
    from rlver.train.callbacks import BeforeAfter

    recipe = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    callbacks = recipe["trainer"]["callbacks"]
    paths = [callback["class_path"] for callback in callbacks]
    assert "rlver.train.callbacks.BeforeAfter" in paths  # shipped recipes name the new path
    for callback in callbacks:
        callback["class_path"] = callback["class_path"].replace("rlver.train.callbacks.", "rlver.callbacks.")
    recipe["trainer"]["strategy"] = {
        "class_path": "rlver.distributed.AnyDeviceFSDPStrategy",
        "init_args": {"sharding_strategy": "FULL_SHARD"},
    }
    path = tmp_path / "old_paths.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))

    config = parse_recipe(str(path))

    def import_object(class_path: str) -> object:
        module, _, name = class_path.rpartition(".")
        return getattr(importlib.import_module(module), name)

    parsed = [import_object(c.class_path) for c in config.trainer.callbacks if isinstance(c, Namespace)]
    assert BeforeAfter in parsed
    assert import_object(config.trainer.strategy.class_path) is AnyDeviceFSDPStrategy


# A plugin as CONTRIBUTING.md told authors to write one before issue 40.
OLD_STYLE_PLUGIN = """
from rlver import hookimpl
from rlver.emotion import band
from rlver.hookspecs import Register
from rlver.interfaces import RewardFunction, UserSession, UserSimulator
from rlver.rollout import Trajectory
from rlver.types import UserTurn


class SteadySession(UserSession):
    def __init__(self, profile):
        self.profile = profile

    @property
    def emotion(self):
        return 50.0

    def opening(self):
        return UserTurn(text="hello", emotion=50.0)

    def respond(self, reply):
        return UserTurn(text="a " + band(50.0) + " reply", emotion=50.0, change=0.0, reason={})


class SteadySimulator(UserSimulator):
    def open(self, profile, *, seed):
        return SteadySession(profile)


class TurnCount(RewardFunction):
    def __call__(self, trajectories: list[Trajectory]):
        return [float(len(t.policy_turns)) for t in trajectories]


@hookimpl
def rlver_register_simulators(register: Register):
    register("steady", SteadySimulator)


@hookimpl
def rlver_register_rewards(register: Register):
    register("turn_count", TurnCount)
"""


def test_a_plugin_written_against_the_old_documented_imports_works(tmp_path):
    from rlver.core.interfaces import RewardFunction, UserSimulator
    from rlver.core.plugins import Registry
    from rlver.core.trajectory import Trajectory
    from rlver.data import load_profiles

    (tmp_path / "old_style_plugin.py").write_text(textwrap.dedent(OLD_STYLE_PLUGIN))
    spec = importlib.util.spec_from_file_location("old_style_plugin", tmp_path / "old_style_plugin.py")
    plugin = importlib.util.module_from_spec(spec)
    with legacy_module_paths():  # as rlver imports a plugin from its entry point (Registry.load_entry_points)
        spec.loader.exec_module(plugin)
    registry = Registry()
    registry.add(plugin, name="old_style")

    simulator = registry.build("simulators", "steady", flag="--model.simulator")
    reward = registry.build("rewards", "turn_count", flag="--model.rewards")
    assert isinstance(simulator, UserSimulator) and isinstance(reward, RewardFunction)
    profile = load_profiles("builtin:en_test")[0]
    session = simulator.open(profile, seed=0)
    opening = session.opening()
    assert session.respond("I hear you").text.startswith("a ")
    trajectory = Trajectory(profile=profile, seed=0, system_prompt="", user_turns=[opening])
    assert reward([trajectory]) == [0.0]
