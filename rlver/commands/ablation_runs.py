"""An ablation's runs on disk: the plan, each run's folder and `rlver fit` command, and what it left.

A run is one arm at one seed, an ordinary `rlver fit` of the base recipe with the arm's recipe
file and flags, in `<out>/<arm>/seed-<S>`. It is finished when `ablation_done.json` is there (the
launcher writes it after the fit exited 0 with its after-training scores), or, for a run made
elsewhere (`--launcher print`), when `BeforeAfter`'s `before_after.json` holds the after-training
scores at the run's last step. A run with `checkpoints/last.ckpt` and no result resumes from it.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlver.evaluate.ablation import RunScores

PLAN_FILE = "ablation.json"
DONE_FILE = "ablation_done.json"
LOG_FILE = "log.txt"
CURVE_TAG = "rollout/final_emotion"
RECIPE_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class Arm:
    """An arm: a recipe file layered over the base (optional) and `rlver fit` flags."""

    name: str
    recipe: str | None = None
    flags: tuple[str, ...] = ()

    @classmethod
    def parse(cls, name: str, spec: str, where: str) -> Arm:
        """`spec` is `[RECIPE.yaml] [--flag value ...]` (shell words); an empty spec is the base as it is."""
        if not name or "/" in name or name.startswith(".") or name != name.strip():
            raise ValueError(f"{where}: arm name {name!r} must be a plain folder name")
        try:
            words = shlex.split(spec or "")
        except ValueError as error:
            raise ValueError(f"{where}: arm {name}: {error}") from None
        recipe = None
        if words and words[0].endswith(RECIPE_SUFFIXES):
            recipe = words.pop(0)
            if not Path(recipe).is_file():
                raise ValueError(f"{where}: arm {name}: recipe file {recipe} not found")
        if words and not words[0].startswith("--"):
            raise ValueError(
                f"{where}: arm {name}: expected a recipe file (.yaml) or `rlver fit` flags (--x ...), "
                f"got {words[0]!r}"
            )
        return cls(name, recipe, tuple(words))

    def spec(self) -> str:
        return shlex.join([*([self.recipe] if self.recipe else []), *self.flags])


@dataclass(frozen=True)
class Plan:
    """What `rlver ablate` was asked for: written to `<out>/ablation.json` so `--collect` knows the arms."""

    config: str
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]
    steps: int | None
    out: Path
    extra: tuple[str, ...] = field(default=())

    def folder(self, arm: Arm, seed: int) -> Path:
        return self.out / arm.name / f"seed-{seed}"

    def runs(self) -> list[tuple[Arm, int]]:
        """Seed-major: an interrupted ablation has every arm at its first seeds."""
        return [(arm, seed) for seed in self.seeds for arm in self.arms]

    def fit_arguments(self, arm: Arm, seed: int) -> list[str]:
        """`rlver fit`'s arguments for one run (resuming from `last.ckpt` where the run left one)."""
        folder = self.folder(arm, seed)
        arguments = ["fit", "--config", self.config]
        if arm.recipe:
            arguments += ["--config", arm.recipe]
        # The run's seed drives the training order and the sampling (data.seed and
        # model.rollout.seed default to it); a recipe that pins either keeps its pin.
        arguments += ["--seed_everything", str(seed)]
        if self.steps is not None:
            arguments += ["--trainer.max_steps", str(self.steps)]
        # Every run trains its steps: a clock limit would end slow runs early and compare unequal budgets.
        arguments += ["--trainer.max_time", "null", "--trainer.default_root_dir", str(folder)]
        arguments += [*self.extra, *arm.flags]
        if (folder / "checkpoints" / "last.ckpt").is_file():
            arguments += ["--ckpt_path", "last"]
        return arguments

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        record = {
            "config": self.config,
            "arms": {arm.name: arm.spec() for arm in self.arms},
            "seeds": list(self.seeds),
            "steps": self.steps,
            "extra": list(self.extra),
        }
        (self.out / PLAN_FILE).write_text(json.dumps(record, indent=1) + "\n")


def read_plan(out: Path) -> dict[str, Any] | None:
    path = out / PLAN_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path}: not an ablation plan ({error})") from None


