import tomllib

from tests.conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


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


def test_torch_is_pinned():
    assert "torch==2.13.0" in PYPROJECT["project"]["dependencies"]


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test " in readme or "make test\n" in readme
    assert "make test" in ci
