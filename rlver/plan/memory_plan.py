"""GPU memory of each phase of an RL training step, per GPU, before a job reaches a queue.

`rlver plan --config FILE` prints it; `rlver fit` runs the same check on CUDA before loading any
weights (`check_fits`). Sizes are bytes (GiB = 2**30) from the model's config.json and the recipe:

Notation: P policy parameters, C critic parameters (backbone + value head), D one decoder layer,
R the root FSDP unit of a model (everything outside the decoder layers: embeddings, final norm,
LM head or value head: R = P - layers x D), m bytes of a master weight (`model.dtype`), c of a
computed one (2 under bf16/16 precision, else m), e of the engine's weights (bf16 unless the
engine's dtype is float32), N the GPUs a model is sharded over (FSDP FULL_SHARD: the world;
HYBRID_SHARD: one node; any other strategy: 1, whole on every GPU), S `ppo.micro_batch_size`,
L `rollout.max_context_tokens` (every micro-batch padded to it: an upper bound), V the vocabulary,
h hidden size, I MLP width, k the key/value width (kv heads x head dim), T the GPU's memory.

- trainer resident (all the time, so also while vLLM runs): trained models (policy, and the critic
  under `advantage: gae`) hold weights, gradients and AdamW's two states, all in m (gradients
  stay allocated between steps): (P + C) x 4m / N. LoRA (`model.lora`): frozen bases
  (P + C) x m / N, adapters A (rank x (in + out) per targeted layer, rlver.modeling.lora's targets) and the
  value head float32 with Adam: (A_policy + A_critic + h + 1) x 16 / N.
  `ppo.kl_coef > 0` (no LoRA) adds the frozen reference, whole on every GPU: P x m. Plus 1 GiB
  CUDA context and allocator.
- engine idle (asleep): vLLM colocated, one engine per rank. With `sleep_between_rollouts` it
  sleeps at level 2 during the update (weights and KV cache freed): 1 GiB left (its allocator and
  context); without, it keeps gpu_memory_utilization x T.
- engine awake: gpu_memory_utilization x T (weights P x e, then activations and KV cache); the
  KV cache must hold one whole sequence of vLLM's max_model_len (2 x layers x k x e bytes a
  token; `engine.max_model_len`, else the model's max_position_embeddings, else L): vLLM
  refuses to start otherwise.
- rollout: resident + engine awake. vLLM starts only with gpu_memory_utilization x T free, so the
  resident state must fit in (1 - utilization) x T: the same inequality. Engines that sample from
  the training module (`hf`): resident + the gathered policy P x m (when sharded) + its KV cache
  for `data.batch_size x group_size` sequences of L tokens. vLLM on CPU (`accelerator: cpu`):
  weights plus `cpu_kv_cache_gib`, never asleep; the sizes are then host memory.
- scoring (old log-probs and values, no grad, per micro-batch): resident + engine asleep +
  gathered units in c: the roots of the policy and critic (FSDP1 keeps a root's parameters
  gathered after its forward) and one decoder layer; the live hidden states of one layer
  S x L x (2h + 3I) x c; the logits S x L x V x 4 (the head computes in float32 whatever c:
  rlver.modeling.precision.install_float32_head), with c < 4 the head's weight copied to float32
  (V x h x 4), and one chunk's temperature-scaled copy and log-softmax temporary (B x V x 4
  each, B = min(S x L, 1,024) rows: rlver.modeling.batch.in_vocab_chunks).
- update (one micro-batch, at the start of the backward): resident + engine asleep + gathered
  roots and two decoder layers in c (the one in backward and the prefetched next) + activations
  of the policy and the critic (one backward for both): with `gradient_checkpointing` each layer's
  input S x L x h x c per layer and model plus one recomputed layer S x L x (8h + c(6h + 3k + 4I))
  (float32 RMSNorm inputs, q/k/v before and after RoPE, attention output, MLP gate/up/act/product),
  without it that layer size x layers x models; the logits S x L x V x 4 and their gradient (in
  float32), the head's float32 weight copy (V x h x 4, with c < 4), and one chunk recomputed in
  the backward: its tempered copy, log-softmax temporary and gradient (B x V x 4 each), with
  `entropy_coef > 0` the entropy's float32 log-probs and probabilities (B x V x 4 each); the
  head counted at every position (the loss reads fewer: an upper bound); the unsharded c
  gradients of the
  largest unit (the policy's root) before their reduce-scatter, and their float32 copy (the
  reduce-scatter runs in float32, rlver.parallel.sharding.full_precision_reductions: R x 4 when
  c < 4).
- sync (weights into the engine, before the KV cache wakes: a sync asked for while the engine is
  awake puts it to sleep first, and one asked for while it sleeps waits for the next generation;
  plugins/vllm_engine): resident + the engine's weights awake alone (P x e) + one unit
  streamed: the largest unit gathered in m (summon_full_params gives master weights) and its cast
  copy in e + vLLM's reload copy of its largest module (it materialises one module at a time
  before copying into the live weights: V x h x e, the embeddings or LM head). Unsharded full
  fine-tuning streams the parameters themselves (one layer's cast copies, D x e); unsharded LoRA
  merges one layer's targeted weights at a time (x m). At train start the engine already holds the weights
  it loaded from disk: no sync, unless a checkpoint was restored.
- checkpoint (after the step's sync was deferred: the engine asleep): resident + engine asleep +
  the larger of Lightning's two dumps, which run one after the other: FSDP1's model state dict,
  sharded or full, unshards every unit in full precision (m, whatever the mixed precision), the
  root for the whole traversal and one decoder layer at a time inside it: (R + D) x m, the larger
  root of policy and critic (LoRA's frozen base too); then the optimizer state dict:
  `state_dict_type: sharded` still all-gathers each unit's flat AdamW state into one buffer (R x m,
  reused for both states) before re-sharding it; `full` gathers one unit at a time (its parameters
  and two Adam states: 3 x R x m). With `sharded` the model's dump is the larger by one layer.
  NO_SHARD (one GPU) gathers nothing; LoRA's optimizer states are too small to count.

Not counted: FSDP padding, NCCL buffers, fragmentation, autocast's cached casts of unsharded
float32 weights, CUDA graphs beyond vLLM's budget, LoRA dropout copies.

T is what torch reports as the GPU's total memory: 79.3 GiB on an "80 GB" card (`rlver plan`'s
default off a GPU), not 80.

Worked example, recipes/ppo_think.yaml (float32 weights, 32 GPUs of 79.3 GiB; tests/recipes/test_plan.py
derives every figure): resident (7.62 + 7.07) B x 16 / 32 + 1 GiB = 7.8 GiB; engine awake 0.55 x
79.3 = 43.6 (its KV cache must hold one 32,768-token sequence: 1.75 GiB); rollout 51.5; scoring
26.7 (logits 2 x 8192 x 152064 x 4 B + the head's float32 copy 152064 x 3584 x 4 B + 1024 x
152064 x 8 B = 12.5); update 51.9 (logits, their gradient, the head copy and one chunk 23.5,
checkpointed activations 9.6, gathered 3.9, unsharded bf16 grads of the root 2.0 and their float32
copy 4.1); sync 29.1 (engine weights 14.2, the root streamed in float32 + bf16 6.1, vLLM's reload
copy 1.0); checkpoint 13.8 (the model state dict's root and one layer unsharded in float32, 4.06 +
0.87 = 4.9, above the optimizer-state gather of the root, 4.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlver.modeling.batch import VOCAB_ROWS_PER_CHUNK
from rlver.plan.architectures import Architecture, resolve_architecture
from rlver.plan.training_shape import GIB, TrainingShape, shape_from_recipe, shape_from_run

CUDA_CONTEXT = 1 * GIB  # the trainer's CUDA context and caching allocator
EIGHTY_GB_CARD_GIB = 79.3  # torch's total_memory of an "80 GB" GPU, in GiB
ENGINE_ASLEEP = 1 * GIB  # what a level-2 sleeping vLLM keeps

_FIX_ENGINE_SHARE = "--model.engine.gpu_memory_utilization"
_FIX_MICRO = "--model.ppo.micro_batch_size"
_FIX_CONTEXT = "--model.rollout.max_context_tokens"
_FIX_GPUS = "--trainer.num_nodes / --trainer.devices"
_FIX_SLEEP = "--model.engine.sleep_between_rollouts"
_FIX_STATE_DICT = "--trainer.strategy.init_args.state_dict_type sharded"


@dataclass(frozen=True)
class Phase:
    """One phase's memory per GPU: its parts (label, bytes), and the check it must pass."""

    name: str
    parts: tuple[tuple[str, float], ...]
    limit: float  # bytes available
    fixes: tuple[str, ...]
    required: float | None = None  # bytes the check compares with `limit`; None: the total
    note: str = ""

    @property
    def total(self) -> float:
        return sum(size for _, size in self.parts)

    @property
    def shortfall(self) -> float:
        """Bytes over the limit (<= 0: fits)."""
        return (self.total if self.required is None else self.required) - self.limit


