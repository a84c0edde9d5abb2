"""Callbacks a recipe can add under `trainer.callbacks`."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L

from rlver.checkpoint.stopping import last_checkpoint_path
from rlver.core import plugins
from rlver.core.console import phase
from rlver.core.emotion import DIFFICULTIES
from rlver.evaluate.intervals import paired_by_key, per_user_means, training_rise
from rlver.rollout.gaming import GamingShares, gaming_shares
from rlver.rollout.transcripts import TranscriptWriter

# The training curve BeforeAfter keeps: the module logs each step's mean final emotion of its
# training dialogues under this name (rlver.train.run_log; `rlver ablate` reads the same tag).
TRAINING_CURVE_METRIC = "rollout/final_emotion"


class BeforeAfter(L.Callback):
    """Shows that the policy learned: held-out users' final emotion before and after training, paired.

    Evaluates at `eval_temperature` (greedy by default) on the first `limit` profiles of
    `split` when training starts (a resumed run keeps the "before" of its first start)
    and when it ends, then prints both, the paired change with its 95% interval over users
    (rlver.evaluate.intervals), and where to look next; `<log dir>/before_after.json` keeps every user's
    scores. The evaluation has its own `seed` (the simulated users' wording), not the training's:
    the untrained model's score is then the same whatever the training seed, and before and after
    differ only by what training changed. Every rank talks with the same users (so sharded
    generation stays in step); rank 0 prints. The "before" scores are written to
    `before_after.json` as soon as they exist, so a run killed and resumed (`--ckpt_path last`)
    still reports its paired change (`rlver ablate` resumes runs this way). It also keeps the
    training curve (each step's mean final emotion of its training dialogues, written beside the
    scores as the run goes) and prints its first and last quarter with the rise's 95% interval
    over their steps: whether the sampled training dialogues improved too, and how surely.

    Args:
        split: The data split to evaluate on: test or val.
        limit: How many of its profiles (0: all).
        seed: The evaluation's seed (fixed: independent of `seed_everything` and the rollout seed).
        samples: Dialogues per user, at seeds `seed`, `seed + 1`, ...; a user's score is their mean.
        difficulty: The users' difficulty in these dialogues (a level name: easy, normal, hard);
            None: the simulator's own. Pin it to compare runs trained against different users on
            the same test users (the environment ablation).
        transcripts: Also write the evaluation's dialogues to `<log dir>/before_after/before.jsonl`
            and `after.jsonl` (rlver's transcript format, with each user turn's judgement): what
            the greedy policy said, to read why a score moved (about 3 KB a dialogue).
        evaluators: Other simulated users to score the policy with, before and after, beside the
            training simulator: each a simulator spec as `--model.simulator` takes it, with an
            optional `label` (default: its name and options), e.g. `[{name: embedded, judge:
            rubric, label: rubric}, {name: sage, base_url: ...}]`. A gain the training simulator
            shows but users the policy never trained against do not is a gamed simulator. Each is
            printed with its own paired change and written under `evaluations` in
            `before_after.json` (`rlver ablate` shows the train x evaluation matrix).
    """

    def __init__(
        self,
        split: str = "test",
        limit: int = 0,
        seed: int = 0,
        samples: int = 1,
        difficulty: str | None = None,
        transcripts: bool = True,
        evaluators: list[str | dict[str, Any]] | None = None,
    ) -> None:
        if difficulty is not None and difficulty not in DIFFICULTIES:
            raise ValueError(
                f"BeforeAfter difficulty ({difficulty!r}) must be one of {', '.join(DIFFICULTIES)} or null"
            )
        self.difficulty = difficulty
        if split not in ("test", "val"):
            raise ValueError(f"BeforeAfter split ({split!r}) must be test or val")
        if limit < 0:
            raise ValueError(f"BeforeAfter limit ({limit}) must be >= 0")
        if samples < 1:
            raise ValueError(f"BeforeAfter samples ({samples}) must be >= 1")
        self.split, self.limit, self.seed, self.samples = split, limit, seed, samples
        self.transcripts = transcripts
        self.before: dict[str, float] | None = None
        self.curve: dict[int, float] = {}
        self._log_dir: str | None = None
        self.gaming: dict[str, GamingShares] = {}  # "before", "after": what the replies show
        self.evaluators = evaluator_specs(evaluators or [])  # label -> simulator spec
        self._simulators: dict[str, Any] = {}  # built at the first evaluation, closed at the end
        self.other_before: dict[str, dict[str, float]] = {}  # label -> "before" scores

    def _finals(
        self, trainer: L.Trainer, pl_module: Any, stage: str, label: str | None = None
    ) -> dict[str, float]:
        """Each user's score at `stage`, against the training simulator or evaluator `label`."""
        profiles = trainer.datamodule.profiles(self.split)
        profiles = profiles[: self.limit] if self.limit else profiles
        if self.difficulty is not None:
            profiles = [replace(p, extra={**p.extra, "difficulty": self.difficulty}) for p in profiles]
        # Every rank talks with the same users: rank 0 writes them.
        keep = self.transcripts and self._log_dir and trainer.global_rank == 0
        name = stage if label is None else f"{stage}.{label}"
        path = Path(self._log_dir or "") / "before_after" / f"{name}.jsonl" if keep else None
        seen: list[Any] = []
        other = {} if label is None else {"simulator": self._simulator(label)}

        def evaluate(batch: Sequence[Any], seed: int) -> list[Any]:
            trajectories = pl_module.evaluation_rollouts(batch, seed=seed, **other)
            seen.extend(trajectories)
            return trajectories

        scores = heldout_scores(evaluate, profiles, self.seed, self.samples, path)
        if label is not None:
            return scores
        self.gaming[stage] = gaming_shares(seen)
        if path is not None:  # the shares and the top openings beside the transcripts they count
            path.with_suffix(".gaming.json").write_text(json.dumps(self.gaming[stage].as_record(), indent=1))
        return scores

    def _also(self) -> str:
        """How the phase line names the other evaluators (one line for all: a quiet terminal)."""
        return f", also as judged by {', '.join(self.evaluators)}," if self.evaluators else ""

    def _users(self, trainer: L.Trainer) -> str:
        count = len(trainer.datamodule.profiles(self.split))
        users = min(count, self.limit) if self.limit else count
        return f"{users} held-out users" + (f" x {self.samples} dialogues" if self.samples > 1 else "")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.runner.engine.sync_weights()  # an engine with its own copy must hold these weights
        log_dir = self._log_dir = trainer.log_dir or trainer.default_root_dir  # a broadcast: every rank asks
        if trainer.global_step != 0:
            saved = self._saved(log_dir)
            self.before = saved.get("before")
            # Steps after the checkpoint are trained again: keep only the ones it holds.
            curve = saved.get("training_curve") or {}
            self.curve = {int(k): float(v) for k, v in curve.items() if int(k) <= trainer.global_step}
            evaluations = saved.get("evaluations") or {}
            self.other_before = {
                label: evaluations[label]["before"]
                for label in self.evaluators
                if (evaluations.get(label) or {}).get("before") is not None
            }
            return
        with phase(f"talking with {self._users(trainer)}{self._also()} before training (greedy)"):
            self.before = self._finals(trainer, pl_module, "before")
            for label in self.evaluators:
                self.other_before[label] = self._finals(trainer, pl_module, "before", label)
        if trainer.global_rank == 0:
            self._write_progress()

    def _settings(self) -> dict[str, Any]:
        """What decides who the users are: a saved "before" is reused only under the same settings."""
        return {
            "split": self.split,
            "limit": self.limit,
            "seed": self.seed,
            "samples": self.samples,
            "difficulty": self.difficulty,
            **({"evaluators": self.evaluators} if self.evaluators else {}),
        }

    def _saved(self, log_dir: str | None) -> dict[str, Any]:
        """A resumed run's record, as its first start wrote it ({} if absent or made otherwise)."""
        path = Path(log_dir or "") / "before_after.json"
        if not log_dir or not path.is_file():
            return {}
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        settings = self._settings()
        if any(record.get(key, settings[key]) != value for key, value in settings.items()):
            return {}
        return record

    def _simulator(self, label: str) -> Any:
        if label not in self._simulators:
            flag = f"BeforeAfter evaluators[{list(self.evaluators).index(label)}]"
            self._simulators[label] = plugins.get_registry().build(
                "simulators", self.evaluators[label], flag=flag
            )
        return self._simulators[label]

    def _close_simulators(self) -> None:
        for simulator in self._simulators.values():
            simulator.close()
        self._simulators = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        value = trainer.callback_metrics.get(TRAINING_CURVE_METRIC)
        if value is None:
            return
        self.curve[int(trainer.global_step)] = round(float(value), 4)
        if trainer.global_rank == 0:  # a killed run keeps its curve for the resume
            self._write_progress()

    def _write_progress(self) -> None:
        """The record of a run under way: the "before" scores and the curve so far, no "after"."""
        if self._log_dir:
            record = {"step": 0, "before": self.before, "after": None, "training_curve": self.curve}
            if self.other_before:
                record["evaluations"] = {
                    label: {"before": before, "after": None} for label, before in self.other_before.items()
                }
            self._write(self._log_dir, {**self._settings(), **record})

    @staticmethod
    def _write(log_dir: str, record: dict[str, Any]) -> None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        path = Path(log_dir) / "before_after.json"
        partial = path.with_name(path.name + ".partial")  # never half a file where a reader looks
        partial.write_text(json.dumps(record, indent=1) + "\n")
        partial.replace(path)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with phase(f"talking with {self._users(trainer)}{self._also()} after training (greedy)"):
            after = self._finals(trainer, pl_module, "after")
            other_after = {
                label: self._finals(trainer, pl_module, "after", label) for label in self.evaluators
            }
        self._close_simulators()
        log_dir = trainer.log_dir or trainer.default_root_dir  # a broadcast: every rank asks
        checkpoint = last_checkpoint_path(trainer)
        if trainer.global_rank != 0:
            return
        mean_after = sum(after.values()) / max(len(after), 1)
        lines = [
            f"\nrlver: greedy mean final emotion of {len(after)} held-out users ({self.split}, evaluation"
            f" seed {self.seed}; change: mean over users [95% interval])"
        ]
        if 0 < trainer.global_step < (trainer.max_steps or 0) and not trainer.interrupted:
            stopped = f"stopped at step {trainer.global_step} of {trainer.max_steps}"
            lines.append(f"  ({stopped}: max_time or a stop signal)")
        change = paired_by_key(self.before, after) if self.before is not None else None
        if change is not None:
            lines.append(
                f"  before training  {change.before:.1f}\n"
                f"  after {trainer.global_step} steps  {mean_after:.1f}  ({change.format()})"
            )
        else:
            lines.append(f"  after {trainer.global_step} steps  {mean_after:.1f}  (resumed run: no 'before')")
        evaluations = {}
        for label, scores in other_after.items():
            before = self.other_before.get(label)
            other_change = paired_by_key(before, scores) if before is not None else None
            evaluations[label] = {
                "spec": self.evaluators[label],
                "before": before,
                "after": scores,
                "change": other_change.as_dict() if other_change is not None else None,
            }
            mean = sum(scores.values()) / max(len(scores), 1)
            shown = (
                f"{other_change.before:.1f} -> {mean:.1f}  ({other_change.format()})"
                if other_change
                else f"{mean:.1f}"
            )
            lines.append(f"  on {label}  {shown}  (users the policy did not train against)")
        for stage in ("before", "after"):
            if stage in self.gaming:
                lines.append(f"  {stage:<6} {self.gaming[stage].line()}")
        rise = training_rise(self.curve)
        if rise is not None:
            lines.append(
                f"  training reward  {rise.format()}  (mean final emotion of the training dialogues,"
                f" first -> last quarter of {len(self.curve)} steps [95% interval over their steps])"
            )
        record = {
            **self._settings(),
            "step": trainer.global_step,
            "before": self.before,
            "after": after,
            "change": change.as_dict() if change is not None else None,
            "training_curve": self.curve,
            "gaming": {stage: shares.as_record() for stage, shares in self.gaming.items()},
            **({"evaluations": evaluations} if evaluations else {}),
            "training_rise": None
            if rise is None
            else {"first": rise.first, "last": rise.last, **rise.rise.as_dict()},
        }
        if log_dir:
            self._write(log_dir, record)
        lines += [
            f"  curves      tensorboard --logdir {log_dir}",
            f"  checkpoint  {checkpoint}",
            f"  export      rlver export --ckpt {checkpoint} --out <folder>",
        ]
        print("\n".join(lines), flush=True)


def evaluator_specs(specs: Sequence[str | dict[str, Any]]) -> dict[str, dict[str, Any] | str]:
    """BeforeAfter's evaluators by label, each checked against the installed simulators now (an
    unknown name or option fails before training, naming `BeforeAfter evaluators[i]`)."""
    labelled: dict[str, dict[str, Any] | str] = {}
    for index, spec in enumerate(specs):
        spec = plugins.plain_config(spec)
        flag = f"BeforeAfter evaluators[{index}]"
        if isinstance(spec, dict):
            spec = dict(spec)
            label = str(spec.pop("label", "") or _default_label(spec))
        elif isinstance(spec, str):
            label = spec
        else:
            raise ValueError(f"{flag}: a simulator name or mapping, got {spec!r}")
        if label in labelled or label == "train":
            raise ValueError(f"{flag}: the label {label!r} is taken; give each evaluator its own `label`")
        plugins.get_registry().check("simulators", spec, flag=flag)
        labelled[label] = spec
    return labelled


def _default_label(spec: dict[str, Any]) -> str:
    options = ",".join(f"{key}={value}" for key, value in sorted(spec.items()) if key != "name")
    return f"{spec.get('name', '?')}({options})" if options else str(spec.get("name", "?"))


def heldout_scores(
    evaluate: Callable[..., list[Any]],
    profiles: Sequence[Any],
    seed: int,
    samples: int = 1,
    transcripts: Path | None = None,
) -> dict[str, float]:
    """Each profile's mean final emotion over `samples` dialogues, all run as one batch.

    `evaluate(profiles, seed=...)` is `RLVERModule.evaluation_rollouts` (or a runner's `run`): a
    dialogue's user seed is derived from `seed`, its profile and its position, so the K copies of a
    profile face K differently-worded users, and the same call gives the same users every time.
    With `transcripts`, the dialogues are written there too (replacing an earlier file).
    """
    repeated = [profile for profile in profiles for _ in range(samples)]
    trajectories = evaluate(repeated, seed=seed)
    if transcripts is not None:
        with TranscriptWriter(transcripts) as writer:
            writer.write(trajectories, evaluation_seed=seed)
    return per_user_means([p.id for p in repeated], [t.final_emotion for t in trajectories])
