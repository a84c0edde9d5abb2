#!/usr/bin/env python3
"""Build rlver's wheel, install it into a scratch venv, and import every module from it.

CI and `make setup` install rlver editable (`pip install -e`), which imports straight from the
source folders and so hides a package missing from pyproject.toml. This check installs the
built wheel instead:

1. copies the working tree (tracked and untracked, not ignored files) to a temp folder and
   builds a wheel there with .venv's setuptools (no network, no build isolation); setuptools
   warnings about our configuration are failures;
2. checks the wheel holds every file under rlver/ and plugins/ (plugins/ as rlver_plugins/);
3. creates a scratch venv, installs the wheel with --no-deps, then makes .venv's installed
   dependencies visible through a .pth file (after the install, so pip never sees .venv's
   editable rlver);
4. from a folder outside the repo, imports every module of rlver and rlver_plugins
   (pkgutil.walk_packages), each of which must come from the scratch venv;
5. runs the scratch venv's `rlver plugins` (the 7 built-in plugins must be listed) and
   `rlver --help`.
6. the installed embedded user (its default, SAGE-calibrated judge) answers one reply of a
   built-in profile: its calibration and the profiles are data files read from the wheel.

Run from anywhere (takes about 20 s):  .venv/bin/python .ci/wheel_check.py
Exits 1 with a message naming what is wrong. `--pyproject FILE` builds with another
pyproject.toml (tests/integration/test_packaging.py uses it to show a forgotten package fails the check).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Source folder -> installed top-level package.
PACKAGE_ROOTS = {"rlver": "rlver", "plugins": "rlver_plugins"}
# Lines of the build log that are warnings about our configuration.
BUILD_WARNING = re.compile(r"(SetuptoolsDeprecationWarning|BuildBackendWarning|SetuptoolsWarning|_Deprecat)")
IGNORED_PARTS = {".git", ".venv", "__pycache__", "build", "dist", "runs", "lightning_logs"}


class CheckFailed(Exception):
    pass


def run(cmd: list[str], *, cwd: Path, timeout: float = 120, env: dict[str, str] | None = None):
    try:
        return subprocess.run(
            [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as error:
        raise CheckFailed(f"timed out after {timeout:.0f} s: {' '.join(map(str, cmd))}") from error


def source_files() -> list[str]:
    """Files a fresh clone plus untracked work would have (git's view when available)."""
    listed = (
        run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO) if shutil.which("git") else None
    )
    if listed is not None and listed.returncode == 0:
        names = [n for n in listed.stdout.split("\0") if n]
    else:
        names = [
            str(p.relative_to(REPO))
            for p in REPO.rglob("*")
            if p.is_file() and not IGNORED_PARTS.intersection(p.relative_to(REPO).parts)
        ]
    return sorted(n for n in names if (REPO / n).is_file() and not n.endswith((".pyc", ".pyo")))


def expected_wheel_files(files: list[str]) -> dict[str, str]:
    """Wheel path -> source path for every file of the two package folders."""
    expected = {}
    for name in files:
        top, _, rest = name.partition("/")
        if top in PACKAGE_ROOTS and rest and "__pycache__" not in name:
            expected[f"{PACKAGE_ROOTS[top]}/{rest}"] = name
    return expected


def expected_modules(expected_files: dict[str, str]) -> list[str]:
    modules = []
    for path in expected_files:
        if not path.endswith(".py"):
            continue
        parts = path[: -len(".py")].split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules.append(".".join(parts))
    return sorted(modules)


def build_wheel(python: Path, files: list[str], work: Path, pyproject: Path | None) -> tuple[Path, list[str]]:
    """The wheel, and the build log's setuptools warnings about our configuration."""
    src = work / "src"
    for name in files:
        target = src / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    if pyproject is not None:
        shutil.copy2(pyproject, src / "pyproject.toml")
    dist = work / "dist"
    result = run(
        [
            python,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            dist,
            src,
        ],
        cwd=work,
        timeout=180,
    )
    log = result.stdout + result.stderr
    if result.returncode != 0:
        raise CheckFailed(f"the wheel did not build:\n{log[-4000:]}")
    warnings = sorted({line.strip() for line in log.splitlines() if BUILD_WARNING.search(line)})
    wheels = list(dist.glob("rlver-*.whl"))
    if len(wheels) != 1:
        raise CheckFailed(f"expected one rlver wheel in {dist}, found {[w.name for w in wheels]}")
    return wheels[0], warnings


