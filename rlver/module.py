"""The RL LightningModule: one `training_step` is one PPO/GRPO iteration.

Manual optimization. Every rank rolls out its own share of the dialogues (its
dataloader shard); GRPO groups are formed on-rank from that rank's profiles,
so a group is always whole on one rank; logged metrics are reduced across
ranks. Only the last actor optimizer step of an iteration advances
`trainer.global_step`, so `max_steps` counts RL iterations, not minibatches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch

from rlver.batch import RolloutBatch, build_batch, placeholder_batch, token_logprobs
from rlver.checkpoint_io import use_rlver_checkpoint_io, writes_sharded_checkpoints
from rlver.console import phase
from rlver.critic import ValueModel
from rlver.curriculum import DifficultyCurriculum, difficulty_metrics
from rlver.distributed import clean_name, is_sharded, shard_for_strategy
from rlver.full_weights import gathered_for_generation
from rlver.grad_clip import clip_grad_norm
from rlver.interfaces import AdvantageBatch, RolloutEngine, SimulatorUnavailable
from rlver.lora import LoraSettings, adapter_disabled, add_adapter, trainable_names
from rlver.memory_plan import check_fits
from rlver.models import DTYPES, Policy, load_tokenizer, resolve_model_path
from rlver.plugins import get_registry, plain_config, split_spec
from rlver.rl.advantages import terminal_rewards
from rlver.rl.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    explained_variance,
    kl_estimate,
    loss_weight,
    masked_mean,
)
from rlver.rl.metrics import WeightedMeans
from rlver.rollout import RolloutRunner, RolloutSettings, StopRequested, Trajectory, summarize
from rlver.stopping import graceful_stop
from rlver.types import Profile

ComponentSpec = str | dict[str, Any]


@dataclass(frozen=True)
class PPOSettings:
    """The update: PPO epochs, minibatches, clipping, entropy and KL.

    Args:
        ppo_epochs: Passes over one iteration's rollouts.
        minibatch_size: Sequences per optimizer step (0: all of them, one step per epoch).
        micro_batch_size: Sequences per forward/backward (gradient accumulation within a minibatch).
        clip_ratio: PPO policy ratio clip epsilon.
        value_clip: Critic value clip range.
        entropy_coef: Entropy bonus weight.
        loss_aggregation: token-mean, seq-mean-token-mean or seq-mean-token-sum.
        grad_clip: Max gradient norm (0: no clipping).
        kl_coef: Weight of the KL to the frozen reference policy (0: no reference model).
        kl_estimator: k1 or k3.
        kl_mode: in-loss (a loss term) or in-reward (subtracted from token rewards).
    """

    ppo_epochs: int = 1
    minibatch_size: int = 0
    micro_batch_size: int = 4
    clip_ratio: float = 0.2
    value_clip: float = 0.5
    entropy_coef: float = 0.001
    loss_aggregation: str = "token-mean"
    grad_clip: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_mode: str = "in-loss"

    def __post_init__(self) -> None:
        checks = [
            (self.ppo_epochs >= 1, f"--model.ppo.ppo_epochs ({self.ppo_epochs}) must be >= 1"),
            (self.minibatch_size >= 0, f"--model.ppo.minibatch_size ({self.minibatch_size}) must be >= 0"),
            (
                self.micro_batch_size >= 1,
                f"--model.ppo.micro_batch_size ({self.micro_batch_size}) must be >= 1",
            ),
            (self.clip_ratio > 0, f"--model.ppo.clip_ratio ({self.clip_ratio}) must be > 0"),
            (self.value_clip > 0, f"--model.ppo.value_clip ({self.value_clip}) must be > 0"),
            (self.kl_coef >= 0, f"--model.ppo.kl_coef ({self.kl_coef}) must be >= 0"),
            (self.grad_clip >= 0, f"--model.ppo.grad_clip ({self.grad_clip}) must be >= 0"),
            (
                self.loss_aggregation in AGGREGATIONS,
                f"--model.ppo.loss_aggregation ({self.loss_aggregation!r}) "
                f"must be one of {', '.join(AGGREGATIONS)}",
            ),
            (
                self.kl_estimator in KL_ESTIMATORS,
                f"--model.ppo.kl_estimator ({self.kl_estimator!r}) must be one of {', '.join(KL_ESTIMATORS)}",
            ),
            (
                self.kl_mode in ("in-loss", "in-reward"),
                f"--model.ppo.kl_mode ({self.kl_mode!r}) must be in-loss or in-reward",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def _as_settings(cls: type, value: Any, flag: str) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(**plain_config(value))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{flag}: {error}") from None


class RLVERModule(L.LightningModule):
    """Trains a chat policy against simulated users with PPO (critic + GAE) or GRPO.

    Args:
        policy: Policy model: smollm2-135m-instruct (embedded), a local HF folder, or a hub id.
        critic: Critic initialisation (a model folder); None: the policy's weights.
        dtype: Weight dtype: float32, bfloat16 or float16 (mixed precision is the trainer's `precision`).
        engine: Rollout engine: a name or {"name": ..., <options>}.
        simulator: User simulator: a name or {"name": ..., <options>}.
        prompt_format: Prompt format: think, nothink, or {"name": ..., <options>}.
        rollout: Dialogue settings for training rollouts.
        eval_temperature: Sampling temperature for validation and test rollouts (0: greedy).
        rewards: Reward components, summed: names or {"name": ..., "weight": w, <options>}.
        advantage: Advantage estimator: gae (PPO, trains a critic) or grpo.
        group_size: Dialogues per profile per step (GRPO's n); they share persona and opening.
        ppo: The update settings.
        actor_lr: Policy AdamW learning rate.
        critic_lr: Critic AdamW learning rate.
        weight_decay: AdamW weight decay for both.
        actor_warmup_ratio: Fraction of max_steps with linear warmup of the actor lr, then constant.
        critic_warmup_ratio: Same for the critic.
        gradient_checkpointing: Trade compute for memory in the policy and critic.
        log_samples_every_n_steps: Log sample dialogues and an emotion plot every N steps (0: never).
        curriculum: Environment difficulty over training: a level (easy, normal, hard) or stages
            [{"until_step": 10, "mix": "easy"}, {"mix": {"normal": 1, "hard": 1}}]; each training
            profile draws its level, which wins over the simulator's own (None: no curriculum).
        lora: Train low-rank adapters on the policy instead of all its weights (peft):
            {rank, alpha, dropout, target_modules}. The optimizer and checkpoints hold only the
            adapter; engines sample from the merged weights; with kl_coef > 0 the reference is
            the same network with the adapter off. None: full fine-tuning.
        low_precision_weights: Allow training full weights held in bfloat16/float16 (`dtype`, or
            `--trainer.precision bf16-true/16-true`). Off: refused, since updates at RL learning
            rates round away; float32 weights with bf16-mixed compute are the default way.
    """

    def __init__(
        self,
        policy: str = "smollm2-135m-instruct",
        critic: str | None = None,
        dtype: str = "float32",
        engine: ComponentSpec = "hf",
        simulator: ComponentSpec = "embedded",
        prompt_format: ComponentSpec = "nothink",
        rollout: RolloutSettings = RolloutSettings(),  # noqa: B008 - frozen, so sharing is safe
        eval_temperature: float = 0.0,
        rewards: list[ComponentSpec] | None = None,
        advantage: ComponentSpec = "grpo",
        group_size: int = 4,
        ppo: PPOSettings = PPOSettings(),
        actor_lr: float = 1e-6,
        critic_lr: float = 5e-6,
        weight_decay: float = 0.01,
        actor_warmup_ratio: float = 0.02,
        critic_warmup_ratio: float = 0.05,
        gradient_checkpointing: bool = False,
        log_samples_every_n_steps: int = 10,
        curriculum: str | list[dict[str, Any]] | None = None,
        lora: LoraSettings | None = None,
        low_precision_weights: bool = False,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.save_hyperparameters()
        if dtype not in DTYPES:
            raise ValueError(f"--model.dtype ({dtype!r}) must be one of {', '.join(DTYPES)}")
        if group_size < 1:
            raise ValueError(f"--model.group_size ({group_size}) must be >= 1")
        for name, value in (
            ("actor_warmup_ratio", actor_warmup_ratio),
            ("critic_warmup_ratio", critic_warmup_ratio),
        ):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"--model.{name} ({value}) must be within [0, 1)")
        self.rollout_settings = _as_settings(RolloutSettings, rollout, "--model.rollout")
        self.ppo = _as_settings(PPOSettings, ppo, "--model.ppo")
        self.lora = _as_settings(LoraSettings, lora, "--model.lora") if lora is not None else None
        self.fatal_error: SimulatorUnavailable | None = None  # what stopped the run, if not a signal
        # Checkpoints of a LoRA run leave out the frozen base weights (the model path has them).
        self.strict_loading = self.lora is None
        if eval_temperature < 0:
            raise ValueError(f"--model.eval_temperature ({eval_temperature}) must be >= 0")
        self.curriculum = (
            DifficultyCurriculum.from_config(plain_config(curriculum)) if curriculum is not None else None
        )

        registry = get_registry()
        self.component_specs = {
            "model": policy,
            "engine": plain_config(engine),
            "simulator": plain_config(simulator),
            "prompt_format": plain_config(prompt_format),
            "advantage": plain_config(advantage),
        }
        self.simulator = registry.build(
            "simulators", self.component_specs["simulator"], flag="--model.simulator"
        )
        self.prompt_format = registry.build(
            "formats", self.component_specs["prompt_format"], flag="--model.prompt_format"
        )
        registry.check("engines", self.component_specs["engine"], flag="--model.engine", context={"policy"})
        self.advantage_estimator = registry.build(
            "advantages", self.component_specs["advantage"], flag="--model.advantage"
        )
        self.reward_functions = self._build_rewards(
            registry, plain_config(rewards) if rewards is not None else ["final_emotion"]
        )
        if getattr(self.advantage_estimator, "requires_critic", False) is False and critic is not None:
            raise ValueError("--model.critic is set but the advantage estimator trains no critic")
        if group_size < 2 and getattr(self.advantage_estimator, "requires_groups", False):
            advantage_name, _ = split_spec(self.component_specs["advantage"], flag="--model.advantage")
            raise ValueError(f"--model.group_size ({group_size}) must be >= 2 for {advantage_name}")
        if self.ppo.kl_mode == "in-reward" and getattr(self.advantage_estimator, "requires_groups", False):
            # A group whose rewards tie would be normalised on KL noise alone: +-1 advantages.
            raise ValueError(
                "--model.ppo.kl_mode in-reward needs a critic (advantage: gae); a group baseline "
                "takes the KL in the loss (kl_mode: in-loss)"
            )
        if dtype != "float32" and lora is None and not low_precision_weights:
            self._low_precision_refusal = (
                f"--model.dtype {dtype}: full fine-tuning would keep the trained weights in {dtype}, "
                "where an update at lr 1e-6 is below half a unit in the last place for most weights and "
                "rounds away; use dtype float32 (mixed precision still computes in bf16: "
                "--trainer.precision bf16-mixed), or set --model.low_precision_weights true to train "
                "them anyway"
            )
        else:
            self._low_precision_refusal = ""

        self.policy_model: torch.nn.Module | None = None
        self.value_model: ValueModel | None = None
        self._reference: list[torch.nn.Module] = []  # a list keeps it out of state_dict and checkpoints
        self.tokenizer: Any = None
        self.runner: RolloutRunner | None = None

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _build_rewards(registry: Any, specs: Sequence[ComponentSpec]) -> list[tuple[str, float, Any]]:
        if not specs:
            raise ValueError("--model.rewards: at least one reward is needed")
        built = []
        for index, spec in enumerate(specs):
            flag = f"--model.rewards[{index}]"
            name, options = split_spec(spec, flag=flag)
            weight = float(options.pop("weight", 1.0))
            built.append((name, weight, registry.build("rewards", {"name": name, **options}, flag=flag)))
        return built

    @property
    def uses_critic(self) -> bool:
        return bool(getattr(self.advantage_estimator, "requires_critic", False))

    def configure_model(self) -> None:
        """Load the networks (called by Lightning once the strategy is set up; idempotent)."""
        if self.policy_model is not None:
            return
        from transformers import AutoModelForCausalLM

        hp = self.hparams
        path = resolve_model_path(hp.policy)
        weight_dtype = DTYPES[hp.dtype]
        self.tokenizer = load_tokenizer(path)
        self.policy_model = AutoModelForCausalLM.from_pretrained(path, dtype=weight_dtype)
        if self.uses_critic:
            self.value_model = ValueModel(
                resolve_model_path(hp.critic) if hp.critic else path,
                dtype=weight_dtype,
                head_dtype=torch.float32 if self.lora is not None else weight_dtype,
            )
        if self.ppo.kl_coef > 0 and self.lora is None:  # with LoRA: the adapter switched off
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=weight_dtype).eval()
            reference.requires_grad_(False)
            self._reference = [reference]
        if self.lora is not None:
            self.policy_model = add_adapter(self.policy_model, self.lora)
            if hp.gradient_checkpointing:  # frozen embeddings: checkpointed blocks still need an input grad
                self.policy_model.enable_input_require_grads()
            if self.value_model is not None:
                # The critic: its own adapter on its own frozen copy of the base, plus the full
                # value head. A shared base would save that copy but switch adapters in every
                # forward; separate adapters keep the critic's gradients out of the policy.
                self.value_model.backbone = add_adapter(
                    self.value_model.backbone, self.lora, task_type="FEATURE_EXTRACTION"
                )
                if hp.gradient_checkpointing:
                    self.value_model.backbone.enable_input_require_grads()
        self.policy_model.train()  # HF loads in eval mode; Lightning expects train mode while fitting
        if self.value_model is not None:
            self.value_model.train()
        if hp.gradient_checkpointing:
            self.policy_model.gradient_checkpointing_enable()
            if self.value_model is not None:
                self.value_model.gradient_checkpointing_enable()
        if self._trainer is not None:
            # Under FSDP the policy and the critic are sharded as roots of their own, so that
            # manual optimization can gather them for generation and for weight sync between
            # training steps; the frozen reference stays whole. Other strategies: unchanged.
            self.policy_model = shard_for_strategy(self.policy_model, self.trainer.strategy)
            if self.value_model is not None:
                self.value_model = shard_for_strategy(self.value_model, self.trainer.strategy)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch  # a batch is a list of profiles: plain data that never goes to a device

    def rollout_runner(self, policy: Policy) -> RolloutRunner:
        """A rollout runner over `policy` with this module's engine, simulator, format and settings."""
        engine = get_registry().build(
            "engines", self.component_specs["engine"], flag="--model.engine", policy=policy
        )
        return RolloutRunner(
            policy,
            engine,
            self.simulator,
            self.prompt_format,
            self.rollout_settings,
            components=dict(self.component_specs),
        )

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self._check_training_precision()
            check_fits(self, self.trainer)  # an OOM after the queue becomes one line at start (GPUs)
        self._share_cpu_cores()
        if self._trainer is not None:
            use_rlver_checkpoint_io(self.trainer.strategy)  # `--ckpt_path <FSDP folder>` anywhere
        engine = self.component_specs["engine"]
        engine = engine if isinstance(engine, str) else engine.get("name", "?")
        with phase(f"loading {self.hparams.policy} and the {engine} engine"):
            self.configure_model()
            for reference in self._reference:
                reference.to(self.device)
            policy = Policy(
                model=self.policy_model,
                tokenizer=self.tokenizer,
                path=resolve_model_path(self.hparams.policy),
                name=str(self.hparams.policy),
            )
            self.runner = self.rollout_runner(policy)

    def collective_timeout_seconds(self) -> float | None:
        """How long one rank may be kept by a dead simulator endpoint, plus 10 min (None: no bound).

        The others wait that long in the step's next collective; the Trainer keeps the process
        group's timeout above it, so the simulator gives up (a clean stop with `last.ckpt`) first.
        """
        stall = self.simulator.worst_case_seconds()
        return None if stall is None else stall + 600.0

    def _check_training_precision(self) -> None:
        """Refuse numerics under which training silently learns nothing or clips wrongly."""
        precision = str(self.trainer.precision) if self._trainer is not None else "32-true"
        if precision == "16-mixed":
            # Gradients are clipped (and their norm logged) before Lightning's GradScaler unscales
            # them in its optimizer step: the clip would act on scaled gradients.
            raise ValueError(
                "--trainer.precision 16-mixed is not supported (rlver clips gradients before the fp16 "
                "loss scale is removed); use bf16-mixed, or 32-true where bf16 is not native"
            )
        refusal = self._low_precision_refusal
        full_weights_in_16_bits = precision in ("bf16-true", "16-true") and self.lora is None
        if not refusal and full_weights_in_16_bits and not self.hparams.low_precision_weights:
            refusal = (
                f"--trainer.precision {precision}: full fine-tuning would keep the trained weights "
                "in 16 bits, where an update at lr 1e-6 rounds away; use bf16-mixed with "
                "--model.dtype float32, or set --model.low_precision_weights true"
            )
        if refusal:
            raise ValueError(refusal)

    def _share_cpu_cores(self) -> None:
        """Several ranks on one CPU machine: split the cores instead of each taking them all.

        Oversubscribed threads make every rank spin and the step several times slower.
        An explicit OMP_NUM_THREADS wins.
        """
        if self._trainer is None or self.device.type != "cpu" or "OMP_NUM_THREADS" in os.environ:
            return
        local_ranks = max(1, self.trainer.world_size // max(1, self.trainer.num_nodes))
        if local_ranks > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))

    # Checkpoint weights are restored after setup(); engines with their own copy of the
    # weights (vllm) loaded them from disk, so push the restored ones in before any rollout.
    def on_train_start(self) -> None:
        self.runner.engine.sync_weights()

    def on_validation_start(self) -> None:
        self.runner.engine.sync_weights()

    def on_test_start(self) -> None:
        self.runner.engine.sync_weights()

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        total_steps = max(int(self.trainer.max_steps if self.trainer.max_steps > 0 else 1000), 1)
        trainable = [p for p in self.policy_model.parameters() if p.requires_grad]  # all, or the adapter
        optimizers = [torch.optim.AdamW(trainable, lr=hp.actor_lr, weight_decay=hp.weight_decay)]
        ratios = [hp.actor_warmup_ratio]
        if self.value_model is not None:
            optimizers.append(
                torch.optim.AdamW(
                    [p for p in self.value_model.parameters() if p.requires_grad],
                    lr=hp.critic_lr,
                    weight_decay=hp.weight_decay,
                )
            )
            ratios.append(hp.critic_warmup_ratio)
        schedulers = [
            torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_then_constant(round(ratio * total_steps)))
            for optimizer, ratio in zip(optimizers, ratios, strict=True)
        ]
        return optimizers, schedulers

    # ------------------------------------------------------------------ the algorithm
    def training_step(self, batch: Sequence[Profile], batch_idx: int) -> None:
        batch = list(batch)
        step = self.global_step
        step_started = time.perf_counter()

        # 1. a batch of profiles, each at its curriculum level; each repeated group_size times
        #    as a group sharing persona, opening and level
        if self.curriculum is not None:
            offset = self.global_rank * len(batch)
            batch = self.curriculum.assign(batch, step, self.rollout_settings.seed, offset=offset)
        dialogues = [profile for profile in batch for _ in range(self.hparams.group_size)]
        group_ids = torch.tensor([i // self.hparams.group_size for i in range(len(dialogues))])

        # 2. roll out the dialogues with the engine plugin; a stop asked for now (SIGTERM,
        #    Ctrl-C) drops the step, which has changed nothing yet, on every rank together
        stop = graceful_stop(self._trainer)
        rollout_started = time.perf_counter()
        try:
            with self._generation_weights():
                trajectories = self.runner.run(
                    dialogues,
                    seed=self._rollout_seed(step),
                    group_size=self.hparams.group_size,
                    should_stop=None if stop is None else lambda: stop.requested is not None,
                )
        except StopRequested:
            trajectories = []
        except SimulatorUnavailable as error:
            # Nothing has changed this step: stop every rank with last.ckpt at the last finished
            # step, then `rlver fit` exits with this message (an error on one rank stops all).
            if stop is None:
                raise
            self.fatal_error = error
            stop.requested = stop.requested or "the simulator becoming unavailable"
            trajectories = []
        if stop is not None and stop.agree(self.trainer):
            # Every rank learns why, so each exits with the error, not only the rank that saw it.
            reasons = [r for r in self._gather_objects(str(self.fatal_error or "")) if r]
            if reasons and self.fatal_error is None:
                self.fatal_error = SimulatorUnavailable(reasons[0])
            return  # GracefulStop checkpoints the state as of the last finished step, and stops
        rollout_seconds = time.perf_counter() - rollout_started
        release_memory = getattr(self.runner.engine, "release_memory", None)
        if release_memory is not None:
            release_memory()  # e.g. vLLM sleeps on GPUs so the update gets the memory
        get_registry().call_observers("rlver_on_rollout_end", trajectories=trajectories, step=step)
        metrics = self._rollout_metrics(trajectories, prefix="rollout")
        if self.curriculum is not None:
            metrics.update(self._difficulty_metrics(trajectories))
        # A dialogue the simulator failed on stays in the batch but is invalid: out of the
        # loss, of GRPO's baselines and of any whitening statistics. A rank left with nothing
        # trains on a placeholder, so every rank runs the step's collectives the same way.
        with_turns = [i for i, t in enumerate(trajectories) if t.num_turns > 0]
        kept = [trajectories[i] for i in with_turns]
        metrics["rollout/simulator_errors"] = float(
            sum(t.termination == "simulator_error" for t in trajectories)
        )
        metrics.update(self._simulator_metrics())

        # 3. score the dialogues with the reward plugins (weighted sum)
        update_started = time.perf_counter()
        if kept:
            valid = torch.tensor([t.termination != "simulator_error" for t in kept], dtype=torch.bool)
            dialogue_rewards = self._score(kept, metrics)
            rollout_batch = build_batch(kept, pad_id=self.tokenizer.pad_token_id)
            group_ids = group_ids[with_turns]
        else:
            valid = torch.zeros(1, dtype=torch.bool)
            dialogue_rewards = torch.zeros(1)
            rollout_batch = placeholder_batch(self.tokenizer.pad_token_id)
            group_ids = torch.zeros(1, dtype=torch.long)
        rollout_batch.loss_mask[~valid[rollout_batch.sequence_dialogue]] = 0
        trained = rollout_batch.sequence_dialogue[rollout_batch.loss_mask.sum(dim=1) > 0]
        metrics["rollout/trained_dialogues"] = float(trained.unique().numel())  # summed over ranks

        # 4. old log-probs from the sampled ids, reference log-probs and values
        rollout_batch = rollout_batch.to(self.device)
        old_logprobs, ref_logprobs, old_values = self._score_tokens(rollout_batch)
        mask = rollout_batch.loss_mask
        if mask.any():
            gap = ((old_logprobs - rollout_batch.engine_logprobs).abs() * mask).max()
            metrics["rollout/logprob_gap"] = gap.item()

        # 5. advantages on per-dialogue timelines, statistics over every rank's dialogues
        timeline_mask = rollout_batch.timeline_mask
        token_rewards = terminal_rewards(dialogue_rewards.to(self.device), timeline_mask)
        if ref_logprobs is not None:
            kl = kl_estimate(old_logprobs, ref_logprobs, self.ppo.kl_estimator, mask)
            if mask.any():
                metrics["ppo/kl"] = masked_mean(kl, mask).item()
            if self.ppo.kl_mode == "in-reward":
                token_rewards = token_rewards - self.ppo.kl_coef * rollout_batch.to_timeline(kl)
        result = self.advantage_estimator(
            AdvantageBatch(
                token_rewards=token_rewards,
                values=rollout_batch.to_timeline(old_values) if old_values is not None else None,
                mask=timeline_mask,
                group_ids=group_ids.to(self.device),
                valid=valid.to(self.device),
                reduce_sum=self._reduce_sum,
            )
        )
        advantages = rollout_batch.to_sequences(result.advantages) * mask
        returns = rollout_batch.to_sequences(result.returns) if result.returns is not None else None
        metrics.update(result.metrics)
        if mask.any():
            metrics["advantage/mean"] = masked_mean(advantages, mask).item()
            metrics["advantage/abs_mean"] = masked_mean(advantages.abs(), mask).item()
            if returns is not None and old_values is not None:
                metrics["ppo/explained_variance"] = explained_variance(old_values, returns, mask).item()

        # 6. PPO epochs over minibatches (in one process, a stop before the first optimizer
        #    step still drops the step)
        try:
            metrics.update(
                self._update(rollout_batch, old_logprobs, ref_logprobs, advantages, old_values, returns, step)
            )
        except StopRequested:
            for optimizer in self._optimizer_list():
                optimizer.zero_grad()
            return
        sync_started = time.perf_counter()
        self.runner.engine.sync_weights()  # the next rollout samples from the updated policy
        sync_seconds = time.perf_counter() - sync_started
        update_seconds = time.perf_counter() - update_started - sync_seconds

        # 7. log
        trained_tokens = int(mask.sum().item()) * self.ppo.ppo_epochs
        sampled_tokens = sum(len(t.response_ids) for tr in trajectories for t in tr.policy_turns)
        metrics.update(
            {
                "perf/rollout_seconds": rollout_seconds,
                "perf/generate_seconds": self.runner.timings["generate"],
                "perf/simulator_seconds": self.runner.timings["simulator"],
                "perf/update_seconds": update_seconds,
                "perf/weight_sync_seconds": sync_seconds,
                "perf/step_seconds": time.perf_counter() - step_started,
                "perf/rollout_tokens_per_second": sampled_tokens / max(rollout_seconds, 1e-9),
                "perf/update_tokens_per_second": trained_tokens / max(update_seconds, 1e-9),
            }
        )
        # Written once the step is done: a step dropped by a stop leaves no transcript behind.
        self._append_transcripts("train", trajectories, step)
        self._log_metrics(metrics, step=step)
        get_registry().call_observers("rlver_on_train_step_end", metrics=metrics, step=step)
        self._log_samples(trajectories, step)

    def _score(self, trajectories: Sequence[Trajectory], metrics: dict[str, float]) -> torch.Tensor:
        total = torch.zeros(len(trajectories))
        for name, weight, function in self.reward_functions:
            scores = torch.tensor(function(trajectories), dtype=torch.float32)
            if scores.shape != total.shape or not torch.isfinite(scores).all():
                raise ValueError(
                    f"reward {name!r} returned {scores.tolist()} for {len(trajectories)} dialogues"
                )
            metrics[f"reward/{name}"] = scores.mean().item()
            total += weight * scores
        metrics["reward/total"] = total.mean().item()
        return total

    @torch.no_grad()
    def _score_tokens(
        self, batch: RolloutBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Old log-probs (current policy), reference log-probs and old values, in micro-batches."""
        with _eval_mode(self.policy_model, self.value_model):  # dropout off: the policy that sampled
            return self._score_token_micro_batches(batch)

    def _score_token_micro_batches(
        self, batch: RolloutBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        temperature = self.rollout_settings.temperature or 1.0
        old, ref, values = [], [], []
        micro_batches = list(self._micro_batches(range(batch.num_sequences)))
        # Under FSDP every forward is a collective: ranks run as many as the fullest rank,
        # padding with a repeat of sequence 0 whose outputs are dropped.
        padding = int(self._reduce_max(len(micro_batches))) - len(micro_batches)
        for index, rows in enumerate(micro_batches + [[0]] * padding):
            ids, attention = batch.input_ids[rows], batch.attention_mask[rows]
            if index >= len(micro_batches):
                self.policy_model(input_ids=ids, attention_mask=attention)
                if self.value_model is not None:
                    self.value_model(ids, attention)
                continue
            old.append(
                token_logprobs(
                    self.policy_model(input_ids=ids, attention_mask=attention).logits, ids, temperature
                )
            )
            if self._reference:
                logits = self._reference[0](input_ids=ids, attention_mask=attention).logits
                ref.append(token_logprobs(logits, ids, temperature))
            elif self.lora is not None and self.ppo.kl_coef > 0:
                with adapter_disabled(self.policy_model):
                    logits = self.policy_model(input_ids=ids, attention_mask=attention).logits
                ref.append(token_logprobs(logits, ids, temperature))
            if self.value_model is not None:
                values.append(self.value_model(ids, attention))
        mask = batch.loss_mask.float()
        return (
            torch.cat(old) * mask,
            torch.cat(ref) * mask if ref else None,
            torch.cat(values) * mask if values else None,
        )

    def _update(
        self,
        batch: RolloutBatch,
        old_logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        old_values: torch.Tensor | None,
        returns: torch.Tensor | None,
        step: int,
    ) -> dict[str, float]:
        """PPO epochs over minibatches, every rank in lockstep.

        Ranks hold different numbers of sequences (dialogues end at different turns), but
        gradient all-reduces are collectives: every rank runs the same number of optimizer
        steps and of backward passes, padding with empty micro-batches. Each micro-batch's
        loss is weighted by its share of the tokens (or sequences) of the whole step's
        minibatch, so the synchronised gradient equals that of one process holding every
        rank's dialogues.
        """
        optimizers = self._optimizer_list()
        schedulers = self.lr_schedulers()
        schedulers = schedulers if isinstance(schedulers, list) else [schedulers]
        actor_optimizer = optimizers[0]
        critic_optimizer = optimizers[1] if len(optimizers) > 1 else None
        settings = self.ppo
        temperature = self.rollout_settings.temperature or 1.0
        world = self.trainer.world_size if self._trainer is not None else 1
        stop = graceful_stop(self._trainer)
        # Per-minibatch values (gradient norms) are averaged over minibatches; per-micro-batch
        # values (losses, clip fractions) are weighted by the micro-batch's share of the loss, so
        # they are the step's token-mean (sequence-mean) over every rank, not a mean of means.
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        names = _ACTOR_STATS + (_CRITIC_STATS if self.value_model is not None else ())
        if self.ppo.kl_coef > 0 and self.ppo.kl_mode == "in-loss":
            names += ("kl_loss",)
        weighted = WeightedMeans(names)

        def record(name: str, value: float) -> None:
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1

        count = batch.num_sequences
        most = int(self._reduce_max(count))  # sequences on the fullest rank
        minibatch = settings.minibatch_size or most
        slots = -(-most // minibatch)  # minibatches per epoch, the same on every rank
        generator = torch.Generator().manual_seed(step)
        minibatches = []
        for _ in range(settings.ppo_epochs):  # a fresh shuffle per epoch, cut into minibatches
            order = torch.randperm(count, generator=generator).tolist()
            minibatches.extend(order[start * minibatch : (start + 1) * minibatch] for start in range(slots))

        def loss_size(mask: torch.Tensor) -> float:
            return loss_weight(mask, settings.loss_aggregation)

        for number, rows in enumerate(minibatches):
            last = number == len(minibatches) - 1
            local_size = loss_size(batch.loss_mask[rows])
            # The whole step's minibatch size, and the micro-batch count every rank runs.
            global_size = max(float(self._reduce_sum(torch.tensor(local_size, device=self.device))), 1.0)
            micro_steps = int(self._reduce_max(-(-len(rows) // settings.micro_batch_size)))
            actor_optimizer.zero_grad()
            if critic_optimizer is not None:
                critic_optimizer.zero_grad()
            micro_batches = list(self._micro_batches(rows))
            micro_batches += [[]] * (micro_steps - len(micro_batches))
            for index, micro in enumerate(micro_batches):
                if number == 0 and world == 1 and stop is not None and stop.requested:
                    raise StopRequested("stopped before the first optimizer step")
                empty = not micro
                micro = micro or [0]  # an empty slot runs sequence 0 with weight 0 for the collectives
                ids, attention, mask = (
                    batch.input_ids[micro],
                    batch.attention_mask[micro],
                    batch.loss_mask[micro],
                )
                local = loss_size(mask)
                # DDP averages gradients over ranks; the world factor turns that into a sum.
                weight = 0.0 if empty else local / global_size * world
                loss, stats = actor_loss(
                    self.policy_model,
                    ids,
                    attention,
                    mask,
                    old_logprobs[micro],
                    advantages[micro],
                    None if ref_logprobs is None else ref_logprobs[micro],
                    settings,
                    temperature,
                )
                loss = loss * weight
                if self.value_model is not None and returns is not None and old_values is not None:
                    values = self.value_model(ids, attention)
                    value_loss, value_stats = clipped_value_loss(
                        values,
                        old_values[micro],
                        returns[micro],
                        mask,
                        settings.value_clip,
                        settings.loss_aggregation,
                    )
                    # One backward for both networks: one gradient synchronisation per micro-batch.
                    loss = loss + value_loss * weight
                    stats["value_loss"] = value_loss.item()
                    stats["value_clip_fraction"] = value_stats["value_clip_fraction"].item()
                if not empty and mask.any():
                    weighted.add(stats, local)
                with self._gradient_sync(index == len(micro_batches) - 1):
                    self.manual_backward(loss)
            record("ppo/grad_norm", self._clip(self.policy_model))
            self._step(actor_optimizer, counts_as_global_step=last)
            if critic_optimizer is not None:
                record("ppo/critic_grad_norm", self._clip(self.value_model))
                self._step(critic_optimizer, counts_as_global_step=False)
        for scheduler in schedulers:
            scheduler.step()
        metrics = {name: sums[name] / counts[name] for name in sums}
        # The same names on every rank (a rank with nothing to learn adds zeros): one all-reduce.
        metrics.update({f"ppo/{k}": v for k, v in weighted.means(self._reduce_sum, self.device).items()})
        metrics["ppo/actor_lr"] = actor_optimizer.param_groups[0]["lr"]
        if critic_optimizer is not None:
            metrics["ppo/critic_lr"] = critic_optimizer.param_groups[0]["lr"]
        metrics["ppo/minibatches"] = float(len(minibatches))
        return metrics

    def _optimizer_list(self) -> list[Any]:
        optimizers = self.optimizers()
        return optimizers if isinstance(optimizers, list) else [optimizers]

    @contextlib.contextmanager
    def _gradient_sync(self, sync: bool) -> Iterator[None]:
        """Skip the DDP gradient all-reduce on all but a minibatch's last backward."""
        wrapped = self.trainer.strategy.model if self._trainer is not None else None
        no_sync = getattr(wrapped, "no_sync", None)
        if sync or no_sync is None or not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            yield
        else:
            with no_sync():
                yield

    def _reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over all ranks (the tensor itself in one process)."""
        if self._trainer is None or self.trainer.world_size == 1:
            return tensor
        return self.trainer.strategy.reduce(tensor.clone(), reduce_op="sum")

    def _reduce_max(self, value: float) -> float:
        if self._trainer is None or self.trainer.world_size == 1:
            return value
        tensor = torch.tensor([float(value)], device=self.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return float(tensor.item())

    def _micro_batches(self, rows: Sequence[int] | range) -> Iterator[list[int]]:
        rows = list(rows)
        size = self.ppo.micro_batch_size
        for start in range(0, len(rows), size):
            yield rows[start : start + size]

    def _clip(self, module: torch.nn.Module) -> float:
        """Clip to the global gradient norm (over every shard under FSDP); returns it, pre-clip."""
        max_norm = self.ppo.grad_clip if self.ppo.grad_clip > 0 else float("inf")
        return clip_grad_norm(module, max_norm)

    def _step(self, optimizer: Any, *, counts_as_global_step: bool) -> None:
        if counts_as_global_step:
            optimizer.step()
        else:
            # Same strategy/precision path, but Lightning's step counter is left alone.
            self.trainer.strategy.optimizer_step(optimizer.optimizer, lambda: None)

    # ------------------------------------------------------------------ rollouts and logging
    def _rollout_seed(self, step: int) -> int:
        base = self.rollout_settings.seed
        return base + 1_000_003 * step + 7919 * self.global_rank

    @contextlib.contextmanager
    def _generation_weights(self) -> Iterator[None]:
        """An engine that samples from the training module itself (hf) needs its full weights.

        Under FSDP they are gathered for the whole rollout (a collective on entry and exit;
        none per forward, so ranks may generate different lengths). Engines holding their own
        copy (vllm) got the weights at the last sync and need nothing.
        """
        engine = getattr(self.runner, "engine", None)
        own_copy = engine is not None and type(engine).sync_weights is not RolloutEngine.sync_weights
        if own_copy:
            # Lightning runs training_step under the precision's autocast; an in-process engine
            # (vLLM) would inherit it and compute its own float32 parts (sampler, log-probs) in bf16.
            with _autocast_off():
                yield
        elif self.policy_model is None:
            yield
        else:
            with gathered_for_generation(self.policy_model):
                yield

    def _rollout_metrics(self, trajectories: Sequence[Trajectory], prefix: str) -> dict[str, float]:
        summary = summarize(trajectories)
        count = max(len(trajectories), 1)
        turns = [t for tr in trajectories for t in tr.policy_turns]
        return {
            f"{prefix}/final_emotion": summary["mean_final_emotion"],
            f"{prefix}/success_rate": summary["success"] / count,
            f"{prefix}/failure_rate": summary["failure"] / count,
            f"{prefix}/turns": summary["mean_turns"],
            f"{prefix}/reply_tokens": sum(len(t.response_ids) for t in turns) / max(len(turns), 1),
            f"{prefix}/format_violation_rate": summary["format_violations"] / max(len(turns), 1),
            f"{prefix}/truncated_rate": sum(t.finish_reason == "length" for t in turns) / max(len(turns), 1),
        }

    def _simulator_metrics(self) -> dict[str, float]:
        """The simulator's counters since the last call (requests, retries, re-asks, ...)."""
        return {f"simulator/{name}": float(value) for name, value in self.simulator.drain_metrics().items()}

    def _difficulty_metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """Share of dialogues and mean final emotion per curriculum level, over all ranks."""
        assert self.curriculum is not None

        def reduce_sum(values: list[float]) -> list[float]:
            if self._trainer is None:
                return values
            summed = self.trainer.strategy.reduce(torch.tensor(values, device=self.device), reduce_op="sum")
            return summed.tolist()

        return difficulty_metrics(
            [t.profile.extra.get("difficulty") for t in trajectories],
            [t.final_emotion for t in trajectories],
            self.curriculum.levels,
            reduce_sum,
        )

    def _log_metrics(self, metrics: Mapping[str, float], step: int | None = None, **kwargs: Any) -> None:
        """Log metrics of all ranks' dialogues, whatever keys each rank has.

        Ranks may report different keys (a rank whose dialogues all failed has no
        losses; simulators count only what happened), and per-key synchronisation
        would then hang. One gather merges them instead: counters are summed, the
        rest averaged over the ranks that report them.

        A training step's metrics (`step` given) go to the loggers at once, under the step's
        index, rather than after Lightning's end-of-batch hooks: so they are on disk before
        the checkpoint written at the end of the step (rlver.resume flushes them), and a crash
        right after that checkpoint loses none.
        """
        finite = {name: float(value) for name, value in metrics.items() if math.isfinite(value)}
        merged = merge_rank_metrics(self._gather_objects(finite))
        show = {"rollout/final_emotion", "reward/total", "val/final_emotion"}
        to_loggers = step is None
        with warnings.catch_warnings():
            # Values are already identical on every rank; Lightning's advice to sync them is moot.
            warnings.filterwarnings("ignore", message=".*sync_dist=True.*")
            for name, value in merged.items():
                options = {"prog_bar": name in show, "sync_dist": False, "batch_size": 1, **kwargs}
                self.log(name, value, logger=to_loggers, **options)
        if step is None or self._trainer is None:
            return
        if (step + 1) % self.trainer.log_every_n_steps == 0:
            for logger in self.trainer.loggers:
                logger.log_metrics(merged, step=step)

    def _gather_objects(self, value: Any) -> list[Any]:
        """`value` from every rank, in rank order ([value] in one process)."""
        if self._trainer is None or self.trainer.world_size == 1 or not torch.distributed.is_initialized():
            return [value]
        gathered: list[Any] = [None] * self.trainer.world_size
        torch.distributed.all_gather_object(gathered, value)
        return gathered

    def _log_dir(self) -> Path | None:
        if self._trainer is None:
            return None
        directory = self.trainer.log_dir or self.trainer.default_root_dir
        return Path(directory) if directory else None

    def _append_transcripts(self, split: str, trajectories: Sequence[Trajectory], step: int) -> None:
        directory = self._log_dir()
        if directory is None:
            return
        folder = directory / "rollouts"
        folder.mkdir(parents=True, exist_ok=True)
        lines = "".join(
            json.dumps({"step": step, **trajectory.to_record()}, ensure_ascii=False) + "\n"
            for trajectory in trajectories
        )
        # One write: a kill can tear only the last line, which rlver.resume drops on resume.
        with (folder / f"{split}_rank{self.global_rank}.jsonl").open("a", encoding="utf-8") as handle:
            handle.write(lines)

    def _log_samples(self, trajectories: Sequence[Trajectory], step: int) -> None:
        every = self.hparams.log_samples_every_n_steps
        if not every or step % every or self.global_rank != 0 or self.logger is None:
            return
        experiment = getattr(self.logger, "experiment", None)
        if not hasattr(experiment, "add_text"):
            return
        for index, trajectory in enumerate(trajectories[:2]):
            experiment.add_text(f"samples/dialogue_{index}", _dialogue_markdown(trajectory), global_step=step)
        experiment.add_figure("rollout/emotion_trajectories", _emotion_figure(trajectories), global_step=step)

    # ------------------------------------------------------------------ evaluation
    def validation_step(self, batch: list[Profile], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "val")

    def test_step(self, batch: list[Profile], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "test")

    def on_test_epoch_start(self) -> None:
        self._test_trajectories: list[Trajectory] = []

    def on_test_epoch_end(self) -> None:
        """Sentient-benchmark output: SAGE-format records and Score / Success / Failure.

        Every rank writes its own dialogues; the scores are of all ranks' dialogues.
        """
        from rlver.score import score_records
        from rlver.transcripts import to_sage_record

        records = [to_sage_record(trajectory) for trajectory in self._test_trajectories]
        directory = self._log_dir()
        path = None
        if directory is not None:
            label = Path(str(self.hparams.policy).rstrip("/")).name or "policy"
            suffix = f"_rank{self.global_rank}" if self.trainer.world_size > 1 else ""
            path = directory / "sentient" / f"{label}{suffix}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", encoding="utf-8") as handle:
                for record in records:
                    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        if self.trainer.world_size > 1 and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(gathered, records)
            records = [record for part in gathered for record in part]
        if self.global_rank != 0 or not records:
            return
        scores = score_records(records)
        errors = sum(t.termination == "simulator_error" for t in self._test_trajectories)
        print(
            f"\nSentient benchmark ({scores['dialogues']} dialogues"
            f"{f', {errors} ended by simulator errors' if errors else ''})\n"
            f"Score    {scores['score']:.1f}\n"
            f"Success  {scores['success']}\n"
            f"Failure  {scores['failure']}\n"
            + (f"records  {path}  (rlver score {path})\n" if path is not None else ""),
            flush=True,
        )

    def evaluation_rollouts(self, profiles: Sequence[Profile], seed: int) -> list[Trajectory]:
        """Dialogues with `profiles` at `eval_temperature` (greedy by default), weights as they are now."""
        settings = self.rollout_settings
        eval_settings = RolloutSettings(
            settings.max_turns,
            settings.max_new_tokens,
            self.hparams.eval_temperature,
            settings.top_p,
            settings.max_context_tokens,
            settings.seed,
        )
        previous, self.runner.settings = self.runner.settings, eval_settings
        try:
            with self._generation_weights():
                return self.runner.run(list(profiles), seed=seed)
        finally:
            self.runner.settings = previous

    def _evaluate(self, batch: Sequence[Profile], batch_idx: int, split: str) -> None:
        batch = list(batch)
        settings = self.rollout_settings
        trajectories = self.evaluation_rollouts(
            batch, seed=settings.seed + 7919 * self.global_rank + batch_idx
        )
        self._append_transcripts(f"{split}_step{self.global_step}", trajectories, self.global_step)
        if split == "test":
            self._test_trajectories.extend(trajectories)
        metrics = self._rollout_metrics(trajectories, prefix=split)
        metrics[f"{split}/reward"] = self._score(trajectories, {}).mean().item()
        metrics[f"{split}/simulator_errors"] = float(
            sum(t.termination == "simulator_error" for t in trajectories)
        )
        metrics.update(self._simulator_metrics())
        self._log_metrics(metrics, on_epoch=True, on_step=False)

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Plain lists and tensors only, so the checkpoint loads with torch.load(weights_only=True).
        name, keys, position, has_gauss, cached = np.random.get_state()
        checkpoint["rlver_rng"] = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": [name, keys.tolist(), int(position), int(has_gauss), float(cached)],
        }
        if self.lora is not None:
            checkpoint.setdefault("hyper_parameters", {})["lora"] = dataclasses.asdict(self.lora)
            if is_sharded(self.policy_model) and writes_sharded_checkpoints(self.trainer.strategy):
                # torch's distributed checkpoint loader asks for every key the sharded model
                # has: a sharded checkpoint keeps the frozen base (the optimizer state does not).
                return
            networks = {"policy_model": self.policy_model, "value_model": self.value_model}
            keep = {
                f"{prefix}.{clean_name(name)}"
                for prefix, network in networks.items()
                if network is not None
                for name in trainable_names(network)
            }
            state = checkpoint["state_dict"]
            for key in [k for k in state if k.split(".", 1)[0] in networks and k not in keep]:
                del state[key]  # frozen base weights: the model path has them

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.configure_model()  # weights are loaded into the networks right after this hook
        state = checkpoint.get("rlver_rng")
        if state:
            torch.set_rng_state(state["torch"])
            random.setstate(state["python"])
            name, keys, position, has_gauss, cached = state["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))


_ACTOR_STATS = ("policy_loss", "entropy", "clip_fraction", "approx_kl")
_CRITIC_STATS = ("value_loss", "value_clip_fraction")


def actor_loss(
    policy_model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    settings: PPOSettings,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy's loss on one micro-batch: clipped surrogate - entropy bonus (+ KL in the loss)."""
    logits = policy_model(input_ids=input_ids, attention_mask=attention_mask).logits
    logprobs = token_logprobs(logits, input_ids, temperature)
    policy_loss, stats = clipped_policy_loss(
        logprobs, old_logprobs, advantages, mask, settings.clip_ratio, settings.loss_aggregation
    )
    # Entropy only where the policy acted: logits at t - 1 produce token t.
    acting = mask[:, 1:].bool()
    entropy = (
        entropy_from_logits(logits[:, :-1][acting], temperature).mean() if acting.any() else logits.sum() * 0
    )
    loss = policy_loss - settings.entropy_coef * entropy
    metrics = {
        "policy_loss": policy_loss.item(),
        "entropy": entropy.item(),
        "clip_fraction": stats["clip_fraction"].item(),
        "approx_kl": stats["approx_kl"].item(),
    }
    if ref_logprobs is not None and settings.kl_mode == "in-loss":
        kl = masked_mean(kl_estimate(logprobs, ref_logprobs, settings.kl_estimator, mask), mask)
        loss = loss + settings.kl_coef * kl
        metrics["kl_loss"] = kl.item()
    return loss, metrics


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    """No autocast on any device type inside (whatever the caller's context enabled)."""
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


@contextlib.contextmanager
def _eval_mode(*modules: torch.nn.Module | None) -> Iterator[None]:
    """Dropout (a LoRA adapter's, say) off inside, each module's own mode restored after."""
    present = [m for m in modules if m is not None]
    modes = [m.training for m in present]
    for module in present:
        module.eval()
    try:
        yield
    finally:
        for module, mode in zip(present, modes, strict=True):
            module.train(mode)


def _warmup_then_constant(warmup_steps: int):
    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0

    return factor


def _dialogue_markdown(trajectory: Trajectory) -> str:
    record = trajectory.to_record()
    lines = [
        f"**{record['profile_id']}** ({record['theme']}, {record['personality']}): "
        f"{record['start_emotion']:.0f} -> {record['final_emotion']:.0f}, {record['termination']}",
        "",
    ]
    for turn in record["turns"]:
        if turn["role"] == "user":
            lines.append(f"- **user** [{turn['emotion']:.0f}]: {turn['text']}")
        else:
            lines.append(f"- **assistant**: {turn['text']}")
    return "\n".join(lines)


def _emotion_figure(trajectories: Sequence[Trajectory]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 3))
    for trajectory in trajectories:
        axes.plot(range(len(trajectory.emotions)), trajectory.emotions, alpha=0.5)
    axes.set_xlabel("turn")
    axes.set_ylabel("emotion")
    axes.set_ylim(0, 100)
    figure.tight_layout()
    return figure


# Metrics that count events: summed over ranks, not averaged.
SUMMED_METRICS = (
    "rollout/simulator_errors",
    "rollout/trained_dialogues",
    "val/simulator_errors",
    "test/simulator_errors",
)
SUMMED_PREFIXES = ("simulator/", "advantage/degenerate_groups")


def merge_rank_metrics(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One metrics dict from every rank's: counters summed, others averaged where reported."""
    merged: dict[str, float] = {}
    for name in sorted({name for metrics in per_rank for name in metrics}):
        values = [metrics[name] for metrics in per_rank if name in metrics]
        summed = name in SUMMED_METRICS or name.startswith(SUMMED_PREFIXES)
        merged[name] = sum(values) if summed else sum(values) / len(values)
    return merged
