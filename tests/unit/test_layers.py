"""The layering of rlver/ (pyproject.toml's import-linter contracts) holds, and breaks on a planted import.

`lint-imports` runs on the source tree as it is, then on copies of it with one forbidden import
added each: an upward import between layers, a circle inside a subpackage (the one issue 40
removed: the schedules importing the runner back), a plugin reaching past the contract.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
LAYERS = "rlver's subpackages import only downwards"
NO_CIRCLES = "no import circles among the modules of any rlver package"
PLUGINS = "plugins import rlver's contract"


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """lint-imports over `tree` (its pyproject.toml and packages), no cache written anywhere.

    The tree's folder goes first on the path, so its `rlver` and `rlver_plugins` are the ones the
    import graph is built from, not the editable install's.
    """
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def broken_contracts(output: str) -> set[str]:
    """The contracts lint-imports' summary reports broken (a long name is wrapped over lines)."""
    summary = output.split("Contracts:")[0]
    return {
        name
        for name in (LAYERS, NO_CIRCLES, PLUGINS)
        if re.search(re.escape(name[:40]) + r"[^\n]*?(?:\n[^\n]*?)??(KEPT|BROKEN)", summary).group(1)
        == "BROKEN"
    }


@pytest.fixture
def source_copy(tmp_path: Path) -> Path:
    """rlver/, plugins/ (as the package it installs as) and pyproject.toml, copied."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "rlver", tmp_path / "rlver", ignore=ignore)
    shutil.copytree(REPO / "plugins", tmp_path / "rlver_plugins", ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def plant(tree: Path, module: str, line: str) -> None:
    """Add `line` as the first import of `module`'s file, after its docstring and future import."""
    path = tree / module
    text = path.read_text()
    anchor = "from __future__ import annotations\n"
    assert anchor in text, module
    path.write_text(text.replace(anchor, anchor + line + "\n", 1))


def test_the_layering_contracts_hold():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 4 kept, 0 broken." in result.stdout, result.stdout
    assert broken_contracts(result.stdout) == set()


def test_the_copy_itself_keeps_the_contracts(source_copy):
    """The planted cases below fail because of the plant, not because the copy differs."""
    result = lint_imports(source_copy)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("module", "line", "contracts", "named"),
    [
        # the contract layer reaching up into the LightningModule (which imports it: a circle too)
        ("rlver/core/types.py", "import rlver.train.module", {LAYERS, NO_CIRCLES},
         "rlver.core.types -> rlver.train.module"),
        # the planner reading the module's settings class again
        ("rlver/plan/training_shape.py", "from rlver.train.ppo_update import PPOSettings", {LAYERS, NO_CIRCLES},
         "rlver.plan.training_shape -> rlver.train.ppo_update"),
        # the rollout <-> schedules circle of the flat layout: inside one layer, so only the circle
        ("rlver/rollout/schedules.py", "from rlver.rollout.runner import RolloutRunner", {NO_CIRCLES},
         "No cycles are allowed in rlver.rollout.\nIt could be made acyclic by removing 1 dependency:\n\n"
         "- .schedules -> .runner"),
        # a plugin importing the training side
        ("rlver_plugins/rewards/__init__.py", "from rlver.train.scoring import score_dialogues", {PLUGINS},
         "rlver_plugins.rewards -> rlver.train.scoring"),
    ],
)  # fmt: skip
def test_a_planted_forbidden_import_breaks_its_contract(source_copy, module, line, contracts, named):
    plant(source_copy, module, line)
    result = lint_imports(source_copy)
    assert result.returncode == 1, result.stdout + result.stderr
    assert broken_contracts(result.stdout) == contracts, result.stdout
    assert named in result.stdout, result.stdout


def test_ci_runs_the_linters_and_the_type_check_before_the_readmes_test_command():
    """`.ci/run` (what CI runs on a clean clone): ruff, the import contracts and mypy first, then
    the test command README.md gives; the pre-commit config runs the same checks."""
    import re

    from tests.conftest import REPO

    commands = [
        line.strip()
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line.strip()[:1] not in ("#", "")
    ]
    readme_test = re.search(r"^(make test)\b", (REPO / "README.md").read_text(), flags=re.M).group(1)
    assert commands.index("make lint typecheck") < commands.index(readme_test)
    makefile = (REPO / "Makefile").read_text()
    lint = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "ruff check rlver plugins tests benchmarks" in lint and "lint-imports" in lint
    assert "mypy $(TYPED)" in makefile.split("\ntypecheck:", 1)[1].split("\n\n", 1)[0]
    typed = re.search(r"^TYPED := (.+)$", makefile, flags=re.M).group(1).split()
    assert {"rlver/core", "rlver/rl"} <= set(typed)  # the plugin contract and the maths at least
    hooks = (REPO / ".pre-commit-config.yaml").read_text()
    for tool in ("ruff check", "ruff format --check", "lint-imports", "mypy " + " ".join(typed)):
        assert tool in hooks
