"""What a run prints: rlver's own one-line notes, and library chatter only when asked for.

By default vLLM's, transformers' and Lightning's informational logging, their progress bars
for weight loading, and the known harmless warnings they raise at every start or weight sync
are silenced; what remains is the training progress bar, one `rlver:` line per phase, and
warnings that mean something is wrong. `rlver --verbose ...` (anywhere on the command line)
or RLVER_VERBOSE=1 shows everything.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

VERBOSE_ENV = "RLVER_VERBOSE"
VERBOSE_FLAG = "--verbose"

# Loggers whose INFO lines are chatter for a user of rlver; their warnings and errors stay.
_INFO_LOGGERS = ("lightning.pytorch", "lightning.fabric", "httpx", "filelock")

# Warnings that libraries raise on every healthy run (text as the library words it).
_HARMLESS_WARNINGS = (
    # rlver optimizes manually; Lightning's advice about checkpoint frequency does not apply.
    r"Using ModelCheckpoint with manual optimization and every_n_train_steps.*",
    r".*is not supported by the model summary.*",
    r".*`isinstance\(treespec, LeafSpec\)` is deprecated.*",
    r".*`torch.distributed.reduce_op` is deprecated.*",
    r".*does not have many workers which may be a bottleneck.*",
    r".*The number of training batches \(\d+\) is smaller than the logging interval.*",
    r".*Checkpoint directory .* exists and is not empty.*",
    r".*`resume_download` is deprecated.*",
    r".*overridden `transfer_batch_to_device` in `LightningModule`.*",
)


def is_verbose() -> bool:
    if VERBOSE_FLAG in sys.argv[1:] and _invoked_as_rlver():  # before main() takes the flag out
        return True
    return verbose_in(os.environ)


def verbose_in(environment: Mapping[str, str]) -> bool:
    """Whether RLVER_VERBOSE in `environment` asks for the libraries' own output."""
    return environment.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _invoked_as_rlver() -> bool:
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    return program == "rlver" or sys.argv[0].endswith(os.path.join("rlver", "cli.py"))


def take_verbose_flag(argv: list[str]) -> list[str]:
    """`argv` without --verbose; the flag sets RLVER_VERBOSE for this process and its children."""
    if VERBOSE_FLAG in argv:
        os.environ[VERBOSE_ENV] = "1"
        argv = [arg for arg in argv if arg != VERBOSE_FLAG]
    return argv


# What quiet_libraries sets where the user set nothing.
QUIET_ENVIRONMENT = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10 notes such as vLLM's NUMA binding
    "TOKENIZERS_PARALLELISM": "false",
}


def quiet_libraries() -> None:
    """Silence library chatter unless verbose. Call before torch, vLLM or transformers load
    (rlver.cli does so on import): torch's C++ logging reads its level once, at load.

    Environment variables (rather than logger levels) reach the libraries' own subprocesses
    too; a value the user set is kept. Idempotent.
    """
    if is_verbose():
        return
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    for name in _INFO_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    # vLLM sets its level from VLLM_LOGGING_LEVEL when its logger module loads; some of its
    # modules warn before that (e.g. about Triton on CPU), through Python's last-resort handler.
    logging.getLogger("vllm").setLevel(logging.ERROR)
    for pattern in _HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    try:  # transformers reads its env var when first imported; an earlier import needs telling
        if "transformers" in sys.modules:
            from transformers.utils import logging as transformers_logging

            transformers_logging.set_verbosity_error()
            transformers_logging.disable_progress_bar()
    except ImportError:
        pass


def _global_rank() -> int:
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if name in os.environ:
            try:
                return int(os.environ[name])
            except ValueError:
                pass
    return 0


_phase_line_open = False


def note(message: str) -> None:
    """One line of rlver's own, printed by rank 0 only."""
    global _phase_line_open
    if _global_rank() != 0:
        return
    if _phase_line_open:  # a note inside a phase: finish the phase's line first
        print(flush=True)
        _phase_line_open = False
    print(f"rlver: {message}", flush=True)


@contextmanager
def phase(message: str) -> Iterator[None]:
    """`rlver: <message> ...` then `done in N s` on the same line (one line per phase)."""
    global _phase_line_open
    if _global_rank() != 0:
        yield
        return
    print(f"rlver: {message} ...", end="", flush=True)
    _phase_line_open = True
    started = time.perf_counter()
    try:
        yield
    except BaseException:
        _end_phase("failed")
        raise
    _end_phase(f"done in {time.perf_counter() - started:.0f} s")


def _end_phase(outcome: str) -> None:
    global _phase_line_open
    print(f" {outcome}" if _phase_line_open else f"rlver: ... {outcome}", flush=True)
    _phase_line_open = False