def check_wheel(wheel: Path, expected: dict[str, str], warnings: list[str]) -> None:
    with zipfile.ZipFile(wheel) as archive:
        present = set(archive.namelist())
    missing = sorted(path for path in expected if path not in present)
    problems = []
    if warnings:
        problems.append(
            "setuptools warned about pyproject.toml while building the wheel:\n  " + "\n  ".join(warnings)
        )
    if missing:
        folders = sorted({str(Path(expected[m]).parent) for m in missing})
        problems.append(
            f"{len(missing)} file(s) of the source tree are not in {wheel.name}:\n  "
            + "\n  ".join(missing[:30])
            + f"\n(source folders: {', '.join(folders)}; a package folder missing from [tool.setuptools]"
            " packages, or a data file missing from [tool.setuptools.package-data] in pyproject.toml)"
        )
    if problems:
        raise CheckFailed("\n".join(problems))


def purelib(python: Path, env: dict[str, str]) -> Path:
    result = run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=REPO, env=env
    )
    if result.returncode != 0:
        raise CheckFailed(f"{python} does not run: {result.stderr[-2000:]}")
    return Path(result.stdout.strip())


IMPORT_ALL = r"""
import importlib, json, pkgutil, sys, traceback
from pathlib import Path

site, expected = Path(sys.argv[1]).resolve(), set(json.loads(sys.argv[2]))
errors, found, outside = {}, set(), {}

def where(module):
    file = getattr(module, "__file__", None)
    if file is None or site not in Path(file).resolve().parents:
        outside[module.__name__] = file

def failed(name):
    errors[name] = traceback.format_exc(limit=-3)

for top in ("rlver", "rlver_plugins"):
    try:
        package = importlib.import_module(top)
    except Exception:
        failed(top)
        continue
    found.add(top)
    where(package)
    for info in pkgutil.walk_packages(package.__path__, top + ".", onerror=failed):
        found.add(info.name)
        try:
            where(importlib.import_module(info.name))
        except Exception:
            failed(info.name)
print(json.dumps({
    "imported": sorted(found - set(errors)),
    "errors": errors,
    "outside": outside,
    "not_found": sorted(expected - found),
}))
"""


