"""Process-independent hashing for seeds and draws (Python's hash() is salted per process)."""

from __future__ import annotations

import hashlib
import os


def stable_hash(*parts: object) -> int:
    """A 64-bit integer from `parts`, the same in every process and on every machine."""
    digest = hashlib.sha256("\x1f".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def run_seed(seed: int | None = None) -> int:
    """`seed` where a config pins it, else the run's seed: the one `--seed_everything` set
    (Lightning keeps it in PL_GLOBAL_SEED), else 0. The training order and the rollouts' sampling
    take theirs from here, so `--seed_everything N` alone changes every random choice of a run."""
    if seed is not None:
        return int(seed)
    return int(os.environ.get("PL_GLOBAL_SEED", "0"))
