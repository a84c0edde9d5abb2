"""`rlver rollout`: dialogues with a recipe's model and users, transcripts, a summary, `--compare`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser, Namespace

from rlver.core.plugins import get_registry, plain_config
from rlver.core.seeding import run_seed
from rlver.core.trajectory import summarize
from rlver.data.datamodule import ProfileDataModule
from rlver.evaluate.intervals import PairedChange, mean_interval, paired_by_key, per_user_means
from rlver.parallel.allocator import keep_freed_memory
from rlver.rollout.gaming import gaming_shares
from rlver.rollout.runner import RolloutRunner
from rlver.rollout.transcripts import TranscriptWriter
from rlver.train.module import RLVERModule

# Sections of a training config that `rlver rollout` reads past without using.
_TRAINING_SECTIONS = ("trainer", "optimizer", "lr_scheduler", "ckpt_path", "seed_everything")


def build_runner(model_cfg: Namespace, device: str, ckpt: str | None = None) -> RolloutRunner:
    """The module's components (cheap: a config error surfaces here, before the model loads) over a policy."""
    from rlver.modeling.models import load_policy

    if device == "cpu":
        keep_freed_memory()  # as `rlver fit` on CPU (rlver.parallel.allocator)
    options = plain_config(model_cfg)
    module = RLVERModule(**options)
    policy = load_policy(options["policy"], dtype=options["dtype"], device=device)
    if ckpt is not None:
        from rlver.checkpoint.export import load_policy_weights

        load_policy_weights(policy.model, ckpt)
        policy.name = f"{policy.name}@{ckpt}"
    runner = module.rollout_runner(policy)
    if ckpt is not None:
        runner.engine.sync_weights()  # engines with their own copy loaded the weights from disk
    runner.components["model"] = policy.name
    return runner


def _resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device


# --------------------------------------------------------------------------- rlver rollout
def rollout_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="rlver rollout",
        description="Run dialogues with simulated users, write transcripts, print a summary.",
    )
    parser.add_argument(
        "--config", action=ActionConfigFile, help="A recipe YAML (the same file `rlver fit` reads)."
    )
    parser.add_argument("--out", type=str, required=True, help="Transcript file to write (JSONL).")
    parser.add_argument(
        "--split",
        type=str,
        default="test",
        choices=["train", "val", "test"],
        help="Which profiles of the data section to talk to.",
    )
    parser.add_argument("--limit", type=int, default=0, help="Only the first N profiles (0: all).")
    parser.add_argument("--repeat", type=int, default=1, help="Dialogues per profile (a group, as in GRPO).")
    parser.add_argument(
        "--compare",
        type=str | None,
        default=None,
        help="Transcripts of an earlier `rlver rollout` with the same users (say, the untrained policy):"
        " print the paired change of each user's mean final emotion, with its 95%% interval.",
    )
    parser.add_argument("--device", type=str, default="auto", help="cpu, cuda, or auto.")
    parser.add_argument(
        "--batch_size", type=int, default=16, help="Dialogues run together (one engine call per turn)."
    )
    parser.add_argument(
        "--ckpt",
        type=str | None,
        default=None,
        help="Talk with the policy of an `rlver fit` checkpoint instead of --model.policy's weights.",
    )
    add_recipe_sections(parser)
    return parser


def add_recipe_sections(parser: ArgumentParser) -> None:
    """The same model and data sections as `rlver fit`, so one recipe serves every command;
    the training-only sections are read past."""
    parser.add_class_arguments(RLVERModule, "model")
    parser.add_class_arguments(ProfileDataModule, "data")
    for section in _TRAINING_SECTIONS:
        parser.add_argument(
            f"--{section}", type=Any, default=None, help="(read by `rlver fit`; ignored here)"
        )


