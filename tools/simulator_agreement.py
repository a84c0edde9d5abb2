"""Does a simulator plugin react like SAGE? Recorded SAGE dialogues replayed through it.

For each file (one model's recorded Sentient dialogues, the format `rlver score` reads), every
dialogue is replayed with teacher forcing (rlver.evaluate.agreement): the plugin sees the recorded
history and assistant reply, makes its emotion change, and is then told what the user really
said next. Printed: per-turn Pearson and Spearman correlation of the plugin's change with
SAGE's recorded change; the per-dialogue correlation of the final emotion; one line per file
(its mean replayed final emotion against SAGE's recorded mean); with several files, the
Spearman correlation of the plugin's ranking of the models with SAGE's.

    .venv/bin/python tools/simulator_agreement.py ../shared/data/sage_transcripts_qwen2.5-72b.jsonl
    .venv/bin/python tools/simulator_agreement.py FILE --split held_out
    .venv/bin/python tools/simulator_agreement.py FILE --simulator \
        '{name: sage, base_url: http://127.0.0.1:8000/v1, model: deepseek-v3, api_key_env: KEY}'

`--split held_out` keeps the fixed 30% of dialogues (by id hash) that must never be used to
tune a simulator; `tune` the other 70%.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

from rlver.core.plugins import get_registry
from rlver.evaluate.agreement import Agreement, agreement, load_recorded, replay, spearman, split_of, to_json


def line(name: str, result: Agreement) -> str:
    return (
        f"{name}: {result.dialogues} dialogues, {result.turns} turns | per-turn change r = "
        f"{result.turn_pearson:.3f} (Spearman {result.turn_spearman:.3f}) | final emotion r = "
        f"{result.final_pearson:.3f} | mean final {result.mean_final:.1f} replayed vs "
        f"{result.mean_recorded_final:.1f} SAGE"
        + (f" | ended early {result.ended_early}" if result.ended_early else "")
        + (f" | simulator errors {result.simulator_errors}" if result.simulator_errors else "")
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="recorded SAGE dialogue files, one model each")
    parser.add_argument("--simulator", default="embedded", help="a simulator spec, as in a recipe (YAML)")
    parser.add_argument("--split", choices=("all", "tune", "held_out"), default="all")
    parser.add_argument("--limit", type=int, default=0, help="the first N dialogues of each file (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args()

    spec = yaml.safe_load(args.simulator)
    simulator = get_registry().build("simulators", spec, flag="--simulator")
    results: dict[str, Agreement] = {}
    everything = []
    started = time.perf_counter()
    try:
        for path in args.files:
            dialogues = load_recorded(path)
            if args.split != "all":
                dialogues = [d for d in dialogues if split_of(d.id) == args.split]
            if args.limit:
                dialogues = dialogues[: args.limit]
            replays = replay(simulator, dialogues, seed=args.seed)
            everything += replays
            results[Path(path).stem] = agreement(replays)
    finally:
        simulator.close()
    seconds = time.perf_counter() - started
    name = spec if isinstance(spec, str) else spec.get("name")
    print(f"simulator {name}, split {args.split}, {seconds:.1f} s")
    for file_name, result in results.items():
        print(line(file_name, result))
    if len(results) > 1:
        results["all files"] = agreement(everything)
        print(line("all files", results["all files"]))
        models = [r for n, r in results.items() if n != "all files"]
        rank_rho = spearman([r.mean_final for r in models], [r.mean_recorded_final for r in models])
        print(f"model ranking, Spearman with SAGE's: {rank_rho:.3f} ({len(models)} models)")
    if args.json:
        args.json.write_text(to_json(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
