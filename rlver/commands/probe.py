"""`rlver probe`: the scripted responders against a recipe's simulated users, one table.

A simulator whose emotion can be raised by a stock sympathy line, the user's own words handed
back or agreement with everything will be gamed by the policy trained against it. The probe runs
every strategy of the `scripted` engine (and any `--ckpt` policies) against the configured
simulator on the test users and prints, per responder: the mean final emotion with its 95%
interval over users, the users' mean start emotion, the paired change (final - start) with its
interval, and whether the simulator punishes it (the change's whole interval below 0).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from jsonargparse import ActionConfigFile, ArgumentParser

from rlver.commands.rollout import _resolve_device, add_recipe_sections, build_runner
from rlver.core.interfaces import RolloutEngine
from rlver.core.plugins import get_registry, plain_config
from rlver.core.seeding import run_seed
from rlver.core.trajectory import Trajectory
from rlver.data.datamodule import ProfileDataModule
from rlver.evaluate.intervals import mean_interval
from rlver.rollout.gaming import gaming_shares
from rlver.rollout.transcripts import TranscriptWriter
from rlver.train.module import RLVERModule


def scripted_strategies() -> tuple[str, ...]:
    """Every strategy of the registered `scripted` engine (its interface's `scripted_strategies`)."""
    factory = get_registry().get("engines", "scripted").factory
    if not (isinstance(factory, type) and issubclass(factory, RolloutEngine)):
        raise TypeError(f"the `scripted` engine registers {factory!r}, not a RolloutEngine class")
    return factory.scripted_strategies


@dataclasses.dataclass
class ProbeRow:
    responder: str
    users: int
    start: float
    final: float
    final_low: float
    final_high: float
    change: float
    change_low: float
    change_high: float
    gaming: str

    @property
    def punished(self) -> bool:
        return self.change_high < 0


def probe_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="rlver probe",
        description="Every scripted responder (and --ckpt policies) against the recipe's simulated users.",
    )
    parser.add_argument("--config", action=ActionConfigFile, help="A recipe YAML (as `rlver fit` reads it).")
    parser.add_argument("--split", type=str, default="test", choices=["train", "val", "test"])
    parser.add_argument("--limit", type=int, default=0, help="Only the first N profiles (0: all).")
    parser.add_argument(
        "--strategies",
        type=list[str],
        default=[],
        help="The scripted strategies to run (default: every strategy of the `scripted` engine).",
    )
    parser.add_argument(
        "--ckpt", type=list[str], default=[], help="`rlver fit` checkpoints whose policies to probe too."
    )
    parser.add_argument(
        "--out", type=str | None, default=None, help="A folder for transcripts and a JSON table."
    )
    parser.add_argument("--device", type=str, default="auto", help="cpu, cuda, or auto.")
    add_recipe_sections(parser)
    return parser


def probe_command(argv: Sequence[str]) -> int:
    from rlver.modeling.models import load_policy

    parser = probe_parser()
    cfg = parser.parse_args(list(argv))
    if cfg.limit < 0:
        parser.error(f"--limit ({cfg.limit}) must be >= 0")
    known = scripted_strategies()
    strategies = cfg.strategies or list(known)
    unknown = [s for s in strategies if s not in known]
    if unknown:
        parser.error(f"--strategies: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    profiles = ProfileDataModule(**cfg.data.as_dict()).profiles(cfg.split)
    profiles = profiles[: cfg.limit] if cfg.limit else profiles
    device = _resolve_device(cfg.device)
    options = plain_config(cfg.model)
    module = RLVERModule(**options)
    policy = load_policy(options["policy"], dtype=options["dtype"], device=device)
    out = Path(cfg.out) if cfg.out else None
    rows = []
    seed = run_seed(module.rollout_settings.seed)
    for strategy in strategies:
        module.component_specs["engine"] = {"name": "scripted", "strategy": strategy}
        runner = module.rollout_runner(policy)
        rows.append(probe_row(strategy, runner.run(list(profiles), seed=seed), out))
    for ckpt in cfg.ckpt:
        runner = build_runner(cfg.model, device, ckpt=ckpt)
        rows.append(probe_row(f"policy {ckpt}", runner.run(list(profiles), seed=seed), out))
    module.simulator.close()
    print(format_probe(rows, simulator=str(options.get("simulator"))))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        table = [{**dataclasses.asdict(row), "punished": row.punished} for row in rows]
        (out / "probe.json").write_text(json.dumps(table, indent=2, ensure_ascii=False))
    return 0


def probe_row(name: str, trajectories: list[Trajectory], out: Path | None) -> ProbeRow:
    """One responder's row: per-user final emotion and its paired change from the start."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        slug = name.replace("/", "_").replace(" ", "_")
        with TranscriptWriter(str(out / f"{slug}.jsonl")) as writer:
            writer.write(trajectories)
    valid = [t for t in trajectories if t.termination != "simulator_error"]
    if not valid:
        raise SystemExit(f"rlver probe: {name}: every dialogue ended with a simulator error")
    finals = mean_interval([t.final_emotion for t in valid])
    changes = mean_interval([t.final_emotion - t.start_emotion for t in valid])
    start = sum(t.start_emotion for t in valid) / len(valid)
    return ProbeRow(
        name, len(valid), start, finals.mean, finals.low, finals.high,
        changes.mean, changes.low, changes.high, gaming_shares(valid).line(),
    )  # fmt: skip


def format_probe(rows: list[ProbeRow], simulator: str) -> str:
    lines = [
        f"rlver probe: scripted responders against {simulator}",
        f"{'responder':<14} {'users':>5} {'start':>6} {'final [95%]':>20} {'change [95%]':>22}  punished",
    ]
    for row in rows:
        final = f"{row.final:.1f} [{row.final_low:.1f}, {row.final_high:.1f}]"
        change = f"{row.change:+.1f} [{row.change_low:+.1f}, {row.change_high:+.1f}]"
        lines.append(
            f"{row.responder:<14} {row.users:>5} {row.start:>6.1f} {final:>20} {change:>22}  "
            f"{'yes' if row.punished else 'NO'}"
        )
    unpunished = [
        row.responder for row in rows if not row.punished and not row.responder.startswith("policy")
    ]
    lines.append(
        "not punished (the change's interval reaches 0 or above): " + ", ".join(unpunished)
        if unpunished
        else "every scripted responder ends below the users' start, its whole interval"
    )
    return "\n".join(lines)
