"""Precision by device, and the language-model head in float32 whatever the precision.

`auto` is float32 on every CPU and bfloat16 (bf16-mixed, a bf16 engine) on a CUDA device that
computes it. On CPUs bf16 is not one arithmetic: AMX, AVX512-BF16 without AMX and emulated bf16
(AVX2) round differently, and the quickstart's learning followed them (issue 53: +5-8 with AMX,
+0.6 to +2.2 on an AMD CPU with AVX512-BF16 only, float32 reproducing bit for bit across
machines), so a default that picked bf16 where it is native made the result depend on the CPU.
bf16 on a CPU is still there for those who ask (`--trainer.precision bf16-mixed`, engine
`dtype: bfloat16`); `cpu_bf16` says whether it would be native (emulated bf16 is 10-400x slower).

Where bf16 computes (GPUs, or a CPU by request), the head's logits are taken in float32 from
the bf16 backbone's hidden state (`install_float32_head`): bf16 logits round a logit of 16-32
to a step of 0.125, and that error is the log-prob's and the policy gradient's
(docs/performance.md, "bf16 and what the update learns").
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
    """(Lightning precision, why) for "auto": bf16-mixed on a CUDA device with bfloat16, else
    32-true (every CPU: see the module's docstring). Any other value is returned unchanged, with
    no reason."""
    if precision != "auto":
        return precision, None
    device = device_type_for(accelerator)
    if device == "cpu":
        return "32-true", f"precision auto -> 32-true ({CPU_FLOAT32_REASON})"
    choice = native_bf16(device)
    chosen = "bf16-mixed" if choice.bf16 else "32-true"
    return chosen, f"precision auto -> {chosen} ({choice.reason})"


def resolve_dtype(dtype: str, device_type: str) -> tuple[str, str | None]:
    """An engine's weight dtype: "auto" is bfloat16 on a CUDA device with it, float32 elsewhere
    (every CPU)."""
    if dtype != "auto":
        return dtype, None
    if device_type == "cpu":
        return "float32", f"engine dtype auto -> float32 ({CPU_FLOAT32_REASON})"
    choice = native_bf16(device_type)
    chosen = "bfloat16" if choice.bf16 else "float32"
    return chosen, f"engine dtype auto -> {chosen} ({choice.reason})"


CPU_FLOAT32_REASON = "a CPU: float32 learns alike on every CPU, bf16 does not (docs/performance.md)"


def output_head(model: Any) -> Any:
    """The language-model head (output embedding) under the model's wrappers (peft, FSDP1, DDP)."""
    inner = model
    for _ in range(8):
        if hasattr(inner, "get_output_embeddings"):
            head = inner.get_output_embeddings()
            if head is not None:
                return head
        if hasattr(inner, "get_base_model"):  # peft
            inner = inner.get_base_model()
        elif hasattr(inner, "module"):  # FSDP1, DDP
            inner = inner.module
        else:
            break
    return None


def _head_in_float32(head: Any, hidden: Any) -> Any:
    """The head's logits as float32 arithmetic: bf16/fp16 logits round a logit of 16-32 to a step of
    0.125 (bf16), which is then a log-prob's error; the head's own matmul is a small share of a
    step's work when it runs only at the loss's positions (`logits_to_keep`)."""
    import torch

    with torch.autocast(hidden.device.type, enabled=False):
        bias = None if head.bias is None else head.bias.float()
        return torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)


def install_float32_head(model: Any) -> Callable[[], None]:
    """Make the model's language-model head compute its logits in float32, whatever the autocast
    or the weights' dtype (bf16-mixed, FSDP's bf16 parameters); returns a function that undoes it.

    The head's module stays where it is (its state-dict keys, FSDP's and peft's hooks are
    unchanged): only its `forward` is replaced on the instance. A model with no linear head
    (`get_output_embeddings()` None, or not a torch Linear) is left alone, and the undo does
    nothing. In float32 runs the result is bitwise the same as the plain head's.
    """
    import torch

    head = output_head(model)
    if not isinstance(head, torch.nn.Linear) or "forward" in vars(head):
        return lambda: None
    head.forward = functools.partial(_head_in_float32, head)  # type: ignore[method-assign]

    def undo() -> None:
        vars(head).pop("forward", None)

    return undo


@contextlib.contextmanager
def float32_head(model: Any, enabled: bool = True) -> Iterator[None]:
    """The head in float32 (`enabled`) or as the model's own Linear (not), for the duration of a
    block, whatever it was before (benchmarks and tests compare both)."""
    head = output_head(model)
    installed = head is not None and "forward" in vars(head)
    saved = vars(head).pop("forward", None) if installed else None
    undo = install_float32_head(model) if enabled else (lambda: None)
    try:
        yield
    finally:
        undo()
        if saved is not None:
            head.forward = saved
