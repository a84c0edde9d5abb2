import subprocess
import sys

import pytest
import tomllib

from tests.conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
WHEEL_CHECK = REPO / ".ci" / "wheel_check.py"


def test_every_plugin_folder_is_packaged_and_registered():
    packages = set(PYPROJECT["tool"]["setuptools"]["packages"])
    entry_points = PYPROJECT["project"]["entry-points"]["rlver"]
    for folder in sorted((REPO / "plugins").iterdir()):
        if (folder / "__init__.py").is_file():
            assert f"rlver_plugins.{folder.name}" in packages, (
                f"{folder} missing from [tool.setuptools] packages"
            )
            assert entry_points.get(folder.name) == f"rlver_plugins.{folder.name}", (
                f"{folder} has no entry point"
            )


def test_every_package_folder_is_listed_and_every_listed_package_exists():
    setuptools = PYPROJECT["tool"]["setuptools"]
    packages = set(setuptools["packages"])
    roots = {name: REPO / folder for name, folder in setuptools["package-dir"].items()}
    folders = {}
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                relative = init.parent.relative_to(root).parts
                folders[".".join((name, *relative))] = init.parent
    missing = sorted(set(folders) - packages)
    assert not missing, f"package folders missing from [tool.setuptools] packages: {missing}"
    assert not packages - set(folders), "listed packages without a folder (or __init__.py)"


def run_wheel_check(*args):
    return subprocess.run(
        [sys.executable, str(WHEEL_CHECK), "--python", sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=REPO.parent,  # not the repo: nothing may be imported from the source folders
        timeout=300,
    )


@pytest.mark.slow
def test_the_built_wheel_installs_and_imports_every_module():
    """Builds the wheel, installs it into a scratch venv, imports everything, runs `rlver plugins`."""
    result = run_wheel_check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "wheel-check: OK" in result.stdout


@pytest.mark.slow
def test_the_wheel_check_fails_when_a_package_is_not_listed(tmp_path):
    lines = (REPO / "pyproject.toml").read_text().splitlines(keepends=True)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text("".join(line for line in lines if line.strip() != '"rlver.rl",'))
    assert len(pyproject.read_text()) < sum(map(len, lines))
    result = run_wheel_check("--pyproject", pyproject)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rlver/rl/losses.py" in result.stderr


def test_torch_is_pinned():
    assert "torch==2.13.0" in PYPROJECT["project"]["dependencies"]


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test " in readme or "make test\n" in readme
    assert "make test" in ci
