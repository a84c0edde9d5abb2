"""The `rlver` command.

`fit`, `validate` and `test` are LightningCLI subcommands over RLVERModule and
ProfileDataModule; `plugins`, `rollout`, `export` and `score` are rlver's own. Plugins
are loaded before any parser is built, so their component names and options
are known when a config is read.
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from rlver.core.console import quiet_libraries, take_verbose_flag

quiet_libraries()  # before torch loads (below): its C++ warnings read their level once

from jsonargparse import ActionConfigFile, ArgumentParser, Namespace  # noqa: E402

from rlver import __version__  # noqa: E402
from rlver.checkpoint.io import CheckpointWriteError  # noqa: E402
from rlver.core.interfaces import SimulatorUnavailable  # noqa: E402
from rlver.core.plugins import PluginError, get_registry, plain_config  # noqa: E402
from rlver.core.trajectory import summarize  # noqa: E402
from rlver.data.datamodule import ProfileDataModule  # noqa: E402
from rlver.evaluate.intervals import PairedChange, mean_interval, paired_by_key, per_user_means  # noqa: E402
from rlver.modeling.models import ModelError  # noqa: E402
from rlver.parallel.allocator import keep_freed_memory  # noqa: E402
from rlver.rollout.runner import RolloutRunner  # noqa: E402
from rlver.rollout.transcripts import TranscriptWriter  # noqa: E402
from rlver.train.module import RLVERModule  # noqa: E402

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


# --------------------------------------------------------------------------- rlver plugins
def plugins_command(argv: Sequence[str]) -> int:
    parser = ArgumentParser(prog="rlver plugins", description="List installed plugins as JSON.")
    parser.parse_args(list(argv))
    print(json.dumps(get_registry().describe(), indent=2))
    return 0


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
    # The same model and data sections as `rlver fit`, so one recipe serves both commands.
    parser.add_class_arguments(RLVERModule, "model")
    parser.add_class_arguments(ProfileDataModule, "data")
    for section in _TRAINING_SECTIONS:
        parser.add_argument(
            f"--{section}", type=Any, default=None, help="(read by `rlver fit`; ignored here)"
        )
    return parser


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
                batch, seed=runner.settings.seed + start, group_size=cfg.repeat, on_turn=progress
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


# --------------------------------------------------------------------------- rlver export
def export_command(argv: Sequence[str]) -> int:
    parser = ArgumentParser(
        prog="rlver export", description="Write a checkpoint's policy as a HF model folder."
    )
    parser.add_argument("--ckpt", type=str, required=True, help="A checkpoint written by `rlver fit`.")
    parser.add_argument("--out", type=str, required=True, help="Folder to write (model + tokenizer).")
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="A LoRA run: write only the adapter (peft format) instead of merged weights.",
    )
    cfg = parser.parse_args(list(argv))
    from rlver.checkpoint.export import export_checkpoint

    out = export_checkpoint(cfg.ckpt, cfg.out, adapter=cfg.adapter)
    print(f"exported {cfg.ckpt} -> {out}")
    return 0


# --------------------------------------------------------------------------- rlver score
def score_command(argv: Sequence[str]) -> int:
    from rlver.evaluate.score import (
        leaderboard_markdown,
        leaderboard_rows,
        load_scored_file,
        plot_trajectories,
    )

    parser = ArgumentParser(
        prog="rlver score",
        description="Sentient-benchmark scores of transcript files (SAGE records or rlver transcripts): "
        "a Markdown leaderboard (Score = mean final emotion, Success >= 100, Failure < 10) "
        "and an emotion-trajectory plot.",
    )
    parser.add_argument(
        "files", nargs="+", type=str, help="Transcript files (JSONL); each is one row, named by its stem."
    )
    parser.add_argument(
        "--plot",
        type=str,
        default="score.png",
        help="PNG of the mean emotion by user message; 'none' skips it.",
    )
    parser.add_argument(
        "--by",
        type=str | None,
        default=None,
        help="Also split each file by this record field (e.g. theme, character).",
    )
    cfg = parser.parse_args(list(argv))
    files = [load_scored_file(path) for path in cfg.files]
    print(leaderboard_markdown(leaderboard_rows(files)))
    if cfg.by:
        print()
        print(leaderboard_markdown(leaderboard_rows(files, by=cfg.by), by=cfg.by))
    if cfg.plot.lower() != "none":
        print(f"\nplot: {plot_trajectories(files, cfg.plot)}")
    return 0


# --------------------------------------------------------------------------- rlver plan
def plan_command(argv: Sequence[str]) -> int:
    from rlver.plan.memory_plan import GIB, failures, format_plan, plan_recipe

    parser = ArgumentParser(
        prog="rlver plan",
        description="GPU memory of each phase of a training step, per GPU (exit 1: one does not fit).",
    )
    parser.add_argument("--config", type=str, required=True, help="A recipe YAML (as `rlver fit` reads it).")
    parser.add_argument(
        "--gpu-memory-gib", type=float | None, default=None, help="GPU memory (default: this GPU's, else 80)."
    )
    parser.add_argument(
        "--world-size", type=int | None, default=None, help="GPUs in all (default: devices x num_nodes)."
    )
    cfg = parser.parse_args(list(argv))
    memory = cfg.gpu_memory_gib
    if memory is None:
        import torch

        memory = torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else 80.0
    if memory <= 0:
        parser.error(f"--gpu-memory-gib ({memory}) must be > 0")
    check_config_files(["--config", cfg.config])
    with warnings.catch_warnings():  # LightningCLI warns that argv is not the recipe's own
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        config = parse_recipe(cfg.config)
    arch, shape, phases = plan_recipe(config, gpu_memory_gib=memory, world_size=cfg.world_size)
    print(f"rlver plan: {cfg.config}")
    print(format_plan(arch, shape, phases))
    return 1 if failures(phases) else 0


# --------------------------------------------------------------------------- fit / validate / test
def _lightning_cli_class(command: str | None = None) -> type:
    """rlver's LightningCLI; with `command` ("fit", "validate", "test") the parser knows that one."""
    from lightning.pytorch.cli import LightningCLI

    class RLVERCLI(LightningCLI):
        """LightningCLI over RLVERModule and ProfileDataModule with rlver's defaults."""

        @staticmethod
        def subcommands() -> dict[str, set[str]]:
            # Lightning builds a full parser per trainer method (fit, validate, test, predict) at
            # every start, ~0.2 s each, though a launch runs one (and rlver never runs predict).
            every = LightningCLI.subcommands()
            return {command: every[command]} if command in every else every

        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.set_defaults({"trainer.num_sanity_val_steps": 0, "trainer.max_steps": 1000})

        def _parse_ckpt_path(self) -> None:
            """The run's settings are the config's, never a checkpoint's: Lightning would replace
            every `model.*` value with the one saved in a checkpoint *file* (not for `last`), so
            a run moved to another model folder, or resumed with a changed setting, would
            silently use the old one, depending on how the checkpoint was named."""

    return RLVERCLI


