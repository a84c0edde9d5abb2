"""vLLM's sleep mode on a CPU: the GPU path's order of sleeps, reloads and collectives, walked by tests.

On CPU vLLM never sleeps (sleep mode needs CUDA), so a CPU run of the vllm engine takes none of the
deferred reloads a GPU run takes. `StandInVLLMEngine` is rlver's own `VLLMEngine` (its sleep, sync,
reload and release code, unchanged) over `SleepingLLM`, which behaves as `vllm.LLM` with sleep mode
on a GPU does where it matters here:

- `sleep(level=2)` frees the weights: after a wake they are garbage (NaN here) until a reload;
  `sleep(level=1)` keeps them (vLLM's host copy);
- a generation with anything asleep, or with weights freed and never reloaded, fails loudly;
- a reload goes through `collective_rpc`, whose function consumes rlver's `inference_weights`
  stream: under FSDP that is `iter_full_weights`, an all-gather every rank must join.

Generation itself is transformers' on the engine's own copy of the weights (no collective), as
vLLM's is. Add `UseStandInVLLM` to a run's callbacks to use it whatever the config's engine is.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import torch
from rlver_plugins.hf_engine.engine import HFEngine
from rlver_plugins.vllm_engine.engine import VLLMEngine

from rlver import hookimpl
from rlver.core.interfaces import SamplingSettings
from rlver.modeling.models import Policy

NAME = "vllm_stand_in"


class SleepingLLM:
    """What `VLLMEngine` uses of `vllm.LLM`, with sleep mode's memory semantics, on a CPU."""

    def __init__(self, policy: Policy) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(policy.path, dtype=torch.float32).eval()
        self.model = model
        self.sampler = HFEngine(
            Policy(model=model, tokenizer=policy.tokenizer, path=policy.path, name="engine")
        )
        self.awake = {"weights", "kv_cache"}  # a new engine holds both
        self.weights_freed = False
        self.events: list[str] = []

    def sleep(self, level: int) -> None:
        if level == 2:  # the weights' memory is given back: nothing of them survives
            with torch.no_grad():
                for parameter in self.model.parameters():
                    parameter.fill_(float("nan"))
            self.weights_freed = True
        self.awake.clear()
        self.events.append(f"sleep {level}")

    def wake_up(self, tags: Sequence[str]) -> None:
        self.awake |= set(tags)
        self.events.append(f"wake {'+'.join(sorted(tags))}")

    def collective_rpc(self, function: Any) -> None:
        if "weights" not in self.awake:
            raise RuntimeError("stand-in vLLM: weights reloaded while asleep")
        function(SimpleNamespace(reload_weights=self._reload))
        self.events.append("reload")

    def _reload(self, weights_iterator: Any) -> None:
        expected = dict(self.model.named_parameters())
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights_iterator:
                if name in expected:
                    expected[name].copy_(tensor)
                    loaded.add(name)
        missing = set(expected) - loaded
        if missing:
            raise RuntimeError(f"stand-in vLLM: the reload left out {sorted(missing)[:3]}")
        self.weights_freed = False

    def reset_prefix_cache(self) -> None:
        pass

    def generate(self, prompts: Sequence[dict], params: Sequence[Any], use_tqdm: bool = False) -> list:
        """vLLM's call: `TokensPrompt`s and one `SamplingParams` per prompt (objects or dicts)."""
        if self.awake != {"weights", "kv_cache"}:
            asleep = sorted({"weights", "kv_cache"} - self.awake)
            raise RuntimeError(f"stand-in vLLM: generate with {asleep} asleep")
        if self.weights_freed:
            raise RuntimeError("stand-in vLLM: generate with weights freed by sleep(level=2), never reloaded")
        self.events.append("generate")
        first = _options(params[0])
        settings = SamplingSettings(
            max_new_tokens=first["max_tokens"],
            temperature=first["temperature"],
            top_p=first["top_p"],
            prompt_seeds=[_options(p)["seed"] for p in params],
        )
        generations = self.sampler.generate([list(p["prompt_token_ids"]) for p in prompts], settings)
        return [
            SimpleNamespace(
                outputs=[
                    SimpleNamespace(
                        token_ids=g.token_ids,
                        logprobs=[
                            {t: SimpleNamespace(logprob=lp)}
                            for t, lp in zip(g.token_ids, g.logprobs, strict=True)
                        ],
                    )
                ]
            )
            for g in generations
        ]


def _options(params: Any) -> dict[str, Any]:
    keys = ("max_tokens", "temperature", "top_p", "seed")
    return {k: params[k] for k in keys} if isinstance(params, dict) else {k: getattr(params, k) for k in keys}


class StandInVLLMEngine(VLLMEngine):
    """rlver's `VLLMEngine`, sleep mode on as on a GPU, over `SleepingLLM`."""

    def __init__(self, policy: Policy, sync_every_step: bool = True, **ignored: Any) -> None:
        self.policy = policy
        self.stop_ids = policy.stop_token_ids
        self.sync_every_step = sync_every_step
        self.tensor_parallel_size = 1
        self.sleep_between_rollouts = True
        self.weight_dtype = torch.float32
        self._thread, self._owner, self._compile_nothing = None, None, False
        self.llm = SleepingLLM(policy)
        self._asleep: set[str] = set()
        self._sync_pending = False
        self.weights_version = 0
        if "vllm" not in sys.modules:  # importing vLLM costs 15 s a process: its request types as dicts
            sys.modules["vllm"] = SimpleNamespace(SamplingParams=dict)  # type: ignore[assignment]
            sys.modules["vllm.inputs"] = SimpleNamespace(TokensPrompt=dict)  # type: ignore[assignment]


class _Plugin:
    @hookimpl
    def rlver_register_engines(self, register: Any) -> None:
        register(NAME, StandInVLLMEngine)


class UseStandInVLLM(L.Callback):
    """Makes a run's engine the stand-in, whatever its config names, and records what it held.

    Args:
        out_dir: Where each rank writes `engine_rank<R>.json`: the engine's state at every
            checkpoint write and checkpoint load, and its event list at the end.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.seen: dict[str, list[Any]] = {"saved_with": [], "loaded_with": []}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from rlver.core.plugins import get_registry

        registry = get_registry()
        if NAME not in registry.names("engines"):
            registry.add(_Plugin(), name="tests-stand-in-vllm")
        pl_module.component_specs["engine"] = {"name": NAME}  # before the module's setup builds it

    def _held(self, pl_module: L.LightningModule) -> list[str]:
        runner = getattr(pl_module, "runner", None)
        return sorted(runner.engine.llm.awake) if runner is not None else ["not built"]

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: Any) -> None:
        self.seen["saved_with"].append([trainer.global_step, self._held(pl_module)])
        self._write(trainer, pl_module)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: Any) -> None:
        self.seen["loaded_with"].append([checkpoint.get("global_step"), self._held(pl_module)])

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, pl_module)

    def _write(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        runner = getattr(pl_module, "runner", None)
        record = {**self.seen, "events": runner.engine.llm.events if runner is not None else []}
        path = self.out_dir / f"engine_rank{trainer.global_rank}.json"
        path.write_text(json.dumps(record))


def read_engine_records(out_dir: Path, ranks: int = 2) -> list[dict[str, Any]]:
    return [json.loads((out_dir / f"engine_rank{rank}.json").read_text()) for rank in range(ranks)]


__all__ = ["SleepingLLM", "StandInVLLMEngine", "UseStandInVLLM", "read_engine_records"]
