"""tools/gpu_bundle_check.py: the bundle's self-check sees only the device's packages and the bundle."""

from __future__ import annotations

import shutil
import sys
from importlib import metadata

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tools"))

import gpu_bundle_check

# What gpu_bundle.sh carries besides rlver's wheel (its CARRIED list).
CARRIED = ("jsonargparse", "docstring-parser", "typeshed-client", "tenacity", "aiolimiter")


def fake_bundle(site, leave_out=()):
    """A bundle's install folder as pip --target leaves it, without building or downloading wheels:
    rlver and its plugins from this checkout, its dist-info (the entry points), and the carried
    packages linked from .venv, less `leave_out`."""
    site.mkdir(parents=True)
    (site / "rlver").symlink_to(REPO / "rlver")
    (site / "rlver_plugins").symlink_to(REPO / "plugins")
    rlver = metadata.distribution("rlver")
    info = next(str(f).split("/")[0] for f in rlver.files if str(f).endswith("entry_points.txt"))
    shutil.copytree(rlver.locate_file(info), site / info)
    carried = [metadata.distribution(name) for name in CARRIED if name not in leave_out]
    gpu_bundle_check.link_distributions(carried, site)
    return site


def test_the_clean_environment_has_the_devices_packages_and_nothing_else(tmp_path):
    names = {gpu_bundle_check.normalized(d.metadata["Name"]) for d in gpu_bundle_check.device_distributions()}
    assert {"torch", "transformers", "lightning", "peft", "pluggy", "pyyaml", "numpy"} <= names
    assert not names & {"jsonargparse", "tenacity", "aiolimiter", "rlver", "vllm", "pytest"}
    python = gpu_bundle_check.clean_environment(tmp_path / "env", [])
    seen = gpu_bundle_check.run_clean(python, ["-c", "import yaml, pluggy; print('ok')"], tmp_path)
    assert seen.returncode == 0 and seen.stdout.strip() == "ok", seen.stderr
    for module in ("jsonargparse", "tenacity", "rlver", "pytest"):  # all in .venv, none on the device
        missing = gpu_bundle_check.run_clean(python, ["-c", f"import {module}"], tmp_path)
        assert missing.returncode == 1 and f"No module named '{module}'" in missing.stderr


@pytest.mark.slow
def test_a_bundle_missing_a_dependency_fails_the_self_check_and_a_whole_one_passes(tmp_path):
    # jsonargparse: only LightningCLI needs it, so an import of rlver and its plugins (the check
    # before this one, run with .venv's packages) passed without it.
    whole = gpu_bundle_check.self_check(fake_bundle(tmp_path / "whole"), tmp_path / "whole-env")
    assert whole == []
    failures = gpu_bundle_check.self_check(
        fake_bundle(tmp_path / "no-jsonargparse", leave_out={"jsonargparse"}), tmp_path / "no-ja-env"
    )
    assert failures, "a bundle without jsonargparse passed"
    assert any(f.startswith("rlver fit --help") and "jsonargparse" in f for f in failures), failures
