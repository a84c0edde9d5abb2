"""Pieces of tests/gpu/gpu_check.py: random models of shipped architectures, a word-level tokenizer,
and the Lightning callback that measures a real `rlver fit` step from the inside.

Nothing here downloads anything: the architectures are rlver's shipped config.json files
(`rlver/data/architectures/`), the weights are random, and the tokenizer is built in memory.
The callback is loaded by `rlver fit` through its class path (`gpu_check_parts.PhaseProbe`), with
this folder on PYTHONPATH.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path
from typing import Any

import lightning as L
import torch

GIB = 2**30
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Log-prob gaps are reported per range of token positions in the sequence: RoPE's precision
# matters at long context, where a bf16 `inv_freq` drifts from the engine's.
POSITION_BUCKETS = ((0, 512), (512, 2048), (2048, None))
PHASES = ("rollout", "scoring", "update", "sync", "checkpoint")


# ---------------------------------------------------------------------------------- model folders
def word_tokenizer(vocab_size: int) -> Any:
    """A word-level chat tokenizer whose ids fill the whole vocabulary: words `w0`, `w1`, ...

    Every id a random model samples decodes to a word that encodes back to the same id, so
    rollouts keep their exact ids across turns as with a real tokenizer. The ChatML markers and
    the end-of-text token take the last ids; text outside the vocabulary becomes `[UNK]`.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = vocab_size - len(SPECIAL_TOKENS)
    vocab = {f"w{i}": i for i in range(words)}
    vocab.update({token: words + i for i, token in enumerate(SPECIAL_TOKENS)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.add_special_tokens(list(SPECIAL_TOKENS[:3]))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="[UNK]"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def architecture_config(name: str, **overrides: Any) -> dict[str, Any]:
    """A shipped config.json (`rlver/data/architectures/<name>.json`) with `overrides` applied."""
    text = resources.files("rlver.data").joinpath("architectures", f"{name}.json").read_text()
    config = json.loads(text)
    config.update(overrides)
    return config


def build_model_folder(folder: Path, config: dict[str, Any], device: str) -> Path:
    """A Hugging Face folder with random weights of `config` (saved in bf16) and a word tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = int(config["vocab_size"])
    ids = {token: vocab - len(SPECIAL_TOKENS) + i for i, token in enumerate(SPECIAL_TOKENS)}
    config = {
        **config,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    model_config = AutoConfig.for_model(**config)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    # Published checkpoints are bf16 too; `model.dtype: float32` upcasts them when loading.
    model.to(torch.bfloat16).save_pretrained(folder)
    word_tokenizer(vocab).save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------------- the probe
def _cuda() -> bool:
    return torch.cuda.is_available()


def _trainable_names(module: torch.nn.Module) -> list[str]:
    from rlver.parallel.sharding import clean_name

    return [clean_name(name) for name, p in module.named_parameters() if p.requires_grad]


def _full_weights(module: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The trained parameters, whole and on the CPU (a copy), by their Hugging Face names."""
    from rlver.parallel.full_weights import full_state_dict

    state = full_state_dict(module, cpu_offload=True)
    return {name: state[name].detach().to("cpu", copy=True) for name in names}


def _gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients left by the step's last backward (one process: the whole tensors)."""
    from rlver.parallel.sharding import clean_name

    return {
        clean_name(name): p.grad.detach().cpu()
        for name, p in module.named_parameters()
        if p.requires_grad and p.grad is not None
    }


def bucket_gaps(
    trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, dict[str, float] | None]:
    """Max and mean |trainer - engine| log-prob per position bucket (None: no sampled token there).

    Shapes (S, L), right-padded, so the column is the token's position in its sequence.
    """
    gap = (trainer_logprobs.float() - engine_logprobs.float()).abs()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    out: dict[str, dict[str, float] | None] = {}
    for start, end in POSITION_BUCKETS:
        label = f"{start}-{end - 1}" if end is not None else f"{start}+"
        inside = mask.bool() & (positions >= start)
        if end is not None:
            inside &= positions < end
        if not inside.any():
            out[label] = None
            continue
        values = gap[inside]
        out[label] = {"max": values.max().item(), "mean": values.mean().item(), "tokens": int(inside.sum())}
    return out


TIE_BREAK = "check_tie_break"


def tie_breaking_reward(trajectories: Any) -> list[float]:
    """Each dialogue's position in the batch, so no two dialogues of a group score alike."""
    return [float(position) for position in range(len(trajectories))]


class PhaseProbe(L.Callback):
    """Measures the first training step of a real `rlver fit` and writes `<out>` (JSON).

    - weights: the policy's trained parameters, whole, before and after the step: the fraction
      that changed (of those with a nonzero gradient, and of all of them);
    - the dtype of every RoPE `inv_freq` buffer after the step's forwards;
    - the gap between the engine's and the trainer's log-probs of the sampled tokens, per
      position bucket (from the batch the trainer scored);
    - per phase (rollout, scoring, update, sync, checkpoint): seconds, and on CUDA the peak
      `torch.cuda.max_memory_allocated` (reset at the phase's start) and what was allocated
      at its start; `resident`: allocated after the step (weights, gradients, AdamW states).

    With `tie_break`, the step's rewards get each dialogue's position in the batch added (0, 1,
    2, ...): a random model's replies often leave the rubric's emotions equal across a GRPO group,
    and then every advantage is 0 and only the entropy term moves the weights, which is not the
    update the check means to measure. The added term makes every group's rewards differ.

    Args:
        out: The JSON file to write (rewritten as results come in, so a crash keeps what was measured).
        tie_break: Add the dialogue's position to its reward (see above).
    """

    def __init__(self, out: str, tie_break: bool = False) -> None:
        self.out = Path(out)
        self.tie_break = tie_break
        self.record: dict[str, Any] = {"phases": {}, "done": False}
        self._before: dict[str, torch.Tensor] | None = None
        self._wrapped = False

    def _write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.record, indent=2))

    def _measured(self, phase: str, function: Any) -> Any:
        """`function`, measured the first time it runs (later calls pass straight through)."""

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if phase in self.record["phases"]:
                return function(*args, **kwargs)
            entry: dict[str, Any] = {}
            if _cuda():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                entry["start_gib"] = torch.cuda.memory_allocated() / GIB
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if _cuda():
                    torch.cuda.synchronize()
                    entry["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
                entry["seconds"] = time.perf_counter() - started
                self.record["phases"][phase] = entry
                self._write()

        return wrapped

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if _cuda():
            self.record["gpu"] = torch.cuda.get_device_name()
            self.record["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / GIB
        self.record["precision"] = str(trainer.precision)
        self.record["strategy"] = type(trainer.strategy).__name__
        self._write()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._wrapped:
            return
        self._wrapped = True
        names = _trainable_names(pl_module.policy_model)
        self._before = _full_weights(pl_module.policy_model, names)
        if self.tie_break:
            pl_module.reward_functions = [*pl_module.reward_functions, (TIE_BREAK, 1.0, tie_breaking_reward)]
        runner = pl_module.runner
        runner.run = self._measured("rollout", runner.run)
        runner.engine.sync_weights = self._measured("sync", runner.engine.sync_weights)
        update = self._measured("update", pl_module.policy_update.update)
        score = self._measured("scoring", pl_module.policy_update.score_tokens)

        def compare(logprobs: torch.Tensor, batch: Any) -> None:
            if "logprob_gap" not in self.record:
                self.record["logprob_gap"] = bucket_gaps(logprobs, batch.engine_logprobs, batch.loss_mask)
                self.record["sequence_tokens"] = int(batch.attention_mask.sum(dim=1).max())

        # The trainer's log-probs of the sampled tokens come from scoring, or, when the update is
        # one step from the sampling policy, from the update's own forward (`logprobs_out`).
        def score_and_compare(batch: Any, *args: Any, **kwargs: Any) -> Any:
            scored = score(batch, *args, **kwargs)
            if scored[0] is not None:
                compare(scored[0], batch)
            return scored

        def update_and_compare(batch: Any, *args: Any, **kwargs: Any) -> Any:
            metrics = update(batch, *args, **kwargs)
            if kwargs.get("logprobs_out") is not None:
                compare(kwargs["logprobs_out"], batch)
            return metrics

        pl_module.policy_update.score_tokens = score_and_compare
        pl_module.policy_update.update = update_and_compare
        trainer.save_checkpoint = self._measured("checkpoint", trainer.save_checkpoint)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._before is None:
            return
        if _cuda():
            torch.cuda.synchronize()
            self.record["resident_gib"] = torch.cuda.memory_allocated() / GIB
        policy = pl_module.policy_model
        gradients = _gradients(policy)
        after = _full_weights(policy, list(self._before))
        changed = total = changed_with_grad = with_grad = 0
        for name, before in self._before.items():
            moved = after[name] != before
            changed += int(moved.sum())
            total += moved.numel()
            grad = gradients.get(name)
            if grad is not None and grad.shape == moved.shape:
                nonzero = grad != 0
                with_grad += int(nonzero.sum())
                changed_with_grad += int((moved & nonzero).sum())
        self.record["weights"] = {
            "trained": total,
            "changed": changed,
            "with_gradient": with_grad,
            "changed_with_gradient": changed_with_grad,
            "gradients_seen": len(gradients),
        }
        self.record["inv_freq_dtypes"] = sorted(
            {str(buffer.dtype) for name, buffer in policy.named_buffers() if name.endswith("inv_freq")}
        )
        metrics = trainer.callback_metrics
        self.record["metrics"] = {
            name: float(metrics[name])
            for name in ("rollout/logprob_gap", "ppo/actor_lr", "perf/step_seconds", "rollout/reply_tokens")
            if name in metrics
        }
        self._before = None
        self._write()

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.record["done"] = True
        self._write()


# ---------------------------------------------------------------------------------- vLLM
VLLM_PROMPTS = ["w1 w2 w3 w4", "w10 w20 w30", "w7 w8 w9 w10 w11 w12", "w100 w200"]


def vllm_worker(model: str, out: Path) -> int:
    """In its own process: engine start, generate, sleep, sync (reloaded at the next generation),
    generate, a sync while awake, generate; then a sync that must change the outputs."""
    from rlver_plugins.vllm_engine.engine import VLLMEngine

    from rlver.core.interfaces import SamplingSettings
    from rlver.modeling.models import load_policy

    result: dict = {}

    cuda = _cuda()

    def free_gib() -> float:
        return torch.cuda.mem_get_info()[0] / 2**30 if cuda else float("nan")

    def timed(label: str, function):
        started = time.perf_counter()
        value = function()
        if cuda:
            torch.cuda.synchronize()
        result[f"{label}_s"] = time.perf_counter() - started
        return value

    policy = load_policy(model, dtype="float32", device="cuda" if cuda else "cpu")
    options: dict[str, Any] = {"gpu_memory_utilization": 0.3, "sleep_between_rollouts": True}
    # Without CUDA (a check of this code on vLLM's CPU build): sleep and wake do nothing.
    options.update({"max_model_len": 4096} if cuda else {"dtype": "float32", "cpu_kv_cache_gib": 1})
    engine = timed("engine_start", lambda: VLLMEngine(policy, **options))
    tokenizer = policy.tokenizer
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )["input_ids"]
        for text in VLLM_PROMPTS
    ]
    greedy = SamplingSettings(max_new_tokens=64, temperature=0.0)

    def ids(generations) -> list[list[int]]:
        return [list(g.token_ids) for g in generations]

    first = ids(timed("generate_1", lambda: engine.generate(prompts, greedy)))
    result["free_gib_before_sleep"] = free_gib()
    timed("sleep", engine.release_memory)
    result["free_gib_asleep"] = free_gib()
    # Level 2 dropped the weights: what the engine holds after waking is freed memory until a
    # reload. The sync asked for now waits for the generation, which wakes the weights, streams
    # the policy in, then wakes the KV cache (issue 42): compare only after that reload.
    engine.sync_weights()
    result["free_gib_asleep_after_sync"] = free_gib()  # nothing reloaded yet: still asleep
    second = ids(timed("wake", lambda: engine.generate(prompts, greedy)))
    # A sync asked for while awake: the engine sleeps first, then reloads before the next generation.
    timed("sync_weights", engine.sync_weights)
    third = ids(timed("generate_3", lambda: engine.generate(prompts, greedy)))
    # A sync must move weights: negated embeddings (exactly undone below) change the outputs.
    embeddings = policy.model.get_input_embeddings().weight
    with torch.no_grad():
        embeddings.neg_()
    engine.sync_weights()
    changed = ids(engine.generate(prompts, greedy))
    with torch.no_grad():
        embeddings.neg_()
    engine.sync_weights()
    restored = ids(engine.generate(prompts, greedy))
    result["identical_after_sleep"] = first == second
    result["identical_after_sync"] = first == third == restored
    result["changed_by_sync"] = changed != first
    out.write_text(json.dumps(result, indent=2))
    return 0 if first == second == third == restored and changed != first else 1


