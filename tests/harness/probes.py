"""Lightning callbacks that tests add to real `rlver fit` runs to look inside every rank."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L


class WeightDigest(L.Callback):
    """At the end of training, each rank writes a digest of every trainable tensor it holds.

    Args:
        out_dir: Folder for `digest_rank<R>.json` files.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.initial = self._trained_policy_weights(pl_module)

    @staticmethod
    def _trained_policy_weights(pl_module: L.LightningModule) -> dict[str, Any]:
        """The policy's trained tensors, whole (a collective under FSDP: every rank calls it)."""
        from rlver.parallel.full_weights import full_state_dict
        from rlver.parallel.sharding import clean_name

        model = pl_module.policy_model
        trained = {clean_name(n) for n, p in model.named_parameters() if p.requires_grad}
        state = full_state_dict(model, cpu_offload=True)
        return {name: tensor.float().clone() for name, tensor in state.items() if name in trained}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        final = self._trained_policy_weights(pl_module)
        initial = getattr(self, "initial", {})
        changed = sum(int((final[n] != initial[n]).sum()) for n in initial)
        total = sum(t.numel() for t in initial.values())
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
            # the share of the policy's trained weights that training changed at all (bf16
            # master weights at lr 1e-6: about 2%; float32 ones: nearly all)
            "policy_changed_fraction": changed / total if total else None,
        }
        if trainer.global_rank != 0:
            # Written only after rank 0's and a moment later, so that a test reading every rank's
            # digest as soon as `rlver fit` returns checks that it returned after all its ranks.
            first = self.out_dir / "digest_rank0.json"
            deadline = time.monotonic() + 120
            while not first.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)
        path = self.out_dir / f"digest_rank{trainer.global_rank}.json"
        path.write_text(json.dumps(record, sort_keys=True))


