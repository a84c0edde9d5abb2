"""The critic: a transformer backbone with a scalar value head."""

from __future__ import annotations

import torch
from torch import nn


class ValueModel(nn.Module):
    """V(s_t) for every position: the value of the state *before* token t.

    The backbone is the base model of a causal LM (no LM head), initialised from
    the policy's weights or a given folder; the head is a fresh linear layer.
    """

    def __init__(
        self, path: str, dtype: torch.dtype = torch.float32, head_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        from transformers import AutoModel

        self.backbone = AutoModel.from_pretrained(path, dtype=dtype)
        hidden = self.backbone.config.hidden_size
        # float32 by default: under LoRA the backbone stays in bf16 but the head trains in full, and
        # a bf16 head would round its updates away (mixed precision still computes it in bf16).
        # FSDP1 needs one dtype per unit: with low-precision weights allowed, the backbone's dtype.
        self.value_head = nn.Linear(hidden, 1, dtype=head_dtype or torch.float32)
        # A small head keeps early values near 0 so the first updates are not dominated by critic noise.
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden + 1))
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(S, L) values; values[:, t] is computed from the hidden state at t - 1 (0 at t = 0)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()
        return torch.nn.functional.pad(values[:, :-1], (1, 0))

    def gradient_checkpointing_enable(self) -> None:
        self.backbone.gradient_checkpointing_enable()