def rollout_command(argv: Sequence[str]) -> int:
    from tqdm import tqdm

    parser = rollout_parser()
    cfg = parser.parse_args(list(argv))
    if cfg.limit < 0:
        parser.error(f"--limit ({cfg.limit}) must be >= 0")
    if cfg.repeat < 1:
        parser.error(f"--repeat ({cfg.repeat}) must be >= 1")
    if cfg.batch_size < 1:
        parser.error(f"--batch_size ({cfg.batch_size}) must be >= 1")
    registry = get_registry()
    data = ProfileDataModule(**cfg.data.as_dict())
    profiles = data.profiles(cfg.split)
    if cfg.limit:
        profiles = profiles[: cfg.limit]
    runner = build_runner(cfg.model, _resolve_device(cfg.device), ckpt=cfg.ckpt)
    dialogues = [p for p in profiles for _ in range(cfg.repeat)]
    # Whole groups per engine batch: a group's members share their opening.
    batch_size = -(-cfg.batch_size // cfg.repeat) * cfg.repeat
    trajectories = []
    with TranscriptWriter(cfg.out) as writer, tqdm(total=len(dialogues), desc="dialogues", unit="dlg") as bar:
        for start in range(0, len(dialogues), batch_size):
            batch = dialogues[start : start + batch_size]
            finished_before = bar.n

            def progress(turn: int, active: int, size: int = len(batch), base: int = finished_before) -> None:
                bar.n = base + size - active
                bar.set_postfix(turn=turn)
                bar.refresh()

            results = runner.run(
                batch, seed=run_seed(runner.settings.seed) + start, group_size=cfg.repeat, on_turn=progress
            )
            bar.n = finished_before + len(batch)
            bar.refresh()
            writer.write(results)
            registry.call_observers("rlver_on_rollout_end", trajectories=results, step=None)
            trajectories.extend(results)
    simulator_counts = runner.simulator.drain_metrics()
    runner.simulator.close()
    print(format_summary(summarize(trajectories), cfg.out))
    scores = per_user_means([t.profile.id for t in trajectories], [t.final_emotion for t in trajectories])
    interval = mean_interval(list(scores.values())).format()
    print(f"{'per-user mean':<18}  {interval}  (95% interval over {len(scores)} users)")
    if cfg.compare is not None:
        print(f"{'change vs compare':<18}  {compared_change(cfg.compare, scores).format()}")
    print(gaming_shares(trajectories).line())
    errors = sum(t.termination == "simulator_error" for t in trajectories)
    print(f"{'simulator errors':<18}  {errors:d}")
    for name, value in simulator_counts.items():
        print(f"simulator {name:<8}  {value:g}")
    return 0


def compared_change(path: str, scores: dict[str, float]) -> PairedChange:
    """This run's per-user scores against those in the transcripts at `path` (paired by profile id)."""
    from rlver.rollout.transcripts import read_numbered_transcripts

    ids, finals = [], []
    for line_number, record in read_numbered_transcripts(path):
        if not isinstance(record, dict) or "profile_id" not in record or "final_emotion" not in record:
            raise SystemExit(
                f"rlver rollout: --compare {path}:{line_number}: not an `rlver rollout` transcript"
            )
        ids.append(record["profile_id"])
        finals.append(float(record["final_emotion"]))
    try:
        return paired_by_key(per_user_means(ids, finals), scores)
    except ValueError as error:
        raise SystemExit(f"rlver rollout: --compare {path}: {error}") from None


def format_summary(summary: dict[str, float], out: str) -> str:
    rows = [
        ("dialogues", f"{summary['dialogues']:d}"),
        ("mean final emotion", f"{summary.get('mean_final_emotion', 0.0):.1f}"),
        ("success (100)", f"{summary.get('success', 0):d}"),
        ("failure (<10)", f"{summary.get('failure', 0):d}"),
        ("mean turns", f"{summary.get('mean_turns', 0.0):.2f}"),
        ("format violations", f"{summary.get('format_violations', 0):d}"),
        ("transcripts", out),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
