"""Running model-written code: a Python program in a child process with time and memory limits.

HumanEval's score is whether the model's function passes the task's tests, so the model's code
has to run. It runs in a separate interpreter (`python -I`: no user site, no PYTHON* variables),
in an empty scratch folder, with limits set in the child before it starts (resource.setrlimit:
address space, CPU seconds, file size, open files) and a wall-clock timeout after which its whole
process group is killed. That bounds a runaway loop or allocation; it is not a security sandbox
(the code can still read files and open sockets), which is why `rlver eval` runs code tasks only
when asked to and says so.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_MB = 1024


@dataclass(frozen=True)
class ProgramOutcome:
    """How a program ended: `passed` only for exit status 0 within the limits."""

    passed: bool
    reason: str  # "passed", "failed (exit N)", "timed out", ...


def _limits(memory_mb: int, cpu_seconds: int):
    def apply() -> None:  # runs in the child between fork and exec
        memory = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024 * 1024, 16 * 1024 * 1024))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_program(
    source: str, timeout_s: float = DEFAULT_TIMEOUT_S, memory_mb: int = DEFAULT_MEMORY_MB
) -> ProgramOutcome:
    """Run `source` as a Python program under the limits; passed when it exits 0 in time."""
    with tempfile.TemporaryDirectory(prefix="rlver-code-") as scratch:
        program = os.path.join(scratch, "program.py")
        with open(program, "w", encoding="utf-8") as handle:
            handle.write(source)
        child = subprocess.Popen(
            [sys.executable, "-I", program],
            cwd=scratch,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1"},
            preexec_fn=_limits(memory_mb, max(1, int(timeout_s) + 1)),
            start_new_session=True,  # its own process group: a timeout kills what it started too
        )
        try:
            status = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return ProgramOutcome(False, "timed out")
        finally:
            if child.poll() is None:  # an interrupt while waiting: leave nothing behind
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    if status == 0:
        return ProgramOutcome(True, "passed")
    if status < 0:
        return ProgramOutcome(False, f"killed by signal {-status} (a limit: CPU time or memory)")
    return ProgramOutcome(False, f"failed (exit {status})")
