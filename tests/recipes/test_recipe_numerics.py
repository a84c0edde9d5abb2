"""The recipes' own numerics: their weights move at their learning rate, and what cannot learn is refused.

Every recipe is built as `rlver fit` builds it (the recipe's dtype, precision, LoRA, critic and
optimizer), on a tiny random model (1 layer, a 512-word vocabulary: bf16 matmuls are emulated
and slow on CPUs without native bf16, so the bf16 work is kept small, not dropped).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlver.cli import parse_recipe
from rlver.core.plugins import plain_config
from rlver.train.module import RLVERModule
from rlver.train.scoring import eval_mode as _eval_mode
from tests.conftest import REPO, small_llama

RECIPES = sorted(path.stem for path in (REPO / "recipes").glob("*.yaml"))
EVALUATION_ONLY = {"sentient_eval", "sentient_eval_own_prompts"}  # `rlver test` recipes: never trained
VOCAB = 512


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """A 1-layer Llama with a 512-word vocabulary and the embedded tokenizer (ids below 512 only)."""
    from transformers import AutoTokenizer

    from rlver.modeling.models import resolve_model_path

    folder = tmp_path_factory.mktemp("small-vocab")
    small_llama().save_pretrained(folder)
    AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct")).save_pretrained(folder)
    return folder


def recipe_module(recipe: str, model_dir, **overrides) -> tuple[RLVERModule, object]:
    """The recipe's module and Trainer, with only the model (and the simulator: no endpoint) swapped."""
    from rlver.train.trainer import Trainer

    config = parse_recipe(str(REPO / "recipes" / f"{recipe}.yaml"))
    options = plain_config(config.model)
    options.update(policy=str(model_dir), simulator={"name": "embedded", "judge": "rubric"}, **overrides)
    module = RLVERModule(**options)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        precision=config.trainer.precision,
        max_steps=config.trainer.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    module.trainer = trainer
    return module, trainer


def changed_fraction(before: dict[str, torch.Tensor], module: torch.nn.Module) -> float:
    after = {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}
    changed = sum(int((after[name] != before[name]).sum()) for name in before)
    return changed / sum(t.numel() for t in before.values())


@pytest.mark.parametrize("recipe", sorted(set(RECIPES) - EVALUATION_ONLY))
def test_one_step_at_the_recipes_learning_rate_moves_its_weights(recipe, small_vocab_model):
    """At lr 1e-6, bf16 master weights move 2% of their entries; float32 ones nearly all."""
    module, trainer = recipe_module(recipe, small_vocab_model)
    module._check_training_precision()  # the recipe is accepted as it is
    module.configure_model()
    optimizers, _ = module.configure_optimizers()
    networks = [module.policy_model] + ([module.value_model] if module.value_model is not None else [])
    rates = [module.hparams.actor_lr, module.hparams.critic_lr]
    for optimizer, rate in zip(optimizers, rates):
        for group in optimizer.param_groups:
            group["lr"] = rate  # the recipe's rate itself, past its warmup
    before = [
        {name: p.detach().clone() for name, p in net.named_parameters() if p.requires_grad}
        for net in networks
    ]
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    with trainer.precision_plugin.forward_context():
        logits = module.policy_model(input_ids=ids, attention_mask=attention).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
        if module.value_model is not None:
            loss = loss + module.value_model(ids, attention).pow(2).mean()
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
    for net, start in zip(networks, before, strict=True):
        assert changed_fraction(start, net) >= 0.9, (recipe, type(net).__name__, changed_fraction(start, net))


@pytest.mark.parametrize("recipe", sorted(EVALUATION_ONLY))
def test_evaluation_recipes_in_bf16_are_refused_for_training(recipe, small_vocab_model):
    module, _ = recipe_module(recipe, small_vocab_model)
    with pytest.raises(ValueError, match="--model.dtype bfloat16: full fine-tuning .*low_precision_weights"):
        module._check_training_precision()


