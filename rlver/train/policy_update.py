"""The networks' side of a training step: token scores before the update, the PPO epochs, the
optimizer steps. `PolicyUpdate` is a part of `RLVERModule` (`module.policy_update`).

It holds no weights: the module owns the networks (Lightning saves, shards and moves them) and
its optimizers; this part calls `scoring.score_tokens` and `ppo_update.ppo_update` with them, the
PPO settings and the ranks' collectives.
"""

from __future__ import annotations

from typing import Any

import torch

from rlver.modeling.batch import RolloutBatch
from rlver.train.ppo_update import PPOSettings, ppo_update
from rlver.train.ranks import Ranks
from rlver.train.scoring import on_policy_update, score_tokens

TokenScores = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


class PolicyUpdate:
    """Scores and updates the module's policy (and critic) with its optimizers.

    Args:
        module: The LightningModule: its networks, optimizers, schedulers and Trainer strategy.
        ranks: The module's collectives.
        settings: The update's settings (`--model.ppo`).
        temperature: The rollouts' sampling temperature (log-probs are taken at it; 0 counts as 1).
        adapter_off_reference: With LoRA and a KL term, the reference is the policy with its
            adapter off (no second network).
    """

    def __init__(
        self,
        module: Any,
        ranks: Ranks,
        settings: PPOSettings,
        temperature: float,
        adapter_off_reference: bool,
    ) -> None:
        self.module, self.ranks, self.settings = module, ranks, settings
        self.temperature = temperature or 1.0
        self.adapter_off_reference = adapter_off_reference

    def starts_on_policy(self, batch: RolloutBatch) -> bool:
        """One epoch of one minibatch from the sampling policy: the update's own pass gives the old
        log-probs, and the scoring pass leaves them out."""
        return on_policy_update(
            self.settings, batch.num_sequences, self.module.policy_model, self.ranks.reduce_max
        )

    def score_tokens(self, batch: RolloutBatch, with_policy: bool = True) -> TokenScores:
        """Old log-probs (with `with_policy`), reference log-probs and values of the batch's tokens."""
        module = self.module
        return score_tokens(
            batch,
            module.policy_model,
            micro_batch_size=self.settings.micro_batch_size,
            temperature=self.temperature,
            value_model=module.value_model,
            reference=module.reference,
            adapter_off_reference=self.adapter_off_reference,
            reduce_max=self.ranks.reduce_max,
            with_policy=with_policy,
            head_at_loss_positions=self.settings.head_at_loss_positions,
            share_prefix=self.settings.share_prompt_prefix,
        )

    def update(
        self,
        batch: RolloutBatch,
        old_logprobs: torch.Tensor | None,
        ref_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        old_values: torch.Tensor | None,
        returns: torch.Tensor | None,
        step: int,
        logprobs_out: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """The PPO epochs over minibatches, with the module's networks, optimizers and ranks."""
        optimizers, schedulers = self.optimizers(), self.module.lr_schedulers()
        return ppo_update(
            batch, old_logprobs, ref_logprobs, advantages, old_values, returns,
            policy_model=self.module.policy_model, actor_optimizer=optimizers[0],
            value_model=self.module.value_model,
            critic_optimizer=optimizers[1] if len(optimizers) > 1 else None,
            schedulers=schedulers if isinstance(schedulers, list) else [schedulers],
            settings=self.settings, step=step, temperature=self.temperature,
            # looked up at each call: a test may stand in for the optimizer step
            lockstep=self.ranks.lockstep(lambda optimizer, last: self.optimizer_step(optimizer, last)),
            logprobs_out=logprobs_out,
        )  # fmt: skip

    def optimizer_step(self, optimizer: Any, counts_as_global_step: bool) -> None:
        if counts_as_global_step:
            optimizer.step()
        else:
            # Same strategy/precision path, but Lightning's step counter is left alone.
            self.module.trainer.strategy.optimizer_step(optimizer.optimizer, lambda: None)

    def optimizers(self) -> list[Any]:
        optimizers = self.module.optimizers()
        return optimizers if isinstance(optimizers, list) else [optimizers]

    def drop_gradients(self) -> None:
        """A stop during the update: the step is dropped, so are its gradients."""
        for optimizer in self.optimizers():
            optimizer.zero_grad()