def check_config_files(argv: Sequence[str]) -> None:
    """Every `--config FILE` reads as YAML, or a ValueError names the file, line and column.

    jsonargparse would report a YAML error against "<unicode string>", without the file.
    """
    import yaml

    paths = [value for flag, value in itertools.pairwise(argv) if flag == "--config"]
    paths += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                _check_keys(yaml.safe_load(handle), path, ())
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"--config {path}: cannot read it ({error})") from None
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark or error.context_mark
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
            problem = " ".join(str(part) for part in (error.context, error.problem) if part)
            raise ValueError(f"{where}: invalid YAML: {problem}") from None
        except yaml.YAMLError as error:
            raise ValueError(f"{path}: invalid YAML: {error}") from None


def _check_keys(tree: Any, path: str, where: tuple[str, ...]) -> None:
    """Option names are strings (YAML reads `1:` or `null:` as a number or None)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if not isinstance(key, str):
                under = ".".join(where) or "the top level"
                raise ValueError(f"{path}: option name {key!r} under {under} is not a name")
            _check_keys(value, path, (*where, key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            _check_keys(value, path, (*where, str(index)))


def lightning_command(argv: Sequence[str]) -> int:
    get_registry()  # plugins first: their names and options must be known to the parser
    check_config_files(argv)
    from rlver.train.trainer import Trainer

    cli = _lightning_cli_class(argv[0])(
        RLVERModule,
        ProfileDataModule,
        trainer_class=Trainer,
        # From the console script argv *is* sys.argv[1:]; passing it again only makes Lightning warn.
        args=None if list(argv) == sys.argv[1:] else list(argv),
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": "rlver"},
    )
    failed_ranks = cli.trainer.wait_for_launched_ranks()  # {} on every process but the launching one
    fatal = getattr(cli.model, "fatal_error", None)
    if fatal is not None:  # the run stopped itself (with last.ckpt) instead of going on without a user
        if cli.trainer.global_rank != 0:
            return 1  # rank 0 says it, once
        raise fatal
    for local_rank, code in failed_ranks.items():
        print(f"rlver {argv[0]}: error: local rank {local_rank} exited with status {code}", file=sys.stderr)
    return 1 if failed_ranks else 0


def parse_recipe(path: str) -> Namespace:
    """Parse and type-check a recipe as `rlver fit` does, without building anything."""
    return _recipe_parser().parse_args(["--config", path])


class _ParserBuilt(Exception):
    def __init__(self, parser: ArgumentParser) -> None:
        self.parser = parser


@functools.cache
def _recipe_parser() -> ArgumentParser:
    """`rlver fit`'s parser, built once per process: building it is half the time of a parse."""
    from rlver.train.trainer import Trainer

    class BuildOnly(_lightning_cli_class()):  # type: ignore[misc, valid-type]
        def parse_arguments(self, parser: ArgumentParser, args: Any) -> None:
            raise _ParserBuilt(parser)  # LightningCLI parses right after building the parser

    try:
        BuildOnly(
            RLVERModule,
            ProfileDataModule,
            trainer_class=Trainer,
            run=False,
            parser_kwargs={"prog": "rlver", "exit_on_error": False},
        )
    except _ParserBuilt as built:
        return built.parser
    raise AssertionError("LightningCLI no longer calls parse_arguments")


