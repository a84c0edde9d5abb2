"""The commands that run no dialogue and no Trainer: `rlver plugins`, `export`, `score`, `plan`."""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from typing import Any

from jsonargparse import ArgumentParser

from rlver.commands.recipes import check_config_files, parse_recipe
from rlver.core.plugins import get_registry


# --------------------------------------------------------------------------- rlver plugins
def plugins_command(argv: Sequence[str]) -> int:
    parser = ArgumentParser(prog="rlver plugins", description="List installed plugins as JSON.")
    parser.parse_args(list(argv))
    print(json.dumps(get_registry().describe(), indent=2))
    return 0


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
    from rlver.evaluate.score import load_scored_file, plot_trajectories

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
    parser.add_argument(
        "--judge",
        type=str,
        action="append",
        default=None,
        help="Also score every dialogue on a judge plugin's dimensions (empathy, insight, action, ...), "
        "shown beside Score: a judge name, a YAML/JSON mapping {name: dimensions, base_url: ..., "
        "model: ...} or a file holding one. Each file's scores go to <file>.judged.jsonl beside it. "
        "Several judges (--judge given again, or a YAML/JSON list of specs) make a pool: each "
        "dimension is the judges' mean with their agreement beside it (Krippendorff's alpha; below "
        "0.667 the cell says the judges disagree), each judge's scores in the judged file.",
    )
    cfg = parser.parse_args(list(argv))
    files = [load_scored_file(path) for path in cfg.files]
    judgements = None
    if cfg.judge:
        from rlver.evaluate.judging import check_judge_spec, judge_and_write

        check_judge_spec(cfg.judge, "--judge")  # every judge of a pool, before any is asked
        judgements = judge_and_write(files, cfg.judge)
    print(_leaderboard(files, judgements, None))
    if cfg.by:
        print()
        print(_leaderboard(files, judgements, cfg.by))
    if judgements is not None and judgements.is_pool:
        from rlver.evaluate.judge_pool import AGREEMENT_THRESHOLD

        print(
            f"\njudges: {', '.join(judgements.judges)}; each dimension is their mean, with Krippendorff's "
            f"alpha (interval) over judges x dialogues; below {AGREEMENT_THRESHOLD} the judges disagree"
        )
    if cfg.plot.lower() != "none":
        print(f"\nplot: {plot_trajectories(files, cfg.plot)}")
    return 0


def _leaderboard(files: Sequence[Any], judgements: Any, by: str | None) -> str:
    from rlver.evaluate.judging import MISSING_COLUMN, add_dimensions
    from rlver.evaluate.score import leaderboard_markdown, leaderboard_rows

    rows = leaderboard_rows(files, by=by)
    if judgements is None:
        return leaderboard_markdown(rows, by=by)
    rows = add_dimensions(rows, files, judgements, by=by)
    return leaderboard_markdown(rows, by=by, extra=(*judgements.dimensions, MISSING_COLUMN))


# --------------------------------------------------------------------------- rlver plan
def plan_command(argv: Sequence[str]) -> int:
    from rlver.plan.memory_plan import EIGHTY_GB_CARD_GIB, GIB, failures, format_plan, plan_recipe

    parser = ArgumentParser(
        prog="rlver plan",
        description="GPU memory of each phase of a training step, per GPU (exit 1: one does not fit).",
    )
    parser.add_argument("--config", type=str, required=True, help="A recipe YAML (as `rlver fit` reads it).")
    parser.add_argument(
        "--gpu-memory-gib",
        type=float | None,
        default=None,
        help="GPU memory as torch reports it (default: this GPU's, else 79.3: an '80 GB' card).",
    )
    parser.add_argument(
        "--world-size", type=int | None, default=None, help="GPUs in all (default: devices x num_nodes)."
    )
    cfg = parser.parse_args(list(argv))
    memory = cfg.gpu_memory_gib
    if memory is None:
        import torch

        memory = (
            torch.cuda.get_device_properties(0).total_memory / GIB
            if torch.cuda.is_available()
            else EIGHTY_GB_CARD_GIB
        )
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
