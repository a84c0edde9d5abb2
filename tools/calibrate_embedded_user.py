"""Fit the embedded user's semantic judge on recorded SAGE dialogues (the tune split only).

Each recorded dialogue of the tune split (rlver.evaluate.agreement.split_of: the 70% never held out) is
replayed through the embedded user with teacher forcing of both the user's words and emotion;
at every turn the rubric judges the recorded reply and the semantic features are computed
(plugins/embedded_user/semantic.py). Turns the guards decide (garbled or stuffed replies keep
the rubric's verdict; a copy of the user's message or of an earlier reply gets the map's change
held at -COPY_PENALTY or below) are left out of the fit. A
ridge regression maps the features to SAGE's recorded change; the fit is written to
calibration.json with what it was fitted on and its per-turn correlation there.

Each argument is one source: a file of recorded dialogues, or a folder whose *.jsonl files
(one tested model each) share the model that played SAGE's user. All sources are pooled into
one fit; the cross-validated agreement (folds by dialogue id, so one persona's dialogues with
every model fall in one fold) is printed per source. Measure the result with
`tools/simulator_agreement.py FILE... --split held_out --simulator '{name: embedded, judge: semantic}'`.

    .venv/bin/python tools/calibrate_embedded_user.py \
        ../shared/data/sage_transcripts_qwen2.5-72b.jsonl ../shared/data/sage-gpt4o-simulator
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
from pathlib import Path

from rlver_plugins.embedded_user import EmbeddedUserSimulator, semantic
from rlver_plugins.embedded_user.simulator import GUARDED_SIGNALS

from rlver.data.profiles import parse_profile
from rlver.evaluate.agreement import load_recorded, pearson, split_of

FOLDS = 5
RUBRIC_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)


def source_files(argument: str) -> list[Path]:
    """The files of one source: the file itself, or a folder's *.jsonl files (sorted)."""
    path = Path(argument)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise SystemExit(f"{argument}: no *.jsonl files")
    return files


def source_name(argument: str) -> str:
    path = Path(argument)
    return path.name if path.is_dir() else path.stem


def turn_rows(path: str | Path) -> tuple[list[dict[str, float]], list[float], list[str]]:
    """Features and SAGE's change of every tune-split turn the map decides, with its dialogue id."""
    simulator = EmbeddedUserSimulator(judge="rubric")
    rows, targets, ids = [], [], []
    for dialogue in load_recorded(path):
        if split_of(dialogue.id) != "tune":
            continue
        profile = parse_profile(dialogue.record, where=dialogue.where)
        session = simulator.open(profile, seed=0)
        session.follow(dialogue.user_texts[0], dialogue.emotions[0])
        for turn, reply in enumerate(dialogue.replies):
            before = dialogue.emotions[turn]
            judged = session.respond(reply)
            reason = judged.reason
            if reason.get("signal") not in GUARDED_SIGNALS:
                earlier = dialogue.replies[:turn]
                criteria = reason["criteria"]
                user_text = dialogue.user_texts[turn]
                last = before - dialogue.emotions[turn - 1] if turn else 0.0
                values = semantic.features(reply, user_text, profile.task, criteria, before, earlier, last)
                if semantic.copied(values) is None:
                    rows.append(values)
                    targets.append(dialogue.emotions[turn + 1] - before)
                    ids.append(dialogue.id)
            # SAGE's words and emotion again (an ending the rubric's own emotion reached is undone).
            session.follow(dialogue.user_texts[turn + 1], dialogue.emotions[turn + 1])
    return rows, targets, ids


def fold_of(dialogue_id: str) -> int:
    """The cross-validation fold of a dialogue id: every model's dialogue with one persona in one fold."""
    return int(hashlib.sha256(f"fold:{dialogue_id}".encode()).hexdigest()[:8], 16) % FOLDS


def balanced(sources: list[str]) -> list[float]:
    """Row weights that give every source the same total weight (mean weight 1)."""
    counts = {name: sources.count(name) for name in set(sources)}
    return [len(sources) / (len(counts) * counts[name]) for name in sources]


