"""Keep the memory a CPU run frees for its next step (glibc's malloc, Linux).

A training step on CPU allocates and frees the same large tensors every step: the logits and
their float32 copies, activations, gradients. glibc serves every block above its mmap threshold
(128 KiB, rising to at most 32 MiB) with fresh pages from the kernel and hands them back on free,
and it trims the heap's top as soon as 128 KiB-64 MiB lie free there; so each step faults its
large tensors' pages in again, each one zeroed by the kernel. Measured 2026-12-03 (2 cores,
SmolLM2-135M, 3 GRPO steps with the hf engine): 5.6 M minor page faults and 18.5 s of system
time with glibc's defaults; 1.3 M and 8.7 s with the settings below; peak RSS 4.7 -> 5.1 GB.
In the test suite: 232 -> 183 s of system time.

Between steps the kept pages go back (`hand_back_freed_memory`, malloc_trim(3), at the end of every
training step: `FreedMemoryBetweenSteps`). Kept across steps, they ratcheted: the quickstart's 28
steps grew from 3.85 GiB after its first step to 4.23-4.44 GiB (benchmarks/peak_memory.py,
docs/performance.md), most likely because a step's tensors differ in size with its replies'
lengths and a freed block too small for the next step's stays resident beside the new one.
Within a step they are still reused; each step faults its pages in once.

Only where the run computes on the CPU: on a GPU node the host's big allocations are rare and
short-lived (a gathered state dict for a checkpoint), and keeping them would hold that memory for
the rest of the run. Nothing changes where the user tuned malloc already (MALLOC_*_ variables,
GLIBC_TUNABLES) or sets RLVER_KEEP_FREED_MEMORY=0.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

from lightning.pytorch.callbacks import Callback

# mallopt(3) parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

_MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB from the heap, where a freed block is reused
_TRIM_THRESHOLD = 2**31 - 1  # keep up to 2 GiB free at the heap's top (mallopt takes an int)
_TOP_PAD = 1 << 28  # grow the heap 256 MiB at a time (address space only until touched)

_applied = False


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse; True if it now does (once per process)."""
    global _applied
    if _applied:
        return True
    if sys.platform != "linux" or os.environ.get("RLVER_KEEP_FREED_MEMORY", "1") == "0":
        return False
    tuned = [name for name in os.environ if name.startswith("MALLOC_") and name.endswith("_")]
    if tuned or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False  # the user's own malloc settings win
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt  # glibc; musl has no libc.so.6 and no mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = {_M_MMAP_THRESHOLD: _MMAP_THRESHOLD, _M_TRIM_THRESHOLD: _TRIM_THRESHOLD, _M_TOP_PAD: _TOP_PAD}
    _applied = all([mallopt(parameter, value) == 1 for parameter, value in settings.items()])
    return _applied


def hand_back_freed_memory() -> bool:
    """Give the kernel back the free pages malloc keeps (malloc_trim(0)); True if any went back.

    Only after `keep_freed_memory` took effect: glibc's defaults hand large blocks back by themselves.
    """
    if not _applied:
        return False
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return trim(0) == 1


class FreedMemoryBetweenSteps(Callback):
    """At the end of every training step, the pages the step freed go back to the kernel."""

    def on_train_batch_end(self, *args: Any) -> None:
        hand_back_freed_memory()
