"""rlver.parallel.allocator: a CPU run reuses the pages it freed instead of faulting them in again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or os.confstr("CS_GNU_LIBC_VERSION") is None, reason="glibc's malloc only"
)

# In a fresh interpreter (the settings are process-wide): the page faults of touching a 64 MiB block
# again after freeing it (glibc's defaults: fresh mmap pages every time).
SCRIPT = """
import ctypes, json, resource
from rlver.parallel import allocator

applied = allocator.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
size = 64 << 20
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    libc.free(block)
print(json.dumps({"applied": applied, "pages": size // resource.getpagesize(), "faults": faults}))
"""


def _run(script: str = SCRIPT, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    environment.pop("RLVER_KEEP_FREED_MEMORY", None)
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={**environment, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_freed_memory_is_reused_instead_of_faulted_in_again():
    kept = _run()
    assert kept["applied"]
    first, again = kept["faults"]
    assert first >= kept["pages"] * 0.9  # the first touch faults every page in
    assert again < kept["pages"] * 0.1  # the second finds them mapped: the freed block was reused


@pytest.mark.parametrize(
    "opt_out",
    [
        {"RLVER_KEEP_FREED_MEMORY": "0"},
        {"MALLOC_TOP_PAD_": "0"},
        {"GLIBC_TUNABLES": "glibc.malloc.top_pad=0"},
    ],
)
def test_the_user_can_say_no_or_tune_malloc_themselves(opt_out):
    default = _run(**opt_out)
    assert not default["applied"]
    assert min(default["faults"]) >= default["pages"] * 0.9, default  # faulted in every time


def test_a_cpu_trainer_keeps_freed_memory_and_hands_it_back_between_steps(monkeypatch):
    from rlver.parallel.allocator import FreedMemoryBetweenSteps
    from rlver.train import trainer

    calls: list[int] = []
    monkeypatch.setattr(trainer, "keep_freed_memory", lambda: calls.append(1) or True)
    built = trainer.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert calls == [1]
    assert sum(isinstance(c, FreedMemoryBetweenSteps) for c in built.callbacks) == 1


# Kept freed blocks are resident until handed back; `hand_back_freed_memory` returns their pages.
TRIM_SCRIPT = """
import ctypes, json
from rlver.parallel import allocator

def resident_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20

allocator.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
guard = libc.malloc(1 << 20)  # a live block below, so the freed one is not simply the whole heap
block = libc.malloc(256 << 20)
ctypes.memset(block, 1, 256 << 20)
tail = libc.malloc(1 << 20)  # and one above it: trimming the heap's top alone would not reach it
ctypes.memset(tail, 1, 1 << 20)
libc.free(block)
kept = resident_mib()
handed_back = allocator.hand_back_freed_memory()
print(json.dumps({"kept": kept, "after": resident_mib(), "handed_back": handed_back}))
"""


def test_freed_memory_goes_back_to_the_kernel_between_steps():
    figures = _run(TRIM_SCRIPT)
    assert figures["handed_back"]
    assert figures["kept"] - figures["after"] >= 200, figures  # the freed 256 MiB were resident, then not