def cross_validated(
    rows: list[dict[str, float]],
    targets: list[float],
    ids: list[str],
    ridge: float,
    rubric_weight: float,
    sample_weights: list[float] | None = None,
) -> list[float]:
    """Each turn's change predicted by a fit that never saw its dialogue (FOLDS folds by dialogue id)."""
    fold = [fold_of(i) for i in ids]
    predicted = [0.0] * len(rows)
    for k in range(FOLDS):
        inside = [j for j in range(len(rows)) if fold[j] != k]
        fitted = semantic.fit(
            [rows[j] for j in inside],
            [targets[j] for j in inside],
            ridge,
            rubric_weight,
            None if sample_weights is None else [sample_weights[j] for j in inside],
        )
        for j in range(len(rows)):
            if fold[j] == k:
                predicted[j] = fitted.predict(rows[j])
    return predicted


def r_by_source(predicted: list[float], targets: list[float], sources: list[str]) -> dict[str, float]:
    """Per-turn r of `predicted` with SAGE's change, per source, then over all of them ("all")."""
    result = {}
    for name in dict.fromkeys(sources):
        chosen = [j for j, s in enumerate(sources) if s == name]
        result[name] = pearson([predicted[j] for j in chosen], [targets[j] for j in chosen])
    if len(result) > 1:
        result["all"] = pearson(predicted, targets)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "sources",
        nargs="+",
        help="recorded SAGE dialogues, one argument per model playing the user: a file, or a folder "
        "of *.jsonl files (the shared Qwen2.5-72B file; the sage-gpt4o-simulator folder)",
    )
    parser.add_argument("--ridge", type=float, default=5.0)
    parser.add_argument(
        "--rubric-weight",
        type=float,
        default=0.5,
        help="the fixed weight of the rubric's need, tone and focus criteria (semantic.FIXED_CRITERIA; "
        "default 0.5: smaller, a need-violating reply beat the need-meeting one in "
        "tests/plugins/test_semantic_user.py; the cross-validated table this prints shows what "
        "agreement each weight costs)",
    )
    parser.add_argument("--out", type=Path, default=semantic.CALIBRATION)
    args = parser.parse_args()

    rows, targets, ids, sources, files, row_files = [], [], [], [], [], []
    for argument in args.sources:
        name = source_name(argument)
        for path in source_files(argument):
            file_rows, file_targets, file_ids = turn_rows(path)
            rows += file_rows
            targets += file_targets
            ids += file_ids
            sources += [name] * len(file_rows)
            row_files += [path.name] * len(file_rows)
            files.append(path.name)
    turns_by_source = {n: sources.count(n) for n in dict.fromkeys(sources)}
    # Each source counts as much as any other (SAGE's users played by different models): the
    # six GPT-4o-played files would otherwise outweigh the DeepSeek-V3-played one eight to one.
    row_weights = balanced(sources)
    weights_tried = sorted({*RUBRIC_WEIGHTS, args.rubric_weight})
    agreement = {
        w: r_by_source(cross_validated(rows, targets, ids, args.ridge, w, row_weights), targets, sources)
        for w in weights_tried
    }
    names = list(agreement[args.rubric_weight])
    print(
        f"cross-validated per-turn r on the tune split ({FOLDS} folds by dialogue), "
        "by the weight of the rubric's fixed criteria:"
    )
    print("  weight  " + "  ".join(f"{n:>28}" for n in names))
    for weight, by_source in agreement.items():
        print(f"  {weight:6.2f}  " + "  ".join(f"{by_source[n]:28.3f}" for n in names))
    calibration = semantic.fit(rows, targets, args.ridge, args.rubric_weight, row_weights)
    fitted = [calibration.predict(row) for row in rows]
    chosen = agreement[args.rubric_weight]
    about = {
        "fitted_on": files[0] if len(files) == 1 else files,
        "split": "tune (rlver.evaluate.agreement.split_of)",
        "dialogues": len(set(zip(row_files, ids, strict=True))),
        "turns": len(rows),
        "turns_by_source": turns_by_source,
        "ridge": args.ridge,
        "rubric_weight": args.rubric_weight,
        "sources_weigh": "equally",
        "per_turn_r_cross_validated": round(chosen.get("all", chosen[names[0]]), 4),
        "per_turn_r_cross_validated_by_source": {n: round(chosen[n], 4) for n in turns_by_source},
        "per_turn_r_on_fit": round(pearson(fitted, targets), 4),
    }
    calibration = dataclasses.replace(calibration, about=about)
    args.out.write_text(calibration.to_json(), encoding="utf-8")
    fit_r = about["per_turn_r_on_fit"]
    print(f"{about['dialogues']} dialogues, {len(rows)} turns; per-turn r on the fit {fit_r:.3f}")
    weights = dict(zip(semantic.FEATURES, calibration.weights, strict=True))
    print("weights:", weights, "bias", calibration.bias)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
