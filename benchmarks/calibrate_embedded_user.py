"""Fit the embedded user's semantic judge on recorded SAGE dialogues (the tune split only).

Each recorded dialogue of the tune split (rlver.agreement.split_of: the 70% never held out) is
replayed through the embedded user with teacher forcing of both the user's words and emotion;
at every turn the rubric judges the recorded reply and the semantic features are computed
(plugins/embedded_user/semantic.py). Turns the guards keep (garbled or stuffed replies, a copy
of the user's message or of an earlier reply) are left out: the map never decides those. A
ridge regression maps the features to SAGE's recorded change; the fit is written to
calibration.json with what it was fitted on and its per-turn correlation there. Measure it with
`benchmarks/simulator_agreement.py FILE --split held_out --simulator '{name: embedded, judge: semantic}'`.

    .venv/bin/python benchmarks/calibrate_embedded_user.py ../shared/data/sage_transcripts_qwen2.5-72b.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from rlver_plugins.embedded_user import EmbeddedUserSimulator, semantic
from rlver_plugins.embedded_user.simulator import GUARDED_SIGNALS

from rlver.agreement import load_recorded, pearson, split_of
from rlver.data.profiles import parse_profile


def turn_rows(path: str) -> tuple[list[dict[str, float]], list[float], int]:
    simulator = EmbeddedUserSimulator(judge="rubric")
    rows, targets, dialogues = [], [], 0
    for dialogue in load_recorded(path):
        if split_of(dialogue.id) != "tune":
            continue
        dialogues += 1
        profile = parse_profile(dialogue.record, where=dialogue.where)
        session = simulator.open(profile, seed=0)
        session.follow(dialogue.user_texts[0], dialogue.emotions[0])
        for turn, reply in enumerate(dialogue.replies):
            before = dialogue.emotions[turn]
            judged = session.respond(reply)
            reason = judged.reason
            if reason.get("signal") not in GUARDED_SIGNALS:
                earlier = dialogue.replies[:turn]
                change = float(reason["raw_change"])
                user_text = dialogue.user_texts[turn]
                last = before - dialogue.emotions[turn - 1] if turn else 0.0
                values = semantic.features(reply, user_text, profile.task, change, before, earlier, last)
                if semantic.copied(values) is None:
                    rows.append(values)
                    targets.append(dialogue.emotions[turn + 1] - before)
            # SAGE's words and emotion again (an ending the rubric's own emotion reached is undone).
            session.follow(dialogue.user_texts[turn + 1], dialogue.emotions[turn + 1])
    return rows, targets, dialogues


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="recorded SAGE dialogues (the shared Qwen2.5-72B file)")
    parser.add_argument("--ridge", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=semantic.CALIBRATION)
    args = parser.parse_args()

    rows, targets, dialogues = turn_rows(args.file)
    calibration = semantic.fit(rows, targets, ridge=args.ridge)
    fitted = [calibration.predict(row) for row in rows]
    about = {
        "fitted_on": Path(args.file).name,
        "split": "tune (rlver.agreement.split_of)",
        "dialogues": dialogues,
        "turns": len(rows),
        "ridge": args.ridge,
        "per_turn_r_on_fit": round(pearson(fitted, targets), 4),
    }
    calibration = dataclasses.replace(calibration, about=about)
    args.out.write_text(calibration.to_json(), encoding="utf-8")
    print(f"{dialogues} dialogues, {len(rows)} turns; per-turn r on the fit {about['per_turn_r_on_fit']:.3f}")
    weights = dict(zip(semantic.FEATURES, calibration.weights, strict=True))
    print("weights:", weights, "bias", calibration.bias)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