def test_bf16_weights_train_only_when_asked_for(small_vocab_model):
    module, _ = recipe_module("ppo_think", small_vocab_model, dtype="bfloat16")
    with pytest.raises(ValueError, match="rounds away; use dtype float32"):
        module._check_training_precision()
    module, _ = recipe_module("ppo_think", small_vocab_model, dtype="bfloat16", low_precision_weights=True)
    module._check_training_precision()
    module, _ = recipe_module("ppo_think_lora", small_vocab_model)  # a bf16 base under LoRA is frozen
    module._check_training_precision()


@pytest.mark.parametrize(
    ("precision", "message"),
    [("16-mixed", "16-mixed is not supported"), ("bf16-true", "bf16-true: full fine-tuning")],
)
def test_precisions_that_cannot_train_are_refused(precision, message, small_vocab_model):
    module, _ = recipe_module("grpo_nothink", small_vocab_model)
    module.trainer = SimpleNamespace(precision=precision)
    with pytest.raises(ValueError, match=message):
        module._check_training_precision()


def test_the_grpo_guard_sees_a_spec_with_options():
    spec = {"name": "grpo", "scale_by_std": True, "eps": 1e-6}  # as every recipe writes it
    with pytest.raises(ValueError, match=r"--model.group_size \(1\) must be >= 2 for grpo"):
        RLVERModule(advantage=spec, group_size=1, simulator={"name": "embedded", "judge": "rubric"})


def test_in_reward_kl_is_refused_with_a_group_baseline():
    with pytest.raises(ValueError, match="kl_mode in-reward needs a critic"):
        RLVERModule(
            advantage="grpo",
            ppo={"kl_coef": 0.01, "kl_mode": "in-reward"},
            simulator={"name": "embedded", "judge": "rubric"},
        )


def test_old_logprobs_are_scored_with_dropout_off(small_vocab_model):
    """With LoRA dropout the train-mode log-probs are random; the scored ones are the eval-mode ones."""
    from rlver.modeling.batch import token_logprobs

    module, _ = recipe_module(
        "ppo_think_lora", small_vocab_model, lora={"rank": 4, "alpha": 8, "dropout": 0.5}
    )
    module.configure_model()
    model = module.policy_model
    with torch.no_grad():  # B starts at 0: a nonzero adapter makes its dropout visible
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    attention = torch.ones_like(ids)
    with torch.no_grad():
        training = token_logprobs(model(input_ids=ids, attention_mask=attention).logits, ids)
        with _eval_mode(model):
            evaluated = token_logprobs(model(input_ids=ids, attention_mask=attention).logits, ids)
    assert not torch.allclose(training, evaluated)  # dropout is active in train mode
    batch = SimpleNamespace(
        input_ids=ids, attention_mask=attention, loss_mask=torch.ones_like(ids), num_sequences=1
    )
    module.ranks.reduce_max = lambda value: value
    old, _, values = module.policy_update.score_tokens(batch)
    torch.testing.assert_close(old, evaluated)
    assert values is not None and model.training and module.value_model.training  # modes restored
    from rlver.train.scoring import on_policy_update

    # the update's train-mode log-probs are not the sampling policy's: the scoring pass stays
    assert not on_policy_update(module.ppo, 1, model, lambda value: value)


def test_rollouts_with_an_engine_of_its_own_run_outside_autocast(small_vocab_model):
    from rlver.core.interfaces import RolloutEngine

    seen = []

    class OwnWeightsEngine(RolloutEngine):
        def generate(self, prompts, sampling):
            seen.append(torch.is_autocast_enabled("cpu"))
            return []

        def sync_weights(self) -> None:
            pass

    module, _ = recipe_module("grpo_nothink", small_vocab_model)
    module.rollouts.runner = SimpleNamespace(engine=OwnWeightsEngine())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as Lightning runs training_step
        module.runner.engine.generate([], None)
        with module.rollouts.generation_weights():
            module.runner.engine.generate([], None)
    assert seen == [True, False]