# --------------------------------------------------------------------------- entry point
COMMANDS = {
    "plugins": plugins_command,
    "rollout": rollout_command,
    "export": export_command,
    "score": score_command,
    "plan": plan_command,
}
TRAINER_COMMANDS = ("fit", "validate", "test")

USAGE = f"""usage: rlver <command> [options]

rlver {__version__}: RL for empathetic chat models with verifiable emotion rewards.

commands:
  fit        train (PPO or GRPO) with a recipe: rlver fit --config recipes/quickstart.yaml
  validate   run validation dialogues with a model or checkpoint
  test       run test dialogues (Sentient: SAGE records and Score / Success / Failure)
  rollout    run dialogues, write transcripts, print a summary
  export     write a checkpoint's policy as a Hugging Face folder
  score      score transcript files (Sentient benchmark): leaderboard and emotion plot
  plan       GPU memory of each phase of a recipe's training step; exit 1 if one does not fit
  plugins    list installed plugins and what they register (JSON)

`--verbose` anywhere (or RLVER_VERBOSE=1) also shows the libraries' own logging and warnings.

`rlver <command> --help` shows a command's options."""


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # Lightning reads sys.argv itself (and re-runs it for other ranks)
        sys.argv[1:] = take_verbose_flag(sys.argv[1:])
        args = sys.argv[1:]
    else:
        args = take_verbose_flag(list(argv))
    quiet_libraries()
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if args[0] == "--version":
        print(__version__)
        return 0
    command = args[0]
    try:
        if command in COMMANDS:
            return COMMANDS[command](args[1:])
        if command in TRAINER_COMMANDS:
            return lightning_command(args)
    except (PluginError, ModelError, ValueError) as error:
        print(f"rlver {command}: error: {error}", file=sys.stderr)
        return 2
    except (SimulatorUnavailable, CheckpointWriteError) as error:
        print(f"rlver {command}: error: {error}", file=sys.stderr)
        return 1
    print(f"rlver: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