def plan_memory(arch: Architecture, shape: TrainingShape) -> list[Phase]:
    """The phases of one training step on one GPU (see the module docstring for the model)."""
    s = shape
    memory = s.gpu_memory_gib * GIB
    sharded = s.shard_count > 1
    policy = arch.parameter_count()
    critic = arch.critic_parameter_count() if s.critic else 0
    layer, layers = arch.decoder_layer_parameters(), arch.num_layers
    policy_root = policy - layers * layer
    critic_root = critic - layers * layer if s.critic else 0
    tokens = s.micro_batch_size * s.context_tokens
    h, width, k = arch.hidden_size, arch.intermediate_size, arch.kv_width
    c, m = s.compute_bytes, s.master_bytes
    trained = "policy + critic" if s.critic else "policy"

    if s.lora_rank is None:
        resident_parts = [
            (f"{trained} ({4 * m} B/param / {s.shard_count})", (policy + critic) * 4 * m / s.shard_count)
        ]
    else:
        adapters = arch.lora_parameters(s.lora_rank, s.lora_targets) * (2 if s.critic else 1)
        head = (h + 1) if s.critic else 0  # the critic's value head trains in full
        resident_parts = [
            (f"frozen {trained}", (policy + critic - head) * m / s.shard_count),
            ("adapters + AdamW", (adapters + head) * 16 / s.shard_count),
        ]
    if s.reference:
        resident_parts.append(("reference", policy * m))
    if s.overlap and s.engine != "vllm":  # rlver.rollout.overlap: a snapshot for an engine without weights
        resident_parts.append(("policy snapshot (overlap)", policy * m))
    resident_parts.append(("CUDA context", CUDA_CONTEXT))
    resident = sum(size for _, size in resident_parts)
    resident_fixes = (_FIX_GPUS,) if s.lora_rank is not None else (_FIX_GPUS, "--model.lora")
    phases = [Phase("trainer resident", tuple(resident_parts), memory, resident_fixes)]

    engine_weights = policy * s.engine_bytes
    own_weights = s.engine == "vllm"  # other engines sample from the training module itself
    if own_weights and s.engine_on_gpu:
        awake = s.gpu_memory_utilization * memory
        asleep = ENGINE_ASLEEP if s.sleep_between_rollouts else awake
        # vLLM refuses to start unless its KV cache holds one max_model_len sequence (the
        # model's max_position_embeddings when the recipe leaves it unset), not max_context_tokens
        engine_context = s.engine_max_model_len or arch.max_positions or s.context_tokens
        one_sequence = 2 * layers * k * s.engine_bytes * engine_context
        awake_parts = (("weights", engine_weights), ("KV cache + activations", awake - engine_weights))
        sleeping = "asleep" if s.sleep_between_rollouts else "awake (no sleep_between_rollouts)"
        phases += [
            Phase("engine idle (asleep)", ((f"vLLM {sleeping}", asleep),), memory, (_FIX_SLEEP,)),
            Phase(
                "engine awake",
                awake_parts,
                awake,
                (_FIX_ENGINE_SHARE, _FIX_CONTEXT),
                required=engine_weights + one_sequence,
                note=f"its KV cache must hold one {engine_context}-token sequence (max_model_len)",
            ),
            Phase(
                "rollout",
                (("resident", resident), ("engine awake", awake)),
                memory,
                (_FIX_ENGINE_SHARE, _FIX_GPUS),
                note=f"vLLM starts only with {awake / GIB:.1f} GiB free",
            ),
        ]
    elif own_weights:  # vLLM on CPU: weights plus its fixed KV cache space, never asleep
        asleep = awake = engine_weights + s.engine_cpu_kv_gib * GIB
        cpu_parts = (("resident", resident), ("engine", awake))
        phases.append(Phase("rollout", cpu_parts, memory, ("--model.engine.cpu_kv_cache_gib",)))
    else:
        asleep = 0.0
        cache = s.rollout_sequences * s.context_tokens * 2 * layers * k * c
        gathered_policy = policy * m if sharded else 0.0
        own_parts = (("resident", resident), ("gathered policy", gathered_policy), ("KV cache", float(cache)))
        phases.append(Phase("rollout", own_parts, memory, ("--data.batch_size", _FIX_CONTEXT)))

    base = (("resident", resident), ("engine asleep", asleep))
    roots = (policy_root + critic_root) * c if sharded else 0.0
    layer_gathered = layer * c if sharded else 0.0
    logits = tokens * arch.vocab_size
    chunk = min(tokens, VOCAB_ROWS_PER_CHUNK) * arch.vocab_size  # one chunk's float32 work
    hidden = tokens * (2 * h + 3 * width) * c
    head_copy = arch.vocab_size * h * 4 if c < 4 else 0  # the float32 head's weight
    scoring_parts = (
        *base,
        ("gathered", roots + layer_gathered),
        ("hidden", hidden),
        ("logits", logits * 4 + head_copy + chunk * (4 + 4)),
    )
    one_layer_activations = tokens * (8 * h + c * (6 * h + 3 * k + 4 * width))
    models = 2 if s.critic else 1
    if s.gradient_checkpointing:
        activations = models * layers * tokens * h * c + one_layer_activations
    else:
        activations = models * layers * one_layer_activations
    logits_label = "logits+grad" + ("+entropy" if s.entropy else "")
    update_logits = logits * 2 * 4 + head_copy + chunk * (4 + 4 + 4 + (8 if s.entropy else 0))
    unsharded_grads = policy_root * c if sharded and s.lora_rank is None else 0.0
    # rlver.parallel.sharding.full_precision_reductions: FSDP reduce-scatters in float32, so a
    # low-precision unit's unsharded gradient is first copied to float32
    reduce_copy = policy_root * 4 if sharded and s.lora_rank is None and c < 4 else 0.0
    update_parts = (
        *base,
        ("gathered", roots + 2 * layer_gathered),
        ("activations", activations),
        (logits_label, update_logits),
        ("unsharded grads", unsharded_grads),
        ("float32 reduce copy", reduce_copy),
    )
    update_fixes = [_FIX_MICRO, _FIX_CONTEXT]
    if not s.gradient_checkpointing:
        update_fixes.insert(1, "--model.gradient_checkpointing")
    if asleep > ENGINE_ASLEEP:
        update_fixes.append(_FIX_SLEEP)
    phases += [
        Phase("scoring", scoring_parts, memory, (_FIX_MICRO, _FIX_CONTEXT)),
        Phase("update", update_parts, memory, tuple(update_fixes)),
    ]

    largest_unit = max(policy_root, layer)
    streamed: float
    if sharded:  # gathered in m (summon_full_params), cast to e; LoRA merges a copy first
        streamed = largest_unit * (m + s.engine_bytes + (m if s.lora_rank is not None else 0))
    elif s.lora_rank is not None:
        # merged one decoder layer at a time (rlver.modeling.lora.inference_weights)
        streamed = arch.lora_targeted_weights(s.lora_targets) / arch.num_layers * m + layer * s.engine_bytes
    else:
        streamed = layer * s.engine_bytes
    if own_weights:
        # A sleeping engine syncs before its KV cache wakes (plugins/vllm_engine: a sync asked for
        # while it is awake puts it to sleep first); one that never sleeps holds all of it.
        sleeping_sync = s.sleep_between_rollouts or not s.engine_on_gpu
        engine_in_sync = engine_weights if sleeping_sync else asleep
        reload_copy = arch.largest_engine_module() * s.engine_bytes if s.engine_on_gpu else 0.0
        sync_parts = (
            ("resident", resident),
            ("engine weights (KV cache asleep)" if sleeping_sync else "engine awake", engine_in_sync),
            ("streamed unit", streamed),
            ("vLLM reload copy", reload_copy),
        )
        phases.append(Phase("sync", sync_parts, memory, (_FIX_GPUS,)))
    # Lightning's dump takes the model's state dict, then the optimizers' (each freed before the
    # next): the larger gather is the phase's. FSDP1's model state dict (sharded or full) unshards
    # every unit in full precision, the root for its whole traversal and a decoder layer at a
    # time inside it: (root + D) x m, LoRA's frozen base too. Its optimizer state dict all-gathers
    # each unit's flat state (one buffer of the unit, reused for both AdamW states); `full` gathers
    # the parameters too and keeps each state until it is offloaded: 3 x the unit. NO_SHARD / one
    # GPU gathers nothing.
    model_gather = (max(policy_root, critic_root) + layer) * m if sharded else 0.0
    optimizer_gather: float
    if sharded and s.lora_rank is None:
        optimizer_gather = (3 if s.full_state_dict_checkpoint else 1) * largest_unit * m
    else:
        optimizer_gather = 0.0
    if model_gather >= optimizer_gather:
        gather = ("model state-dict gather (root + layer)", model_gather)
    else:
        gather = (
            "full-state unit" if s.full_state_dict_checkpoint else "optimizer-state gather",
            optimizer_gather,
        )
    checkpoint_parts = (*base, gather)
    phases.append(Phase("checkpoint", checkpoint_parts, memory, (_FIX_STATE_DICT,)))
    return phases


