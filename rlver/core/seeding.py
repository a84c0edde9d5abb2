"""Process-independent hashing for seeds and draws (Python's hash() is salted per process)."""

from __future__ import annotations

import hashlib


def stable_hash(*parts: object) -> int:
    """A 64-bit integer from `parts`, the same in every process and on every machine."""
    digest = hashlib.sha256("\x1f".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big")
