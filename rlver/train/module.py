"""The RL LightningModule: one `training_step` is one PPO/GRPO iteration.

Manual optimization. Every rank rolls out its own share of the dialogues (its
dataloader shard); GRPO groups are formed on-rank from that rank's profiles,
so a group is always whole on one rank; logged metrics are reduced across
ranks. Only the last actor optimizer step of an iteration advances
`trainer.global_step`, so `max_steps` counts RL iterations, not minibatches.

The module owns its parts, one concern each, and `training_step` names the owner of every
call: `self.rollouts` (the step's dialogues, their seeds, the steps rolled out ahead;
rlver.train.rollouts), `self.policy_update` (token scores, the PPO epochs, the optimizer steps;
rlver.train.policy_update), `self.run_log` (metrics, transcripts, samples; rlver.train.run_log),
`self.evaluator` (validation, the Sentient test; rlver.train.evaluation) and `self.ranks` (the
collectives; rlver.train.ranks). The numbered steps are docs/architecture.md's step table. This
file holds the algorithm's order only: it never computes a loss, a reward or a metric itself.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch

from rlver.checkpoint.io import use_rlver_checkpoint_io
from rlver.checkpoint.state import RNG_KEY, keep_trained_weights, restore_rng_state, rng_state
from rlver.core.console import phase
from rlver.core.interfaces import RolloutEngine, SimulatorUnavailable, StopRequested
from rlver.core.plugins import get_registry, implementing
from rlver.core.trajectory import Trajectory
from rlver.core.types import Profile
from rlver.modeling.critic import ValueModel
from rlver.modeling.lora import LoraSettings
from rlver.modeling.models import Policy, resolve_model_path
from rlver.modeling.networks import (
    check_training_precision,
    load_networks,
    optimizers_and_schedulers,
)
from rlver.parallel.sharding import shard_for_strategy
from rlver.plan.memory_plan import check_fits
from rlver.rollout.gaming import gaming_shares
from rlver.rollout.overlap import OverlapSettings, engine_for_overlap
from rlver.rollout.runner import RolloutRunner, RolloutSettings
from rlver.train.components import (
    ComponentSpec,
    build_components,
    checked_settings,
    overlap_settings,
)
from rlver.train.evaluation import Evaluator
from rlver.train.policy_update import PolicyUpdate
from rlver.train.ppo_update import PPOSettings, actor_loss
from rlver.train.ranks import Ranks
from rlver.train.rollouts import StepRollouts
from rlver.train.run_log import (
    RunLog,
    merge_rank_metrics,
    perf_metrics,
    rank_difficulty_metrics,
    rollout_metrics,
    simulator_errors,
    simulator_metrics,
)
from rlver.train.scoring import logprob_metrics, score_dialogues, token_advantages, training_batch

__all__ = ["PPOSettings", "RLVERModule", "actor_loss", "merge_rank_metrics"]  # the last three: re-exported


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
        actor_warmup_ratio: Fraction of max_steps with linear warmup of the actor lr, then `lr_schedule`.
        critic_warmup_ratio: Same for the critic.
        lr_schedule: After warmup: constant, or linear / cosine decay to `min_lr_ratio` x the lr at
            `--trainer.max_steps` (both networks; a run cut short by max_time stops on the way down).
        min_lr_ratio: The decaying schedules' last lr as a fraction of the peak.
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
        overlap: Roll out the next steps' dialogues while this step's update runs, and train on
            them 1 to `max_staleness` steps later with decoupled PPO's correction
            ({max_importance_weight, max_staleness}); for users with real latency
            (rlver.rollout.overlap). None: every step trains on its own rollout.
        judge: `rlver test` only: a dialogue judge (as `rlver score --judge`) scores the test dialogues
            by dimension, printed beside Score and written to `<records>.judged.jsonl`; a list is a
            pool of judges, each dimension printed with their agreement. None: no judge.
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
        ppo: PPOSettings = PPOSettings(),  # noqa: B008 - frozen, so sharing is safe
        actor_lr: float = 1e-6,
        critic_lr: float = 5e-6,
        weight_decay: float = 0.01,
        actor_warmup_ratio: float = 0.02,
        critic_warmup_ratio: float = 0.05,
        lr_schedule: str = "constant",
        min_lr_ratio: float = 0.0,
        gradient_checkpointing: bool = False,
        log_samples_every_n_steps: int = 10,
        curriculum: str | list[dict[str, Any]] | None = None,
        lora: LoraSettings | None = None,
        low_precision_weights: bool = False,
        overlap: OverlapSettings | None = None,
        judge: ComponentSpec | list[ComponentSpec] | None = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.save_hyperparameters()
        settings = checked_settings(
            dtype=dtype,
            group_size=group_size,
            rollout=rollout,
            ppo=ppo,
            lora=lora,
            eval_temperature=eval_temperature,
            curriculum=curriculum,
            optimizer=dict(
                actor_lr=actor_lr, critic_lr=critic_lr, weight_decay=weight_decay, lr_schedule=lr_schedule,
                actor_warmup_ratio=actor_warmup_ratio, critic_warmup_ratio=critic_warmup_ratio,
                min_lr_ratio=min_lr_ratio,
            ),
        )  # fmt: skip
        self.rollout_settings, self.lora = settings.rollout, settings.lora
        self.curriculum, self.optimizer_settings = settings.curriculum, settings.optimizer
        self.overlap, self.ppo = overlap_settings(overlap, settings.ppo)
        # Checkpoints of a LoRA run leave out the frozen base weights (the model path has them).
        self.strict_loading = self.lora is None
        components = build_components(
            policy, engine, simulator, prompt_format, advantage, rewards,
            critic=critic, group_size=group_size, kl_mode=self.ppo.kl_mode,
        )  # fmt: skip
        self.component_specs = components.specs
        self.simulator, self.prompt_format = components.simulator, components.prompt_format
        self.advantage_estimator, self.reward_functions = components.advantage, components.rewards
        self.policy_model: torch.nn.Module | None = None
        self.value_model: ValueModel | None = None
        self._reference: list[torch.nn.Module] = []  # a list keeps it out of state_dict and checkpoints
        self.tokenizer: Any = None
        # The parts, one concern each (they read the networks and the Trainer at each call)
        self.ranks = Ranks(self)
        self.rollouts = StepRollouts(
            self, self.ranks, self.rollout_runner, self.rollout_settings.seed, group_size, self.curriculum,
            self.overlap,
        )  # fmt: skip
        self.policy_update = PolicyUpdate(
            self, self.ranks, self.ppo, self.rollout_settings.temperature,
            adapter_off_reference=self.lora is not None and self.ppo.kl_coef > 0,
        )  # fmt: skip
        self.run_log = RunLog(self, self.ranks, log_samples_every_n_steps)
        self.evaluator = Evaluator(
            self, self.rollouts, self.run_log, self.ranks, self.rollout_settings, eval_temperature,
            rewards=lambda dialogues: self.dialogue_rewards(dialogues, {}), simulator=self.simulator,
            policy=policy, judge=judge,
        )  # fmt: skip

    @property
    def runner(self) -> RolloutRunner | None:
        """The rollout runner (for callbacks: e.g. `BeforeAfter` syncs its engine)."""
        return self.rollouts.runner

    @property
    def reference(self) -> torch.nn.Module | None:
        """The frozen reference network, when the KL term needs one of its own."""
        return self._reference[0] if self._reference else None

    @property
    def fatal_error(self) -> SimulatorUnavailable | None:
        """What stopped the run, if not a signal (the simulator gone)."""
        return self.rollouts.fatal_error

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator.requires_critic

    def configure_model(self) -> None:
        """Load the networks (called by Lightning once the strategy is set up; idempotent)."""
        if self.policy_model is not None:
            return
        hp = self.hparams
        networks = load_networks(
            hp.policy,
            hp.critic,
            hp.dtype,
            with_critic=self.uses_critic,
            with_reference=self.ppo.kl_coef > 0,
            lora=self.lora,
            gradient_checkpointing=hp.gradient_checkpointing,
        )
        self.tokenizer, self.policy_model, self.value_model = (
            networks.tokenizer,
            networks.policy,
            networks.value,
        )
        self._reference = [networks.reference] if networks.reference is not None else []
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
        spec = self.component_specs["engine"]
        if self.overlap is not None:
            spec = engine_for_overlap(spec)
        built = get_registry().build("engines", spec, flag="--model.engine", policy=policy)
        engine = implementing(RolloutEngine, built, "--model.engine")
        return RolloutRunner(
            policy, engine, self.simulator, self.prompt_format, self.rollout_settings,
            components=dict(self.component_specs),
        )  # fmt: skip

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self._check_training_precision()
            check_fits(self, self.trainer)  # an OOM after the queue becomes one line at start (GPUs)
        self.ranks.share_cpu_cores()
        if self._trainer is not None:
            use_rlver_checkpoint_io(self.trainer.strategy)  # `--ckpt_path <FSDP folder>` anywhere
        engine = self.component_specs["engine"]
        engine = engine if isinstance(engine, str) else engine.get("name", "?")
        with phase(f"loading {self.hparams.policy} and the {engine} engine"):
            self.configure_model()
            for reference in self._reference:
                reference.to(self.device)
            path, name = resolve_model_path(self.hparams.policy), str(self.hparams.policy)
            policy = Policy(model=self.policy_model, tokenizer=self.tokenizer, path=path, name=name)
            # asleep until the first rollout (a no-op where the engine never sleeps)
            self.rollouts.build(policy)

    def collective_timeout_seconds(self) -> float | None:
        """How long one rank may be kept by a dead simulator endpoint, plus 10 min (None: no bound).

        The others wait that long in the step's next collective; the Trainer keeps the process
        group's timeout above it, so the simulator gives up (a clean stop with `last.ckpt`) first.
        """
        stall = self.simulator.worst_case_seconds()
        return None if stall is None else stall + 600.0

    def expected_quiet_seconds(self) -> float | None:
        """The longest a healthy step goes without a turn: one simulator request with every retry
        (HangWatchdog's default timeout covers it, so a dead endpoint stops the clean way)."""
        return self.simulator.worst_request_seconds()

    def _check_training_precision(self) -> None:
        """Refuse numerics under which training silently learns nothing or clips wrongly."""
        precision = str(self.trainer.precision) if self._trainer is not None else "32-true"
        hp = self.hparams
        check_training_precision(precision, hp.dtype, self.lora is not None, hp.low_precision_weights)

    # Checkpoint weights are restored after setup(); engines with their own copy of the
    # weights (vllm) loaded them from disk, so push the restored ones in before any rollout.
    def on_train_start(self) -> None:
        # An engine that read the policy's own files holds its weights unless a checkpoint was
        # restored: a sync would only hold memory (issue 42)
        fresh = self.runner.engine.starts_with_policy_weights
        if self.global_step or self.trainer.ckpt_path or not fresh:
            self.runner.engine.sync_weights()

    def on_validation_start(self) -> None:
        self.rollouts.pipeline.wait()  # the next step's rollout, if one runs, has the engine until it ends
        self.runner.engine.sync_weights()

    def on_validation_end(self) -> None:
        self.runner.engine.release_memory()  # a checkpoint on the validation metric comes next

    def on_test_start(self) -> None:
        self.rollouts.pipeline.wait()
        self.runner.engine.sync_weights()

    def on_test_end(self) -> None:
        self.runner.engine.release_memory()

    def on_train_end(self) -> None:
        self.rollouts.pipeline.drop()

    def validation_step(self, batch: list[Any], batch_idx: int) -> None:
        self.evaluator.evaluate(batch, batch_idx, "val")

    def test_step(self, batch: list[Any], batch_idx: int) -> None:
        self.evaluator.evaluate(batch, batch_idx, "test")

    def on_test_epoch_start(self) -> None:
        self.evaluator.start_test()

    def on_test_epoch_end(self) -> None:
        self.evaluator.end_test()

    def evaluation_rollouts(
        self, profiles: Sequence[Any], seed: int, simulator: Any = None
    ) -> list[Trajectory]:
        """Dialogues with `profiles` at `eval_temperature` (greedy by default), weights as they are
        now, against the training simulator or `simulator` (for callbacks: `BeforeAfter` scores
        the policy with it, on the training users and on users it never trained against)."""
        return self.evaluator.dialogues(profiles, seed, simulator)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[RNG_KEY] = rng_state()
        self.rollouts.save_pending(checkpoint)  # the overlapped mode's next-step dialogues
        networks = {"policy_model": self.policy_model, "value_model": self.value_model}
        keep_trained_weights(checkpoint, self.lora, networks, self.trainer.strategy)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.configure_model()  # weights are loaded into the networks right after this hook
        restore_rng_state(checkpoint.get(RNG_KEY))
        self.rollouts.load_pending(checkpoint)

    def configure_optimizers(self) -> Any:
        schedule = self.optimizer_settings.lr_schedule
        if schedule != "constant" and self.trainer.max_steps <= 0:
            raise ValueError(f"--model.lr_schedule {schedule} decays over --trainer.max_steps: set it")
        total_steps = max(int(self.trainer.max_steps if self.trainer.max_steps > 0 else 1000), 1)
        return optimizers_and_schedulers(
            self.policy_model, self.value_model, self.optimizer_settings, total_steps
        )

    # ------------------------------------------------------------------ the algorithm
    def training_step(self, batch: Sequence[Profile], batch_idx: int) -> None:
        step, started, seconds = self.global_step, time.perf_counter(), {}

        # 1. a batch of profiles, each at its curriculum level; each repeated group_size times
        #    as a group sharing persona, opening and level
        dialogues = self.rollouts.step_dialogues(batch, step)
        group_ids = self.rollouts.group_ids(len(dialogues))

        # 2. roll out the dialogues with the engine plugin; a stop asked for now (SIGTERM,
        #    Ctrl-C) drops the step, which has changed nothing yet, on every rank together
        #    (overlapped: the ones rolled out during the last update; the next step's start)
        rolled_out = self.rollouts.roll_out(dialogues, step, seconds)
        if rolled_out is None:
            return  # GracefulStop checkpoints the state as of the last finished step, and stops
        trajectories, sampled_by = rolled_out
        metrics = rollout_metrics(trajectories, prefix="rollout")
        metrics.update(gaming_shares(trajectories).metrics())  # what the replies show (rollout.gaming)
        if self.curriculum is not None:
            metrics.update(
                rank_difficulty_metrics(trajectories, self.curriculum.levels, self.ranks, self.device)
            )
        metrics["rollout/simulator_errors"] = simulator_errors(trajectories)
        metrics.update(simulator_metrics(self.simulator))

        # 3. score the dialogues with the reward plugins (weighted sum); a dialogue the
        #    simulator failed on stays out of the loss, the baselines and the statistics
        update_started = time.perf_counter()
        data = training_batch(
            trajectories, group_ids, self.dialogue_rewards, self.tokenizer.pad_token_id, metrics
        )
        data.batch = data.batch.to(self.device)
        mask = data.batch.loss_mask

        # 4. old log-probs from the sampled ids (left to the update when it is one step from
        #    the sampling policy: its own pass gives them), reference log-probs and values
        on_policy = self.overlap is None and self.policy_update.starts_on_policy(data.batch)
        old_logprobs, ref_logprobs, old_values = self.policy_update.score_tokens(
            data.batch, with_policy=not on_policy
        )

        # 5. advantages on per-dialogue timelines, statistics over every rank's dialogues
        #    (overlapped: sampled by older weights, so decoupled PPO's correction)
        advantages, returns = token_advantages(
            self.advantage_estimator, data, old_logprobs, ref_logprobs, old_values, self.ppo,
            self.ranks.reduce_sum, metrics, self.rollout_settings.max_turns,
        )  # fmt: skip
        advantages = self.rollouts.corrected_advantages(
            advantages, old_logprobs, data.batch, sampled_by, metrics
        )

        # 6. PPO epochs over minibatches (in one process, a stop before the first optimizer
        #    step still drops the step); then the engine samples from the updated policy
        policy_logprobs = torch.zeros_like(data.batch.engine_logprobs) if on_policy else old_logprobs
        try:
            metrics.update(
                self.policy_update.update(
                    data.batch, old_logprobs, ref_logprobs, advantages, old_values, returns, step=step,
                    logprobs_out=policy_logprobs if on_policy else None,
                )
            )  # fmt: skip
        except StopRequested:
            self.policy_update.drop_gradients()
            return
        logprob_metrics(
            policy_logprobs, data.batch.engine_logprobs, ref_logprobs, mask, self.ppo.kl_estimator, metrics,
            self.ppo.engine_importance_cap,
        )  # fmt: skip
        sync_started = time.perf_counter()
        self.rollouts.sync_after_update(seconds)
        seconds["update"] = sync_started - update_started

        # 7. log; written once the step is done: a step dropped by a stop leaves no transcript
        seconds["step"] = time.perf_counter() - started
        metrics.update(perf_metrics(seconds, trajectories, int(mask.sum().item()) * self.ppo.ppo_epochs))
        self.run_log.append_transcripts("train", trajectories, step)
        self.run_log.log_metrics(metrics, step=step)
        get_registry().call_observers("rlver_on_train_step_end", metrics=metrics, step=step)
        self.run_log.log_samples(trajectories, step)

    def dialogue_rewards(self, trajectories: Sequence[Trajectory], metrics: dict[str, float]) -> torch.Tensor:
        """The reward plugins' weighted sum per dialogue (their parts logged into `metrics`)."""
        return score_dialogues(self.reward_functions, trajectories, metrics)