def failures(phases: list[Phase]) -> list[Phase]:
    return [phase for phase in phases if phase.shortfall > 0]


def plan_recipe(
    config: Any, *, gpu_memory_gib: float, world_size: int | None = None
) -> tuple[Architecture, TrainingShape, list[Phase]]:
    """The plan of a recipe as `rlver.commands.recipes.parse_recipe` returns it (trainer.*, model.*, data.*).

    world_size: instead of the recipe's devices x num_nodes.
    """
    shape = shape_from_recipe(config, gpu_memory_gib=gpu_memory_gib, world_size=world_size)
    arch = resolve_architecture(str(config.model.policy))
    return arch, shape, plan_memory(arch, shape)


def check_fits(module: Any, trainer: Any) -> None:
    """Before `rlver fit` loads weights on CUDA: a ValueError naming the first phase that cannot fit.

    Returns silently on CPU, outside fitting, and where the policy's config.json cannot be found
    without downloading (the check would need what the loading is about to fetch).
    """
    device = trainer.strategy.root_device
    fn = getattr(trainer.state, "fn", None)
    if device.type != "cuda" or (fn is not None and fn != "fit"):
        return
    try:
        arch = resolve_architecture(str(module.hparams.policy))
    except ValueError:
        return
    import torch

    memory = torch.cuda.get_device_properties(device).total_memory / GIB
    raise_if_over(arch, shape_from_run(module, trainer, memory))


