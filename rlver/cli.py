"""The `rlver` command: the top layer, the console script's entry and `python -m rlver.cli`.

`fit`, `validate` and `test` are LightningCLI subcommands over RLVERModule and
ProfileDataModule; `plugins`, `rollout`, `export`, `score`, `eval`, `plan` and `ablate` are rlver's own
(`rlver.commands`). Plugins are loaded before any parser is built, so their component names
and options are known when a config is read.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlver.core.console import quiet_libraries, take_verbose_flag

quiet_libraries()  # before torch loads (below): its C++ warnings read their level once

from rlver import __version__  # noqa: E402
from rlver.checkpoint.io import CheckpointWriteError  # noqa: E402
from rlver.commands.ablate import ablate_command  # noqa: E402
from rlver.commands.capabilities import eval_command  # noqa: E402
from rlver.commands.probe import probe_command  # noqa: E402
from rlver.commands.recipes import _lightning_cli_class, check_config_files, parse_recipe  # noqa: E402
from rlver.commands.rollout import build_runner, rollout_command, rollout_parser  # noqa: E402
from rlver.commands.standalone import export_command, plan_command, plugins_command, score_command  # noqa: E402
from rlver.core.interfaces import SimulatorUnavailable  # noqa: E402
from rlver.core.plugins import PluginError, get_registry  # noqa: E402
from rlver.data.datamodule import ProfileDataModule  # noqa: E402
from rlver.modeling.models import ModelError  # noqa: E402
from rlver.train.module import RLVERModule  # noqa: E402

# What tests and scripts import from here, wherever it lives.
__all__ = ["build_runner", "check_config_files", "main", "parse_recipe", "rollout_parser"]


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


# --------------------------------------------------------------------------- entry point
COMMANDS = {
    "plugins": plugins_command,
    "rollout": rollout_command,
    "export": export_command,
    "score": score_command,
    "plan": plan_command,
    "eval": eval_command,
    "ablate": ablate_command,
    "probe": probe_command,
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
  eval       general capabilities (maths, code) through lm-eval; --compare BEFORE AFTER
  plan       GPU memory of each phase of a recipe's training step; exit 1 if one does not fit
  plugins    list installed plugins and what they register (JSON)
  ablate     train arms x seeds (rlver fit each), resumable; tables with paired 95% intervals
  probe      scripted responders (stock sympathy, parroting, ...) against a recipe's users

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
