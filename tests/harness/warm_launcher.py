"""`rlver <args>` in a new process that skips the imports: forked from one that already made them.

A fresh `python -m rlver.cli` spends about 7 s importing torch, transformers and Lightning before
it reads its first argument; the suite starts dozens of such processes per worker, so that was
a third of its CPU time. Each xdist worker keeps one warm process (tests/harness/warm_process.py, run
as `python -m tests.harness.warm_process`) that imports `rlver.cli` once and forks a child per launch.
The child is a separate process with its own memory, working directory, environment, argv,
stdout/stderr files and exit status, and it runs `rlver.cli.main()` exactly as the console
script does; only the imports (and the embedded user's encoder, built as a run builds it) are
inherited. Launches whose outcome could depend on import-time
state go to a fresh interpreter instead (`needs_fresh_process`): an environment that differs
from the warm process's in anything but run-time variables, a PYTHONPATH folder holding a module
the warm process imported, or `--verbose` (its logging is set at import).
RLVER_TEST_FRESH_PROCESSES=1 sends every launch to a fresh interpreter.

What a shared import gives up: every child of one warm process has the same string-hash seed,
so two runs compared for exactness in one test do not also vary the hash seed (the chaos and
multi-process resume tests start their reference run fresh, so theirs still differ).

Protocol on the warm process's stdin/stdout, one JSON object a line: the request
{"argv", "cwd", "env", "stdout", "stderr", "new_session"}; the answers {"pid"} when forked, then
{"returncode"} (negative: the signal that ended it, as subprocess reports it).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time

# Variables read while a run runs, not while rlver.cli imports: a launch may differ in these.
# (PYTHONPATH: the child puts it on sys.path, before site-packages as a fresh interpreter does;
# a launch whose new folder holds a module the warm process imported goes to a fresh one.)
RUN_TIME_VARIABLES = (
    "PYTHONPATH",
    "RLVER_CHAOS",
    "RLVER_TRACE_HOOKS",
    "RLVER_DISABLE_PLUGINS",
    "RLVER_CACHE_DIR",
    "MASTER_ADDR",  # torch.distributed reads these when a process group starts
    "MASTER_PORT",
)
RUN_TIME_PREFIXES = ("RLVER_SIMULATOR_", "RLVER_TEST_", "PYTEST_")


def _import_time_differences(env: dict[str, str], warm_env: dict[str, str]) -> list[str]:
    changed = {k for k in env.keys() | warm_env.keys() if env.get(k) != warm_env.get(k)}
    return sorted(k for k in changed if k not in RUN_TIME_VARIABLES and not k.startswith(RUN_TIME_PREFIXES))


def _top_level_names(folders: list[str]) -> set[str]:
    """The importable top-level names in `folders` (packages, modules, extensions)."""
    names = set()
    for folder in folders:
        with contextlib.suppress(OSError):
            for entry in os.scandir(folder):
                name = entry.name.partition(".")[0]
                if entry.is_dir() or entry.name.endswith((".py", ".pyc", ".so", ".pyd")):
                    names.add(name)
    return names


def limit_file_size(limit: int | None) -> None:
    """In a launched process: writes past `limit` bytes fail (EFBIG), as on a full disk."""
    if limit is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the signal would kill the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def _fresh_command(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "rlver.cli", *argv]


def _log_launch(argv: list[str], why_fresh: str) -> None:
    """RLVER_TEST_LAUNCH_LOG=<file>: one JSON line per launch (which test, warm or why not)."""
    path = os.environ.get("RLVER_TEST_LAUNCH_LOG")
    if path:
        line = {"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "argv": argv[:1], "fresh": why_fresh}
        with open(path, "a") as log:
            log.write(json.dumps({**line, "time": time.time()}) + "\n")


# --------------------------------------------------------------------------- the test side
class WarmLauncher:
    """One warm process for this test process; `run` is `subprocess.run(capture_output=True)`."""

    def __init__(self, repo: str):
        self.repo = repo
        self.process: subprocess.Popen | None = None
        self.warm_env: dict[str, str] = {}
        self.set_at_import: dict[str, str] = {}
        self.imported: set[str] = set()
        self.busy = False
        self.parked: dict | None = None  # the warm process of the environment before the last change

    def _start_env(self) -> dict[str, str]:
        from rlver.core.console import QUIET_ENVIRONMENT, verbose_in

        env = {**os.environ, "PYTHONPATH": self.repo}
        if not verbose_in(env):
            # What rlver's import sets where missing is left to the warm process's own import: it
            # is then in set_at_import, and a launch with or without it matches the warm process
            # as it would a fresh interpreter (a test of a user's fresh shell stays warm).
            for name, value in QUIET_ENVIRONMENT.items():
                if env.get(name) == value:
                    del env[name]
        return env

    def _start(self) -> bool:
        env = self._start_env()
        _log_launch(["(warm process)"], "started")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.harness.warm_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=self.repo,
            env=env,
            text=True,
        )
        self._unread = b""
        hello = json.loads(self._readline(None) or "{}")
        if not hello.get("ready"):
            self.close()
            return False
        self.warm_env = hello["env"]
        self.set_at_import = hello["set_at_import"]
        self.imported = set(hello["imported"])
        return True

    def needs_fresh_process(self, argv: list[str], env: dict[str, str], fresh: bool = False) -> str:
        """Why this launch needs a new interpreter ("" when a warm child will do)."""
        if fresh or os.environ.get("RLVER_TEST_FRESH_PROCESSES"):
            return "asked for"
        if sys.platform != "linux":  # fork() after torch's imports is only dependable on Linux
            return "not Linux"
        if "--verbose" in argv:
            return "--verbose (logging is set at import)"
        if self.process is not None and _import_time_differences(self._start_env(), self.warm_env):
            self._swap_with_parked()  # this test process's own environment changed since
        if (self.process is None or self.process.poll() is not None) and not self._start():
            return "no warm process"
        # The warm process imported with its own environment: a launch's may differ only in
        # what is read later, and in what the imports themselves set (the child gets those).
        expected = {**self.warm_env, **{k: v for k, v in self.set_at_import.items() if k in env}}
        known = {*sys.path, *self.warm_env.get("PYTHONPATH", "").split(os.pathsep), self.repo}
        unknown = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in known]
        # A PYTHONPATH folder is not a site folder (no .pth files), so a new one only adds
        # modules; unless it holds one the warm process imported, which a fresh run would take
        # from that folder instead.
        shadowing = sorted(_top_level_names(unknown) & self.imported)
        if shadowing:
            return f"PYTHONPATH {unknown} holds modules already imported: {shadowing}"
        differences = _import_time_differences(env, expected)
        return f"environment differs in {differences}" if differences else ""

    def _decide(self, argv, env, fresh) -> tuple[list[str], dict[str, str], str]:
        argv, env = [str(a) for a in argv], dict(env)
        why_fresh = self.needs_fresh_process(argv, env, fresh)
        _log_launch(argv, why_fresh)
        return argv, env, why_fresh

    def run(
        self, argv, *, cwd, env, timeout=None, fresh=False, file_size_limit=None
    ) -> subprocess.CompletedProcess:
        """As `subprocess.run(capture_output=True, text=True)`; `fresh`: in a new interpreter;
        `file_size_limit`: bytes, the process's RLIMIT_FSIZE (SIGXFSZ ignored: writes fail)."""
        argv, env, why_fresh = self._decide(argv, env, fresh)
        if why_fresh:
            return subprocess.run(
                _fresh_command(argv),
                capture_output=True,
                text=True,
                cwd=cwd,
                env=env,
                timeout=timeout,
                preexec_fn=lambda: limit_file_size(file_size_limit),
            )
        with tempfile.TemporaryDirectory(prefix="rlver-launch-") as folder:
            out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
            pid = self._fork(argv, cwd, env, out, err, new_session=False, file_size_limit=file_size_limit)
            returncode = self._wait(pid, argv, time.monotonic() + timeout if timeout else None)
            with open(out, errors="replace") as o, open(err, errors="replace") as e:
                stdout, stderr = o.read(), e.read()
        if returncode is None:
            raise subprocess.TimeoutExpired(["rlver", *argv], timeout, stdout, stderr)
        return subprocess.CompletedProcess(["rlver", *argv], returncode, stdout, stderr)

    def popen(self, argv, *, cwd, env, new_session=False, fresh=False):
        """As `subprocess.Popen(stdout=PIPE, stderr=STDOUT, text=True)`, in the background."""
        argv, env, why_fresh = self._decide(argv, env, fresh)
        if why_fresh:
            return subprocess.Popen(
                _fresh_command(argv),
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=new_session,
            )
        folder = tempfile.mkdtemp(prefix="rlver-launch-")
        output = os.path.join(folder, "output")
        open(output, "w").close()  # there before the child starts: WarmProcess reads it
        pid = self._fork(argv, cwd, env, output, output, new_session=new_session)
        return WarmProcess(self, pid, argv, output)

    def _end_left_behind(self) -> None:
        """A background run a failed test left behind: killed, its exit status read."""
        if self.busy:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.current_pid, signal.SIGKILL)
            self._readline(None)
            self.busy = False

    def _fork(self, argv, cwd, env, stdout, stderr, *, new_session, file_size_limit=None) -> int:
        self._end_left_behind()
        request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": stdout, "stderr": stderr}
        request["file_size_limit"] = file_size_limit
        request["set_at_import"] = self.set_at_import
        self.process.stdin.write(json.dumps({**request, "new_session": new_session}) + "\n")
        self.process.stdin.flush()
        self.busy = True
        self.current_pid = json.loads(self._readline(None))["pid"]
        return self.current_pid

    def _readline(self, deadline: float | None) -> str | None:
        """One line from the warm process (raw reads: select must see what is not yet read)."""
        fd = self.process.stdout.fileno()
        while b"\n" not in self._unread:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return ""
            self._unread += chunk
        line, self._unread = self._unread.split(b"\n", 1)
        return line.decode()

    def _wait(self, pid: int, argv, deadline: float | None, *, kill_at_deadline=True) -> int | None:
        """The child's exit status; None at the deadline (the child killed first if asked)."""
        line = self._readline(deadline)
        if line is None:
            if not kill_at_deadline:
                return None
            os.kill(pid, signal.SIGKILL)  # as subprocess.run does at its timeout
            line = self._readline(None)
            self.busy = False
            return None
        self.busy = False
        if not line:
            raise RuntimeError(f"the warm launcher died while running rlver {argv}")
        return json.loads(line)["returncode"]

    _STATE = ("process", "warm_env", "set_at_import", "imported", "_unread")

    def _swap_with_parked(self) -> None:
        """Park the warm process of the old environment, take the parked one if it was warmed
        in this one (else warm up again): a test that changes its own environment for a while
        (monkeypatch) costs one warm-up, not a second one when the environment is back."""
        self._end_left_behind()
        current = {name: getattr(self, name) for name in self._STATE}
        parked, self.parked = self.parked, current
        if parked is not None and not _import_time_differences(self._start_env(), parked["warm_env"]):
            for name, value in parked.items():
                setattr(self, name, value)
        else:
            if parked is not None:
                _stop(parked["process"])
            self.process = None

    def close(self) -> None:
        if self.parked is not None:
            _stop(self.parked["process"])
            self.parked = None
        if self.process is not None:
            self._end_left_behind()
            _stop(self.process)
            self.process = None


def _stop(process: subprocess.Popen) -> None:
    process.stdin.close()  # the warm process exits at the end of its input
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()


class WarmProcess:
    """What the tests use of `subprocess.Popen` (stdout and stderr in one), for a warm child."""

    def __init__(self, launcher: WarmLauncher, pid: int, argv: list[str], output: str):
        self.launcher, self.pid, self.argv, self.output = launcher, pid, argv, output
        self.args = ["rlver", *argv]
        self.returncode: int | None = None
        self.stdout = open(output, errors="replace")  # noqa: SIM115  (read as the child writes)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.launcher._wait(
                self.pid, self.argv, time.monotonic(), kill_at_deadline=False
            )
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            self.returncode = self.launcher._wait(self.pid, self.argv, deadline, kill_at_deadline=False)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        output = self.stdout.read()
        self.stdout.close()
        os.remove(self.output)
        os.rmdir(os.path.dirname(self.output))
        return output, None

    def send_signal(self, which: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, which)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