def raise_if_over(arch: Architecture, shape: TrainingShape) -> None:
    """A ValueError (one line: the first phase over, by how much, the flags to change), or nothing."""
    failed = failures(plan_memory(arch, shape))
    if failed:
        raise ValueError(failure_line(failed[0], shape))


def failure_line(phase: Phase, shape: TrainingShape) -> str:
    needed = (phase.total if phase.required is None else phase.required) / GIB
    return (
        f"memory: {phase.name} needs {needed:.1f} GiB per GPU but {phase.limit / GIB:.1f} are available "
        f"({phase.shortfall / GIB:.1f} over, {shape.world_size} GPUs of {shape.gpu_memory_gib:.1f} GiB); "
        f"change {', '.join(phase.fixes)} (`rlver plan --config FILE` shows every phase)"
    )


# ---------------------------------------------------------------------- the printed table
def format_plan(arch: Architecture, shape: TrainingShape, phases: list[Phase]) -> str:
    s = shape
    over = {phase.name for phase in failures(phases)}
    sharding = f"FSDP {s.sharding_name} over {s.shard_count}" if s.shard_count > 1 else "no sharding"
    lines = [
        f"model {arch.name} ({arch.source}): {arch.parameter_count() / 1e9:.2f} B parameters"
        + (f", critic {arch.critic_parameter_count() / 1e9:.2f} B" if s.critic else ""),
        f"{s.world_size} GPU(s) of {s.gpu_memory_gib:.1f} GiB, {sharding}, weights {s.master_bytes} B, "
        f"compute {s.compute_bytes} B, engine {s.engine}"
        + (f" ({s.gpu_memory_utilization:g} of the GPU)" if s.engine == "vllm" and s.engine_on_gpu else ""),
        f"{s.dialogues_per_rank * s.world_size} dialogues a step, {s.dialogues_per_rank} on each GPU",
        "",
        f"{'phase':<21} {'GiB/GPU':>7} {'limit':>6}  {'fits':<10} made of (GiB)",
    ]
    for phase in phases:
        verdict = f"OVER {phase.shortfall / GIB:.1f}" if phase.name in over else "yes"
        parts = ", ".join(f"{label} {size / GIB:.1f}" for label, size in phase.parts if size)
        note = f"; {phase.note}" if phase.note else ""
        total, limit = phase.total / GIB, phase.limit / GIB
        lines.append(f"{phase.name:<21} {total:>7.1f} {limit:>6.1f}  {verdict:<10} {parts}{note}")
    lines += [
        "",
        "assumptions: FSDP1 FULL_SHARD / HYBRID_SHARD (other strategies: whole models on every GPU);",
        "grads and AdamW's 2 states in the weights' dtype (LoRA adapters float32); micro-batches padded",
        "to max_context_tokens; entropy over every position; vLLM awake takes gpu_memory_utilization x",
        "GPU, asleep (level 2) 1 GiB, syncs and checkpoints with its KV cache asleep; CUDA context",
        "1 GiB; no NCCL buffers, fragmentation or FSDP padding. The arithmetic:",
        "rlver/plan/memory_plan.py's docstring.",
    ]
    for phase in phases:
        if phase.name in over:
            lines.append(failure_line(phase, shape))
    return "\n".join(lines)