def before_after(folder: Path) -> dict[str, Any] | None:
    """The run's `before_after.json` (BeforeAfter writes it under the TensorBoard log folder)."""
    for path in (folder / "tensorboard" / "before_after.json", folder / "before_after.json"):
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except ValueError:
                return None  # a file being written elsewhere: not finished yet
    return None


def saved_max_steps(folder: Path) -> int | None:
    """The `trainer.max_steps` the run was started with (Lightning saves the config beside the logs)."""
    import yaml

    path = folder / "tensorboard" / "config.yaml"
    if not path.is_file():
        return None
    try:
        steps = (yaml.safe_load(path.read_text()) or {}).get("trainer", {}).get("max_steps")
    except yaml.YAMLError:
        return None
    return steps if isinstance(steps, int) and steps > 0 else None


def is_finished(folder: Path, steps: int | None = None) -> bool:
    """Whether the run is done; with `steps`, done with at least that many (a longer rerun resumes it)."""
    record = before_after(folder)
    trained = record.get("step", 0) if record and record.get("after") is not None else None
    if (folder / DONE_FILE).is_file():
        return steps is None or (trained is not None and trained >= steps)
    if trained is None:
        return False
    steps = steps or saved_max_steps(folder)
    return steps is None or trained >= steps


def training_curve(log_folder: Path, tag: str = CURVE_TAG) -> dict[int, float]:
    """A scalar by step (`rollout/final_emotion` unless `tag` says) from the run's TensorBoard events.

    A resumed run logged again the steps after its last checkpoint: the later event files win.
    """
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    curve: dict[int, float] = {}
    files = sorted(log_folder.glob("events.out.tfevents.*"), key=lambda p: (p.stat().st_mtime, p.name))
    for path in files:
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag != tag:
                    continue
                if value.HasField("simple_value"):
                    curve[int(event.step)] = float(value.simple_value)
                elif value.HasField("tensor"):
                    curve[int(event.step)] = float(tensor_util.make_ndarray(value.tensor))
    return curve


def run_scores(folder: Path, arm: str, seed: int) -> RunScores | None:
    """A finished run's scores against its training simulator (None if it has not finished)."""
    scores = all_run_scores(folder, arm, seed)
    return scores[0] if scores else None


def all_run_scores(folder: Path, arm: str, seed: int) -> list[RunScores]:
    """A finished run's scores: against its training simulator first, then against each of
    BeforeAfter's other evaluators (`evaluations` in before_after.json); [] if unfinished."""
    if not is_finished(folder):
        return []
    record = before_after(folder)
    if not record or not record.get("after"):
        return []
    done = folder / DONE_FILE
    seconds = json.loads(done.read_text()).get("seconds") if done.is_file() else None
    trained = RunScores(
        arm=arm,
        seed=seed,
        after=record["after"],
        before=record.get("before"),
        curve=training_curve(folder / "tensorboard"),
        seconds=seconds,
        gaming=(record.get("gaming") or {}).get("after"),
    )
    others = [
        RunScores(arm=arm, seed=seed, after=scores["after"], before=scores.get("before"), evaluator=label)
        for label, scores in (record.get("evaluations") or {}).items()
        if scores.get("after")
    ]
    return [trained, *others]


def collect(out: Path, arms: list[str] | None = None) -> tuple[list[str], list[RunScores]]:
    """Every finished run under `out`: arms in the plan's order (else by folder name), seeds by number."""
    if arms is None:
        plan = read_plan(out)
        if plan is not None:
            arms = list(plan["arms"])
        else:
            arms = sorted(p.name for p in out.iterdir() if p.is_dir() and any(p.glob("seed-*")))
    runs = []
    for arm in arms:
        for folder in sorted((out / arm).glob("seed-*")):
            try:
                seed = int(folder.name.removeprefix("seed-"))
            except ValueError:
                continue
            runs.extend(all_run_scores(folder, arm, seed))
    return arms, sorted(runs, key=lambda r: (arms.index(r.arm), r.seed, r.evaluator != "train", r.evaluator))
