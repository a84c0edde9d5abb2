"""Lightning callbacks that tests add to real `rlver fit` runs to look inside every rank."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import lightning as L


class WeightDigest(L.Callback):
    """At the end of training, each rank writes a digest of every trainable tensor it holds.

    Args:
        out_dir: Folder for `digest_rank<R>.json` files.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        digests = {}
        for name, tensor in pl_module.state_dict().items():
            if hasattr(tensor, "full_tensor"):  # an FSDP2 shard (DTensor): the whole tensor
                tensor = tensor.full_tensor()
            data = tensor.detach().float().cpu().contiguous().numpy().tobytes()
            digests[name] = hashlib.sha256(data).hexdigest()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "rank": trainer.global_rank,
            "step": trainer.global_step,
            "tensors": digests,
            "metrics": sorted(trainer.callback_metrics),  # what this rank logged
        }
        path = self.out_dir / f"digest_rank{trainer.global_rank}.json"
        path.write_text(json.dumps(record, sort_keys=True))
