"""What an RLVERModule is made of: its settings and plugins, built and checked from the config.

Every error names the `--model.` flag it is about. Nothing here loads a model or runs a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlver.core.interfaces import AdvantageEstimator, PromptFormat, RewardFunction, UserSimulator
from rlver.core.plugins import get_registry, implementing, plain_config, split_spec
from rlver.core.seeding import run_seed
from rlver.modeling.lora import LoraSettings
from rlver.modeling.models import DTYPES
from rlver.modeling.networks import OptimizerSettings
from rlver.rollout.overlap import OverlapSettings
from rlver.rollout.runner import RolloutSettings
from rlver.train.curriculum import DifficultyCurriculum
from rlver.train.ppo_update import PPOSettings

ComponentSpec = str | dict[str, Any]


def _as_settings(cls: type, value: Any, flag: str) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(**plain_config(value))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{flag}: {error}") from None


def build_rewards(registry: Any, specs: Sequence[ComponentSpec]) -> list[tuple[str, float, RewardFunction]]:
    """(name, weight, function) of each `--model.rewards` entry; the weight is taken out of its options."""
    if not specs:
        raise ValueError("--model.rewards: at least one reward is needed")
    built = []
    for index, spec in enumerate(specs):
        flag = f"--model.rewards[{index}]"
        name, options = split_spec(spec, flag=flag)
        weight = float(options.pop("weight", 1.0))
        function = registry.build("rewards", {"name": name, **options}, flag=flag)
        built.append((name, weight, implementing(RewardFunction, function, flag)))
    return built


def check_potential_rewards(
    rewards: list[tuple[str, float, RewardFunction]], estimator: AdvantageEstimator, advantage: Any
) -> None:
    """Refuse a discounted estimator with a reward made of potential differences (`potential_based`).

    phi(E_t) - phi(E_{t-1}) per turn sums to phi(E_T) - phi(E_0) only at gamma = 1; discounted,
    the early turns' credit would count the later potential at full weight and the sum would no
    longer be the final emotion: the run would train on another objective without a word.
    """
    gamma = estimator.gamma
    if gamma >= 1.0:
        return
    for name, _, function in rewards:
        if function.potential_based:
            advantage_name, _ = split_spec(advantage, flag="--model.advantage")
            raise ValueError(
                f"--model.rewards: {name} is potential-based only at gamma = 1 (its per-turn "
                f"differences phi(E_t) - phi(E_t-1) need gamma * phi(E_t) when discounted), but "
                f"--model.advantage {advantage_name} has gamma {gamma}: set gamma to 1.0 or use final_emotion"
            )


def overlap_settings(overlap: Any, ppo: PPOSettings) -> tuple[OverlapSettings | None, PPOSettings]:
    """`--model.overlap` as settings, and the PPO settings the overlapped mode runs with: its own
    weight pi_prox / pi_engine (`--model.overlap.max_importance_weight`) already covers the
    engine, so `--model.ppo.engine_importance_cap` is taken as 0 there (a token weighted twice
    would count the engine's mismatch twice)."""
    settings = OverlapSettings(**plain_config(overlap)) if isinstance(overlap, dict) else overlap
    if settings is not None and ppo.engine_importance_cap:
        ppo = dataclasses.replace(ppo, engine_importance_cap=0.0)
    return settings, ppo


@dataclass(frozen=True)
class TrainingSettings:
    """The module's option groups as checked settings objects."""

    rollout: RolloutSettings
    ppo: PPOSettings
    lora: LoraSettings | None
    curriculum: DifficultyCurriculum | None
    optimizer: OptimizerSettings


def checked_settings(
    *,
    dtype: str,
    group_size: int,
    rollout: Any,
    ppo: Any,
    lora: Any,
    eval_temperature: float,
    curriculum: Any,
    optimizer: Mapping[str, Any],
) -> TrainingSettings:
    """The module's options as settings objects, each value checked (ValueError naming the flag).

    `optimizer`: the flat `--model.actor_lr`, ... values by name (`OptimizerSettings`' fields).
    """
    if dtype not in DTYPES:
        raise ValueError(f"--model.dtype ({dtype!r}) must be one of {', '.join(DTYPES)}")
    if group_size < 1:
        raise ValueError(f"--model.group_size ({group_size}) must be >= 1")
    optimizer_settings = OptimizerSettings(**optimizer)
    rollout_settings = _as_settings(RolloutSettings, rollout, "--model.rollout")
    if rollout_settings.seed is None:  # the run's seed: --seed_everything varies the sampling too
        rollout_settings = dataclasses.replace(rollout_settings, seed=run_seed())
    ppo_settings = _as_settings(PPOSettings, ppo, "--model.ppo")
    lora_settings = _as_settings(LoraSettings, lora, "--model.lora") if lora is not None else None
    if eval_temperature < 0:
        raise ValueError(f"--model.eval_temperature ({eval_temperature}) must be >= 0")
    levels = DifficultyCurriculum.from_config(plain_config(curriculum)) if curriculum is not None else None
    return TrainingSettings(rollout_settings, ppo_settings, lora_settings, levels, optimizer_settings)


@dataclass
class Components:
    specs: dict[str, Any]  # each component's config, as the rollout records name them
    simulator: UserSimulator
    prompt_format: PromptFormat
    advantage: AdvantageEstimator
    rewards: list[tuple[str, float, RewardFunction]]


def build_components(
    policy: str,
    engine: ComponentSpec,
    simulator: ComponentSpec,
    prompt_format: ComponentSpec,
    advantage: ComponentSpec,
    rewards: list[ComponentSpec] | None,
    *,
    critic: str | None,
    group_size: int,
    kl_mode: str,
) -> Components:
    """The plugins from the registry (the engine only checked: it needs the loaded policy)."""
    registry = get_registry()
    specs = {
        "model": policy,
        "engine": plain_config(engine),
        "simulator": plain_config(simulator),
        "prompt_format": plain_config(prompt_format),
        "advantage": plain_config(advantage),
    }
    built_simulator = implementing(
        UserSimulator,
        registry.build("simulators", specs["simulator"], flag="--model.simulator"),
        "--model.simulator",
    )
    built_format = implementing(
        PromptFormat,
        registry.build("formats", specs["prompt_format"], flag="--model.prompt_format"),
        "--model.prompt_format",
    )
    registry.check("engines", specs["engine"], flag="--model.engine", context={"policy"})
    estimator = implementing(
        AdvantageEstimator, registry.build("advantages", specs["advantage"], flag="--model.advantage"),
        "--model.advantage",
    )  # fmt: skip
    reward_functions = build_rewards(
        registry, plain_config(rewards) if rewards is not None else ["final_emotion"]
    )
    check_potential_rewards(reward_functions, estimator, specs["advantage"])
    if not estimator.requires_critic and critic is not None:
        raise ValueError("--model.critic is set but the advantage estimator trains no critic")
    if group_size < 2 and estimator.requires_groups:
        advantage_name, _ = split_spec(specs["advantage"], flag="--model.advantage")
        raise ValueError(f"--model.group_size ({group_size}) must be >= 2 for {advantage_name}")
    if kl_mode == "in-reward" and estimator.requires_groups:
        # A group whose rewards tie would be normalised on KL noise alone: +-1 advantages.
        raise ValueError(
            "--model.ppo.kl_mode in-reward needs a critic (advantage: gae); a group baseline "
            "takes the KL in the loss (kl_mode: in-loss)"
        )
    return Components(specs, built_simulator, built_format, estimator, reward_functions)
