"""Recipes as `rlver fit` reads them: rlver's LightningCLI, YAML checked with file and line, and a
recipe parsed and type-checked without building anything (`parse_recipe`)."""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Sequence
from typing import Any

from jsonargparse import ArgumentParser, Namespace

from rlver.core.legacy_paths import legacy_module_paths
from rlver.data.datamodule import ProfileDataModule
from rlver.train.module import RLVERModule


def _lightning_cli_class(command: str | None = None) -> type:
    """rlver's LightningCLI; with `command` ("fit", "validate", "test") the parser knows that one."""
    from lightning.pytorch.cli import LightningCLI

    class RLVERCLI(LightningCLI):
        """LightningCLI over RLVERModule and ProfileDataModule with rlver's defaults."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # No `--optimizer` / `--lr_scheduler`: the module builds its own (AdamW per network,
            # warmup and schedule from `--model.*`); Lightning's would replace them, critic included.
            kwargs.setdefault("auto_configure_optimizers", False)
            super().__init__(*args, **kwargs)

        @staticmethod
        def subcommands() -> dict[str, set[str]]:
            # Lightning builds a full parser per trainer method (fit, validate, test, predict) at
            # every start, ~0.2 s each, though a launch runs one (and rlver never runs predict).
            every = LightningCLI.subcommands()
            return {command: every[command]} if command in every else every

        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.set_defaults({"trainer.num_sanity_val_steps": 0, "trainer.max_steps": 1000})
            # Configs Lightning saved before the options went (`optimizer: null`) still load.
            for flag in ("--optimizer", "--lr_scheduler"):
                parser.add_argument(flag, type=_null_only, default=None, help=argparse.SUPPRESS)

        # A config saved beside an old checkpoint names the flat layout's class paths: they
        # resolve while the config is parsed and its classes built, and nowhere else.
        def parse_arguments(self, parser: Any, args: Any) -> None:
            with legacy_module_paths():
                super().parse_arguments(parser, args)

        def instantiate_classes(self) -> None:
            with legacy_module_paths():
                super().instantiate_classes()

        def _parse_ckpt_path(self) -> None:
            """The run's settings are the config's, never a checkpoint's: Lightning would replace
            every `model.*` value with the one saved in a checkpoint *file* (not for `last`), so
            a run moved to another model folder, or resumed with a changed setting, would
            silently use the old one, depending on how the checkpoint was named."""

    return RLVERCLI


def _null_only(value: Any) -> None:
    if value is not None and str(value).lower() not in ("null", "none"):
        raise ValueError(value)


# What jsonargparse calls the type in its error: "invalid <name> value: 'Adam'".
_null_only.__name__ = (
    "value: the optimizers are the module's (--model.actor_lr, --model.lr_schedule, ...); null, not a"
)


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


def parse_recipe(path: str) -> Namespace:
    """Parse and type-check a recipe as `rlver fit` does, without building anything."""
    with legacy_module_paths():
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
