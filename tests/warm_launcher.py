"""`rlver <args>` in a new process that skips the imports: forked from one that already made them.

A fresh `python -m rlver.cli` spends about 7 s importing torch, transformers and Lightning before
it reads its first argument; the suite starts dozens of such processes per worker, so that was
a third of its CPU time. Each xdist worker keeps one warm process (this module, run as
`python -m tests.warm_launcher`) that imports `rlver.cli` once and then forks a child per launch.
The child is a separate process with its own memory, working directory, environment, argv,
stdout/stderr files and exit status, and it runs `rlver.cli.main()` exactly as the console
script does; only the imports are inherited. Launches whose outcome could depend on import-time
state go to a fresh interpreter instead (`needs_fresh_process`): an environment that differs
from the warm process's in anything but run-time variables, or `--verbose` (its logging is set at
import). RLVER_TEST_FRESH_PROCESSES=1 sends every launch to a fresh interpreter.

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
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

# Variables read while a run runs, not while rlver.cli imports: a launch may differ in these.
# (PYTHONPATH: the child puts it on sys.path; a site folder's .pth files would need a fresh
# interpreter, so a launch that adds a folder not already on the path goes to one.)
RUN_TIME_VARIABLES = (
    "PYTHONPATH",
    "RLVER_CHAOS",
    "RLVER_TRACE_HOOKS",
    "RLVER_DISABLE_PLUGINS",
    "RLVER_CACHE_DIR",
)
RUN_TIME_PREFIXES = ("RLVER_SIMULATOR_", "RLVER_TEST_", "PYTEST_")


def _import_time_differences(env: dict[str, str], warm_env: dict[str, str]) -> list[str]:
    changed = {k for k in env.keys() | warm_env.keys() if env.get(k) != warm_env.get(k)}
    return sorted(k for k in changed if k not in RUN_TIME_VARIABLES and not k.startswith(RUN_TIME_PREFIXES))


def _fresh_command(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "rlver.cli", *argv]


def _log_launch(argv: list[str], why_fresh: str) -> None:
    """RLVER_TEST_LAUNCH_LOG=<file>: one JSON line per launch (which test, warm or why not)."""
    path = os.environ.get("RLVER_TEST_LAUNCH_LOG")
    if path:
        line = {"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "argv": argv[:1], "fresh": why_fresh}
        with open(path, "a") as log:
            log.write(json.dumps({**line, "time": time.time()}) + "\n")


# --------------------------------------------------------------------------- the warm process
# Set by Lightning in rank 0 for the ranks it starts, read by them at run time.
RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


def _become(request: dict) -> None:
    """This forked process takes the requested working folder, environment, argv and output."""
    if request.get("new_session"):
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for name, value in request["set_at_import"].items():  # as the imports set them in a fresh one
        os.environ.setdefault(name, value)
    # sys.path as `python -m rlver.cli` in that directory builds it: the cwd, then PYTHONPATH.
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *[p for p in sys.path[1:] if p not in extra]]
    if "stdout" in request:  # else the output it inherited (a rank: its rank 0's, as Popen gives)
        opened = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, 1)
        if request["stderr"] != request["stdout"]:  # else one file description: one offset for both
            os.close(opened)
            opened = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, 2)
        os.close(opened)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import importlib.util

    import __main__
    import rlver.cli

    # Lightning starts further ranks as `python -m <__main__'s module> <sys.argv[1:]>`.
    __main__.__spec__ = importlib.util.find_spec("rlver.cli")
    sys.argv = [rlver.cli.__file__, *request["argv"]]


class _SpareRank:
    """A fork of this process made before `main()` runs, for Lightning's rank 1 to become.

    Lightning's rank 0 starts the other ranks with `subprocess.Popen([python, -m, rlver.cli,
    <argv>], env=<its environment + the rank variables>)`: a fresh interpreter's 7 s of imports
    while rank 0 waits. When the command and environment are exactly those, the spare takes them
    and runs `main()` instead; anything else gets the real Popen. Unused, it is ended at exit.
    """

    def __init__(self) -> None:
        self.started_env = dict(os.environ)
        read, self.write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.write)
            data = b""
            while chunk := os.read(read, 65536):
                data += chunk
            if not data:
                os._exit(0)
            _run_child(json.loads(data), spare=False)
        os.close(read)
        self.used = False

    def popen(self, command, env=None, cwd=None, **options):
        env = dict(os.environ if env is None else env)
        rank_launch = _fresh_command(sys.argv[1:])
        changed = [
            k
            for k in _import_time_differences(env, self.started_env)
            if k not in RANK_VARIABLES and not k.startswith("PL_")  # Lightning's, read at run time
        ]
        if self.used or options or list(command) != rank_launch or changed:
            _log_launch(["rank"], f"not the rank launch the spare is for ({changed})")
            return subprocess.Popen(command, env=env, cwd=cwd, **options)
        _log_launch(["rank"], "")
        request = {"argv": sys.argv[1:], "cwd": cwd or os.getcwd(), "env": env, "set_at_import": {}}
        os.write(self.write, json.dumps(request).encode())
        os.close(self.write)
        self.used = True
        return _SpareProcess(self.pid, command)

    def end(self) -> None:
        if not self.used:
            with contextlib.suppress(OSError):
                os.close(self.write)  # the spare reads end-of-file and exits
                os.waitpid(self.pid, 0)


class _SpareProcess:
    """What Lightning uses of `subprocess.Popen` for the ranks it starts."""

    def __init__(self, pid: int, args) -> None:
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, which: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, which)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_child(request: dict, spare: bool = True) -> None:
    """In a forked child: become the requested `rlver` process, run it, exit with its status."""
    code = 1
    spare_rank = None
    try:
        _become(request)
        import rlver.cli

        if spare and "LOCAL_RANK" not in os.environ:
            import types

            from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
            from lightning.pytorch.strategies.launchers import subprocess_script as trainer_launcher

            spare_rank = _SpareRank()
            with_spare = types.SimpleNamespace(**{**vars(subprocess), "Popen": spare_rank.popen})
            fabric_launcher.subprocess = trainer_launcher.subprocess = with_spare
        code = rlver.cli.main()
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:  # what the interpreter does at exit: threading's exit hooks (they stop idle thread
            # pools) and the join of non-daemon threads, then atexit's functions, then a flush
            threading._shutdown()
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            if spare_rank is not None:
                spare_rank.end()
        finally:
            os._exit(code if isinstance(code, int) else 1)


# What vllm.LLM imports on its first construction (~7 s of its ~12 s start here); imported in
# the warm process when vLLM is installed, so a launch that builds the vllm engine skips them.
VLLM_ENGINE_MODULES = (
    "vllm.entrypoints.llm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.model_loader",
)


def _preload_vllm() -> None:
    """Import vLLM's engine modules here, and keep their side effects where a fresh run has them.

    vLLM's imports set environment variables (TORCHINDUCTOR_*, LD_LIBRARY_PATH, ...). A fresh
    `rlver` process gets them when the vllm engine imports vLLM, and a run without that engine
    never does; so they are taken out of this process's environment again and set by the
    engine's `_import_vllm` instead, at the moment a fresh run's import would set them.
    """
    import importlib
    import importlib.util

    if os.environ.get("RLVER_TEST_WARM_VLLM") == "0" or importlib.util.find_spec("vllm") is None:
        return
    from rlver_plugins.vllm_engine import engine

    before = dict(os.environ)
    for module in VLLM_ENGINE_MODULES:
        importlib.import_module(module)
    set_by_vllm = {k: v for k, v in os.environ.items() if before.get(k) != v}
    os.environ.clear()
    os.environ.update(before)
    import_vllm = engine._import_vllm

    def _import_vllm_as_fresh():
        for name, value in set_by_vllm.items():
            if os.environ.get(name) == before.get(name):  # as the import found it: it would set it
                os.environ[name] = value
        return import_vllm()

    engine._import_vllm = _import_vllm_as_fresh


def serve() -> None:
    import gc

    before = dict(os.environ)
    import rlver.cli  # noqa: F401  (the point: imported once, inherited by every child)

    set_at_import = {k: v for k, v in os.environ.items() if before.get(k) != v}
    _preload_vllm()
    # The imports' objects live as long as any child: the collector need not walk them again in
    # each (vLLM's start collects five times; measured here it took 4.5 s unfrozen, 3.1 s frozen).
    gc.freeze()

    if threading.active_count() != 1:  # forking with threads running could deadlock a child
        print(json.dumps({"error": "threads running after import"}), flush=True)
        return
    print(json.dumps({"ready": True, "env": before, "set_at_import": set_at_import}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


# --------------------------------------------------------------------------- the test side
class WarmLauncher:
    """One warm process for this test process; `run` is `subprocess.run(capture_output=True)`."""

    def __init__(self, repo: str):
        self.repo = repo
        self.process: subprocess.Popen | None = None
        self.warm_env: dict[str, str] = {}
        self.set_at_import: dict[str, str] = {}
        self.busy = False

    def _start_env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": self.repo}

    def _start(self) -> bool:
        env = self._start_env()
        _log_launch(["(warm process)"], "started")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.warm_launcher"],
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
            self.close()  # this test process's own environment changed since: warm up again
        if (self.process is None or self.process.poll() is not None) and not self._start():
            return "no warm process"
        # The warm process imported with its own environment: a launch's may differ only in
        # what is read later, and in what the imports themselves set (the child gets those).
        expected = {**self.warm_env, **{k: v for k, v in self.set_at_import.items() if k in env}}
        known = {*sys.path, *self.warm_env.get("PYTHONPATH", "").split(os.pathsep), self.repo}
        unknown = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in known]
        if unknown:
            return f"PYTHONPATH adds {unknown} (their .pth files are read at start)"
        differences = _import_time_differences(env, expected)
        return f"environment differs in {differences}" if differences else ""

    def _decide(self, argv, env, fresh) -> tuple[list[str], dict[str, str], str]:
        argv, env = [str(a) for a in argv], dict(env)
        why_fresh = self.needs_fresh_process(argv, env, fresh)
        _log_launch(argv, why_fresh)
        return argv, env, why_fresh

    def run(self, argv, *, cwd, env, timeout=None, fresh=False) -> subprocess.CompletedProcess:
        """As `subprocess.run(capture_output=True, text=True)`; `fresh`: in a new interpreter."""
        argv, env, why_fresh = self._decide(argv, env, fresh)
        if why_fresh:
            return subprocess.run(
                _fresh_command(argv),
                capture_output=True,
                text=True,
                cwd=cwd,
                env=env,
                timeout=timeout,
            )
        with tempfile.TemporaryDirectory(prefix="rlver-launch-") as folder:
            out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
            pid = self._fork(argv, cwd, env, out, err, new_session=False)
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

    def _fork(self, argv, cwd, env, stdout, stderr, *, new_session) -> int:
        self._end_left_behind()
        request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": stdout, "stderr": stderr}
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

    def close(self) -> None:
        if self.process is not None:
            self._end_left_behind()
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
            self.process = None


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


if __name__ == "__main__":
    serve()