class Chaos(L.Callback):
    """Kills its own process with SIGKILL at one point of one training step.

    The point comes from the environment, `RLVER_CHAOS=<point>:<step>` (unset: nothing happens),
    so one recipe serves every launch of a chaos test. Points:

    - generation: after the step's second engine call, mid-rollout;
    - update: after the step's first optimizer step, before the weight sync;
    - checkpoint: halfway through writing the checkpoint taken when `global_step` reaches `step`
      (its file, or a sharded checkpoint's meta.pt after the shards);
    - transcripts: after the step's first transcript line and half of the second.
    """

    POINTS = ("generation", "update", "checkpoint", "transcripts")

    def __init__(self) -> None:
        point, _, step = os.environ.get("RLVER_CHAOS", "").partition(":")
        if point and point not in self.POINTS:
            raise ValueError(f"RLVER_CHAOS point {point!r} is not one of {self.POINTS}")
        self.point, self.step = point, int(step or -1)

    @staticmethod
    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.point:
            return

        def now() -> bool:
            return trainer.global_step == self.step

        if self.point == "generation":
            engine = pl_module.runner.engine
            generate, calls = engine.generate, []

            def generate_then_die(*args, **kwargs):
                generated = generate(*args, **kwargs)
                if now():
                    calls.append(1)
                    if len(calls) == 2:
                        self.die()
                return generated

            engine.generate = generate_then_die
        elif self.point == "update":
            optimizer_step = pl_module.policy_update.optimizer_step

            def step_then_die(*args, **kwargs):
                optimizer_step(*args, **kwargs)
                if now():
                    self.die()

            pl_module.policy_update.optimizer_step = step_then_die
        elif self.point == "checkpoint":
            import torch

            save = torch.save

            def is_checkpoint(handle) -> bool:
                # rlver's temporary checkpoint file, or a sharded checkpoint's meta.pt; not the
                # in-memory buffers torch.distributed pickles objects through.
                name = (
                    str(handle) if isinstance(handle, str | os.PathLike) else str(getattr(handle, "name", ""))
                )
                return name.endswith((".tmp", "meta.pt"))

            def save_half_then_die(obj, handle, *args, **kwargs):
                if not now() or not is_checkpoint(handle):
                    return save(obj, handle, *args, **kwargs)
                buffer = io.BytesIO()
                save(obj, buffer, *args, **kwargs)
                data = buffer.getvalue()
                if isinstance(handle, str | os.PathLike):  # a sharded checkpoint's meta.pt
                    with open(handle, "wb") as file:
                        file.write(data[: len(data) // 2])
                else:
                    handle.write(data[: len(data) // 2])
                    handle.flush()
                self.die()

            torch.save = save_half_then_die
        else:
            append = pl_module.run_log.append_transcripts

            def append_torn_then_die(split, trajectories, step):
                if split != "train" or step != self.step:
                    return append(split, trajectories, step)
                append(split, trajectories[:1], step)
                path = Path(trainer.log_dir) / "rollouts" / f"train_rank{trainer.global_rank}.jsonl"
                line = json.dumps({"step": step, **trajectories[1].to_record()})
                with path.open("a") as handle:
                    handle.write(line[: len(line) // 2])
                self.die()

            pl_module.run_log.append_transcripts = append_torn_then_die


class SignalOneRank(L.Callback):
    """Sends SIGTERM to one rank's own process during one step's rollout, as a preemption that
    reached one node first does.

    Args:
        rank: The global rank that gets the signal.
        step: The `global_step` at whose rollout it arrives.
        at: "turn 0": before the rollout's first turn (the rank stops before it generates);
            "mid-rollout": after the rank's first generation of the step.
    """

    def __init__(self, rank: int, step: int, at: str) -> None:
        if at not in ("turn 0", "mid-rollout"):
            raise ValueError(f"SignalOneRank at={at!r}")
        self.rank, self.step, self.at = rank, step, at

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank != self.rank:
            return
        runner = pl_module.runner

        def now() -> bool:
            return trainer.global_step == self.step and trainer.training

        if self.at == "turn 0":
            run = runner.run

            def signal_then_run(*args, **kwargs):
                if now():
                    os.kill(os.getpid(), signal.SIGTERM)
                return run(*args, **kwargs)

            runner.run = signal_then_run
        else:
            generate = runner.engine.generate

            def generate_then_signal(*args, **kwargs):
                generated = generate(*args, **kwargs)
                if now():
                    os.kill(os.getpid(), signal.SIGTERM)
                return generated

            runner.engine.generate = generate_then_signal


def digest_local_part(part: dict[str, Any]) -> dict[str, str]:
    """A `rlver.checkpoint.local_shards.local_state` part, every tensor and value digested by path."""
    import torch

    digests: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, list | tuple) and any(isinstance(item, torch.Tensor | dict) for item in value):
            for index, item in enumerate(value):
                walk(f"{prefix}/{index}", item)
        elif isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            digests[prefix] = f"{value.dtype}:{list(value.shape)}:{hashlib.sha256(data).hexdigest()}"
        else:
            digests[prefix] = repr(value)

    walk("", part)
    return digests


class LocalStateDigest(L.Callback):
    """Each rank's own shards and optimizer states, digested at the end of step `step` and at the
    start of a run resumed at that step: what the hang watchdog's FSDP checkpoint holds and gives back.

    Args:
        out_dir: Folder for `local_rank<R>_<when>.json`, when "finished" or "restored".
        step: The `global_step` looked at.
    """

    def __init__(self, out_dir: str, step: int) -> None:
        self.out_dir, self.step = Path(out_dir), step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            self._write(trainer, pl_module, "finished")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.step:
            self._write(trainer, pl_module, "restored")

    def _write(self, trainer: L.Trainer, pl_module: L.LightningModule, when: str) -> None:
        from rlver.checkpoint.local_shards import local_state

        part = local_state(pl_module, trainer.strategy.optimizers, trainer.global_rank, trainer.world_size)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"local_rank{trainer.global_rank}_{when}.json"
        path.write_text(json.dumps(digest_local_part(part), sort_keys=True))
