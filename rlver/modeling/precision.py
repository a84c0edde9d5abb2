"""Precision by capability: bfloat16 only where the hardware computes it natively.

On a CPU without native bfloat16 (AVX2-only x86, ARM without BF16) torch emulates it and a
bf16 matmul runs 10-400x slower than float32, so "auto" must never mean bf16 there. Native
means: CUDA reporting bf16 support; x86 with AVX512-BF16 or AMX-BF16 *and* torch using its
AVX-512 kernels (ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA can limit them); ARM with BF16.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Choice:
    """Whether bfloat16 is native here, and why (one line for the log)."""

    bf16: bool
    reason: str


def cpu_bf16(capability: str, flags: set[str], machine: str, env: Mapping[str, str]) -> Choice:
    """The decision for a CPU, from what can be read off it (pure, so each kind is testable).

    Args:
        capability: torch.backends.cpu.get_cpu_capability() ("AVX2", "AVX512", "DEFAULT", ...).
        flags: The CPU's feature flags (/proc/cpuinfo "flags" on x86, "Features" on ARM).
        machine: platform.machine() ("x86_64", "aarch64", "arm64", ...).
        env: The environment (ONEDNN_MAX_CPU_ISA limits oneDNN's kernels).
    """
    if machine.lower() in ("aarch64", "arm64"):
        if "bf16" in flags:
            return Choice(True, "ARM CPU with BF16 instructions")
        return Choice(False, "ARM CPU without BF16 instructions: bfloat16 would be emulated")
    native = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if not native:
        return Choice(
            False, f"CPU without AVX512-BF16 or AMX (torch kernels: {capability}): bfloat16 would be emulated"
        )
    if not capability.upper().startswith("AVX512"):
        return Choice(
            False, f"torch limited to {capability} kernels (ATEN_CPU_CAPABILITY): bfloat16 would be emulated"
        )
    isa = env.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if isa and isa != "ALL" and "BF16" not in isa and "AMX" not in isa:
        return Choice(False, f"oneDNN limited to {isa} (ONEDNN_MAX_CPU_ISA): bfloat16 would be emulated")
    return Choice(True, f"CPU with {' and '.join(native).upper().replace('_', '-')}")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def native_bf16(device_type: str) -> Choice:
    """Whether this machine's `device_type` ("cuda" or "cpu") computes bfloat16 natively."""
    import torch

    if device_type == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return Choice(True, f"CUDA device {torch.cuda.get_device_name()} with bfloat16")
        return Choice(False, "CUDA device without bfloat16")
    capability = torch.backends.cpu.get_cpu_capability()
    return cpu_bf16(capability, _cpu_flags(), platform.machine(), os.environ)


def device_type_for(accelerator: object) -> str:
    """ "cuda" or "cpu": what a Lightning accelerator setting will run on here."""
    import torch

    name = str(accelerator).lower()
    if name in ("gpu", "cuda") or (name == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def resolve_precision(precision: object, accelerator: object = "auto") -> tuple[object, str | None]:
    """(Lightning precision, why) for "auto": bf16-mixed where bfloat16 is native, else 32-true.

    Any other value is returned unchanged, with no reason.
    """
    if precision != "auto":
        return precision, None
    device = device_type_for(accelerator)
    choice = native_bf16(device)
    chosen = "bf16-mixed" if choice.bf16 else "32-true"
    return chosen, f"precision auto -> {chosen} ({choice.reason})"


def resolve_dtype(dtype: str, device_type: str) -> tuple[str, str | None]:
    """An engine's weight dtype: "auto" is bfloat16 where native, float32 elsewhere."""
    if dtype != "auto":
        return dtype, None
    choice = native_bf16(device_type)
    chosen = "bfloat16" if choice.bf16 else "float32"
    return chosen, f"engine dtype auto -> {chosen} ({choice.reason})"
