"""The Trainer `rlver fit/validate/test` build: Lightning's, with `precision: auto`."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from rlver.precision import resolve_precision


class Trainer(L.Trainer):
    """Lightning's Trainer; every option is Lightning's.

    Args:
        precision: As Lightning's, plus "auto": bf16-mixed where the device computes bfloat16
            natively (CUDA with bf16, CPUs with AVX512-BF16, AMX or ARM BF16), 32-true elsewhere.
            One line at start says what was chosen and why.
    """

    def __init__(self, *args: Any, precision: str | int | None = "auto", **kwargs: Any) -> None:
        precision, reason = resolve_precision(precision, kwargs.get("accelerator", "auto"))
        if reason:
            rank_zero_info(f"rlver: {reason}")
        super().__init__(*args, precision=precision, **kwargs)
