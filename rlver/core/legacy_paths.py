"""The flat layout's module paths, while something old is read: `rlver.callbacks` is `rlver.train.callbacks`.

Recipes, configs saved beside checkpoints (`class_path: rlver.callbacks.BeforeAfter`), checkpoints
and third-party plugins written before issue 40 name modules of the flat `rlver/` folder. Inside
`legacy_module_paths()`, importing one of those names gives the module at its new home (the same
module object, so classes stay identical) and warns once, with a DeprecationWarning naming the
new path and the release that drops the old one (`REMOVED_IN`). rlver enters it only where such
names are read: parsing and building a config (`rlver fit/validate/test`, `parse_recipe`), loading
a checkpoint, and importing plugins from their entry points; an `import rlver` changes nothing
else (no global import hook). `rlver.rollout`, a module then and a package now, forwards the old
module's names the same way (`moved_attribute`).

This file imports nothing from rlver: the finder imports a new home only when an old name is asked for.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Collection, Iterator
from typing import Any

REMOVED_IN = "0.3.0"  # the release whose configs, checkpoints and plugins no longer find the old paths

# old module -> its home since issue 40 (the flat rlver/ folder split into subpackages)
MOVED_MODULES = {
    "rlver.types": "rlver.core.types",
    "rlver.emotion": "rlver.core.emotion",
    "rlver.seeding": "rlver.core.seeding",
    "rlver.interfaces": "rlver.core.interfaces",
    "rlver.trajectory": "rlver.core.trajectory",
    "rlver.hookspecs": "rlver.core.hookspecs",
    "rlver.plugins": "rlver.core.plugins",
    "rlver.console": "rlver.core.console",
    "rlver.distributed": "rlver.parallel.sharding",
    "rlver.full_weights": "rlver.parallel.full_weights",
    "rlver.grad_clip": "rlver.parallel.grad_clip",
    "rlver.allocator": "rlver.parallel.allocator",
    "rlver.rank_watch": "rlver.parallel.rank_watch",
    "rlver.models": "rlver.modeling.models",
    "rlver.precision": "rlver.modeling.precision",
    "rlver.shared_prefix": "rlver.modeling.shared_prefix",
    "rlver.lora": "rlver.modeling.lora",
    "rlver.critic": "rlver.modeling.critic",
    "rlver.networks": "rlver.modeling.networks",
    "rlver.batch": "rlver.modeling.batch",
    "rlver.loss_positions": "rlver.modeling.loss_positions",
    "rlver.checkpoint_io": "rlver.checkpoint.io",
    "rlver.checkpoint_state": "rlver.checkpoint.state",
    "rlver.resume": "rlver.checkpoint.resume",
    "rlver.stopping": "rlver.checkpoint.stopping",
    "rlver.export": "rlver.checkpoint.export",
    "rlver.rollout_schedule": "rlver.rollout.schedules",
    "rlver.step_rollouts": "rlver.train.rollouts",
    "rlver.overlap": "rlver.rollout.overlap",
    "rlver.transcripts": "rlver.rollout.transcripts",
    "rlver.architectures": "rlver.plan.architectures",
    "rlver.training_shape": "rlver.plan.training_shape",
    "rlver.memory_plan": "rlver.plan.memory_plan",
    "rlver.score": "rlver.evaluate.score",
    "rlver.agreement": "rlver.evaluate.agreement",
    "rlver.intervals": "rlver.evaluate.intervals",
    "rlver.module": "rlver.train.module",
    "rlver.components": "rlver.train.components",
    "rlver.scoring": "rlver.train.scoring",
    "rlver.ppo_update": "rlver.train.ppo_update",
    "rlver.ranks": "rlver.train.ranks",
    "rlver.run_log": "rlver.train.run_log",
    "rlver.callbacks": "rlver.train.callbacks",
    "rlver.curriculum": "rlver.train.curriculum",
    "rlver.evaluation": "rlver.train.evaluation",
    "rlver.trainer": "rlver.train.trainer",
    "rlver.progress": "rlver.train.progress",
}


def _warn(old: str, new: str) -> None:
    # stacklevel is not meaningful through the import machinery; the message names both paths.
    warnings.warn(
        f"{old} moved to {new}; import it from there (the old path goes in rlver {REMOVED_IN})",
        DeprecationWarning,
        stacklevel=3,
    )


class _MovedModuleLoader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a placeholder, replaced in sys.modules by the module itself in exec_module

    def exec_module(self, module: Any) -> None:
        old = module.__spec__.name
        _warn(old, self.new)
        # The import system returns whatever sys.modules holds under the old name once this returns:
        # the real module, so `rlver.callbacks.BeforeAfter is rlver.train.callbacks.BeforeAfter`.
        sys.modules[old] = importlib.import_module(self.new)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(new))


@contextlib.contextmanager
def legacy_module_paths() -> Iterator[None]:
    """The flat layout's module paths import inside (at their new homes, with a warning).

    Nested uses are fine; modules imported inside stay imported after (`sys.modules`), as any
    import does: what ends is the finding of old names not yet imported.
    """
    finder = _MovedModuleFinder()
    sys.meta_path.append(finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def moved_attribute(package: str, old_module_home: str, names: Collection[str]) -> Callable[[str], Any]:
    """A module `__getattr__` for a package that replaced a module of the same name.

    `from rlver.rollout import RolloutRunner` named the old module `rlver/rollout.py`; the `names`
    it exported now live in `old_module_home`, fetched (and warned about) on first use only, so
    that importing the package's other modules does not load them.
    """

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(old_module_home), name)
        _warn(f"{package}.{name}", f"{getattr(value, '__module__', old_module_home)}.{name}")
        setattr(sys.modules[package], name, value)  # found once, warned once
        return value

    return __getattr__