def check_imports(
    scratch_python: Path, site: Path, modules: list[str], cwd: Path, env: dict[str, str]
) -> int:
    result = run([scratch_python, "-c", IMPORT_ALL, site, json.dumps(modules)], cwd=cwd, env=env, timeout=240)
    if result.returncode != 0:
        raise CheckFailed(f"the import check crashed:\n{(result.stdout + result.stderr)[-4000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    problems = []
    for name in report["not_found"]:
        problems.append(f"{name}: in the source tree, not importable from the installed wheel")
    for name, error in report["errors"].items():
        problems.append(f"{name}: import failed:\n    " + error.strip().replace("\n", "\n    "))
    for name, file in report["outside"].items():
        problems.append(f"{name}: imported from {file}, not from the scratch venv {site}")
    if problems:
        raise CheckFailed("importing the installed wheel:\n  " + "\n  ".join(problems))
    return len(report["imported"])


def check_console_script(bin_dir: Path, cwd: Path, env: dict[str, str]) -> list[str]:
    rlver = bin_dir / "rlver"
    if not rlver.is_file():
        raise CheckFailed(f"the wheel installed no `rlver` console script in {bin_dir}")
    result = run([rlver, "plugins"], cwd=cwd, env=env)
    if result.returncode != 0:
        raise CheckFailed(f"`rlver plugins` failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    try:
        listed = {plugin["name"]: plugin for plugin in json.loads(result.stdout)}
    except (ValueError, KeyError, TypeError) as error:
        raise CheckFailed(
            f"`rlver plugins` printed no plugin list ({error}):\n{result.stdout[-2000:]}"
        ) from None
    builtin = sorted(p.name for p in (REPO / "plugins").iterdir() if (p / "__init__.py").is_file())
    missing = [name for name in builtin if name not in listed]
    if missing:
        raise CheckFailed(
            f"`rlver plugins` does not list the built-in plugin(s) {missing}; it lists {sorted(listed)}"
        )
    wrong = [n for n in builtin if listed[n].get("module") != f"rlver_plugins.{n}"]
    if wrong:
        raise CheckFailed(f"`rlver plugins`: built-in plugin(s) {wrong} registered from the wrong module")
    result = run([rlver, "--help"], cwd=cwd, env=env)
    if result.returncode != 0 or "fit" not in result.stdout:
        raise CheckFailed(
            f"`rlver --help` failed (exit {result.returncode}):\n{(result.stdout + result.stderr)[-2000:]}"
        )
    return builtin


EMBEDDED_USER = """
from pathlib import Path
import sys
from rlver.data.profiles import load_profiles
from rlver_plugins.embedded_user import EmbeddedUserSimulator, semantic
assert Path(semantic.CALIBRATION).resolve().is_relative_to(Path(sys.argv[1]).resolve()), semantic.CALIBRATION
simulator = EmbeddedUserSimulator()
session = simulator.open(load_profiles("builtin:en_test")[0], seed=0)
session.opening()
turn = session.respond("That sounds really hard. What happened next?")
print(simulator.judge, turn.reason["semantic"]["change"])
"""


def check_embedded_user(scratch_python: Path, site: Path, cwd: Path, env: dict[str, str]) -> str:
    result = run([scratch_python, "-c", EMBEDDED_USER, site], cwd=cwd, env=env, timeout=240)
    if result.returncode != 0 or not result.stdout.startswith("semantic "):
        raise CheckFailed(
            "the installed embedded user could not judge a reply:\n" + (result.stdout + result.stderr)[-3000:]
        )
    return result.stdout.split()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_python = REPO / ".venv" / "bin" / "python"
    parser.add_argument(
        "--python",
        type=Path,
        default=default_python if default_python.exists() else Path(sys.executable),
        help="The interpreter of the development venv: builds the wheel, provides the dependencies.",
    )
    parser.add_argument(
        "--pyproject", type=Path, default=None, help="Build with this pyproject.toml instead."
    )
    parser.add_argument("--keep", action="store_true", help="Keep the temp folder (printed) for inspection.")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="rlver-wheel-check-"))
    # A clean environment: nothing of the caller's venv or PYTHONPATH may leak into the scratch venv.
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}}
    env["PYTHONNOUSERSITE"] = "1"
    try:
        files = source_files()
        expected = expected_wheel_files(files)
        modules = expected_modules(expected)
        wheel, warnings = build_wheel(args.python, files, work, args.pyproject)
        check_wheel(wheel, expected, warnings)
        print(f"wheel-check: built {wheel.name} ({len(expected)} package files)", flush=True)

        scratch = work / "venv"
        made = run([args.python, "-m", "venv", "--without-pip", scratch], cwd=work)
        if made.returncode != 0:
            raise CheckFailed(f"could not create the scratch venv:\n{made.stderr[-2000:]}")
        scratch_python = scratch / "bin" / "python"
        installed = run(
            [
                args.python,
                "-m",
                "pip",
                "--python",
                scratch_python,
                "install",
                "-q",
                "--no-deps",
                "--no-index",
                wheel,
            ],
            cwd=work,
        )
        if installed.returncode != 0:
            raise CheckFailed(
                f"pip could not install the wheel:\n{(installed.stdout + installed.stderr)[-3000:]}"
            )
        site = purelib(scratch_python, env)
        # .venv's dependencies, after the wheel: a plain path line, so .venv's own .pth files
        # (the editable rlver's finder among them) are not run.
        (site / "_rlver_wheel_check_deps.pth").write_text(f"{purelib(args.python, env)}\n")

        outside = work / "elsewhere"  # cwd for the checks: the repo is not on sys.path
        outside.mkdir()
        count = check_imports(scratch_python, site, modules, outside, env)
        plugins = check_console_script(scratch / "bin", outside, env)
        change = check_embedded_user(scratch_python, site, outside, env)
    except CheckFailed as error:
        print(f"wheel-check FAILED: {error}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"wheel-check: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"wheel-check: OK in {time.perf_counter() - started:.0f} s: imported {count} modules from the wheel, "
        f"`rlver plugins` lists the {len(plugins)} built-in plugins, `rlver --help` works, "
        f"the embedded user judged a reply (change {change} from its semantic judge)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