def vllm_check(model: Path, workdir: Path, timeout: float, run_logged: Any) -> tuple[str, bool]:
    """One report line (and whether it passed); skipped where vLLM or CUDA is missing.

    The engine runs in a process of its own (`gpu_check.py --vllm-worker`) run by `run_logged`.
    """
    import importlib.util
    import sys

    if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
        reason = "vLLM is not installed" if importlib.util.find_spec("vllm") is None else "no CUDA"
        return f"- vLLM check: skipped ({reason}): sleep/wake and the streamed weight sync were not run", True
    out, log = workdir / "vllm_check.json", workdir / "vllm_check.log"
    script = Path(__file__).resolve().parent / "gpu_check.py"
    cmd = [sys.executable, str(script), "--vllm-worker", str(out), "--model", str(model)]
    code, seconds = run_logged(cmd, log, timeout, smoke=False)
    if not out.exists():
        why = "timed out" if code is None else f"exit {code}"
        ending = log.read_text(errors="replace")[-3000:]
        return (
            f"- vLLM check FAILED ({why} after {seconds:.0f} s; log {log}):\n\n```\n{ending}\n```",
            False,
        )
    r = json.loads(out.read_text())
    ok = r["identical_after_sleep"] and r["identical_after_sync"] and r["changed_by_sync"]
    free = f"free GiB {r['free_gib_before_sleep']:.1f} -> {r['free_gib_asleep']:.1f}"
    line = (
        f"- vLLM check ({model.name}): {'OK' if ok else 'FAILED'}: start {r['engine_start_s']:.1f} s, "
        f"sleep level 2 {r['sleep_s']:.2f} s ({free}), wake + reload + generation {r['wake_s']:.2f} s, "
        "streamed sync "
        f"{r['sync_weights_s']:.2f} s; greedy outputs identical after sleep/wake: "
        f"{r['identical_after_sleep']}, after syncs of the same weights: {r['identical_after_sync']}; "
        f"changed by a sync of changed weights: {r['changed_by_sync']}"
    )
    return line, ok
