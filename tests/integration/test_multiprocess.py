"""Several processes: the paper's recipes as miniature twins under 2-process DDP (gloo, CPU).

A twin is the recipe file itself with only the model (a tiny random Llama with the
embedded tokenizer, short dialogues), the step count, the devices (CPU, 2 processes:
FSDPStrategy becomes its CPU-capable subclass with the same settings) and the simulator
endpoint (the scripted OpenAI-compatible server on 127.0.0.1) changed. The recipe's
numerics stay: its weight dtype, its precision (bf16-mixed), its strategy's settings;
`twin_config` asserts that nothing else was changed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

from rlver.checkpoint.io import read_checkpoint_state
from tests.conftest import OFFICIAL_SAMPLE, REPO, run_cli, run_rlver, start_rlver

pytestmark = pytest.mark.slow

PAPER_RECIPES = [
    "ppo_think",  # env_normal is this recipe under another run name: its run serves both (below)
    "ppo_nothink",
    "grpo_think",
    "grpo_nothink",
    "env_hard",
    "ppo_think_reference_user",  # the RLVER reference's own user code (needs ../shared/sage-protocol)
    "ppo_think_lora",  # LoRA adapters on policy and critic, sized for one GPU
    "ppo_think_turn",  # turn-level GAE over per-turn emotion changes
    "grpo_think_turn",  # critic-free turn credit over per-turn emotion changes
]
TWIN_KEYS = {  # what a twin may change; everything else in the recipe stays as it is
    "trainer": {"accelerator", "devices", "num_nodes", "strategy", "max_steps", "callbacks", "precision"},
    "model": {"policy", "simulator", "rollout", "engine"},
    "data": {"profiles_per_step"},  # the paper's share of a rank (one profile) on the twin's ranks
}
API_KEY = "sk-twin-test-not-a-secret"
SAGE_PROTOCOL = REPO.parent / "shared" / "sage-protocol"


def twin_config(
    recipe: str,
    workdir: Path,
    model_dir: Path,
    server_url: str,
    *,
    steps=2,
    devices=2,
    vllm=False,
    float32_compute=False,
):
    """The recipe with the twin's overrides, written into `workdir` (runs/ lands there too).

    float32_compute: run at 32-true instead of the recipe's precision, for the tests that hold the
    engine's log-probs to the trainer's within 1e-3 after a weight sync (bf16 compute alone puts
    them ~4e-3 apart before any update); every other twin keeps the recipe's own numerics.
    """
    original = yaml.safe_load((REPO / "recipes" / f"{recipe}.yaml").read_text())
    config = json.loads(json.dumps(original))
    trainer, model = config["trainer"], config["model"]
    trainer.update(accelerator="cpu", devices=devices, num_nodes=1, max_steps=steps)
    if "profiles_per_step" in config.get("data", {}):
        config["data"]["profiles_per_step"] = devices  # 32 on 32 GPUs: one profile a rank
    if float32_compute:
        trainer["precision"] = "32-true"
    strategy = trainer.get("strategy")
    if isinstance(strategy, dict) and strategy["class_path"].endswith("FSDPStrategy"):
        # Lightning's FSDPStrategy refuses CPUs; this subclass differs only in allowing them.
        trainer["strategy"] = {**strategy, "class_path": "rlver.parallel.sharding.AnyDeviceFSDPStrategy"}
        assert trainer["strategy"]["init_args"] == strategy["init_args"]
    else:
        trainer["strategy"] = "ddp" if devices > 1 else "auto"
    trainer["callbacks"] = [
        *trainer.get("callbacks", []),
        {
            "class_path": "tests.harness.probes.WeightDigest",
            "init_args": {"out_dir": str(workdir / "digests")},
        },
    ]
    model.update(policy=str(model_dir))
    if isinstance(model.get("engine"), dict) and model["engine"].get("name") == "vllm":
        # vLLM costs ~15 s a rank to start on CPU: the twins that check it keep it, in float32,
        # with a KV cache sized to the tiny model (64 MiB: 65k of its tokens; every start writes it all).
        model["engine"] = (
            {**model["engine"], "dtype": "float32", "cpu_kv_cache_gib": 0.0625} if vllm else "hf"
        )
    simulator = model["simulator"] if isinstance(model["simulator"], dict) else {}
    if simulator.get("name") == "sage":
        model["simulator"] = {**simulator, "base_url": server_url, "timeout": 60}
    elif simulator.get("name") in ("sage_official", "rlver_reference"):
        if not SAGE_PROTOCOL.is_dir():
            pytest.skip(
                "the twin of a recipe running SAGE's / RLVER's own code needs ../shared/sage-protocol"
            )
        model["simulator"] = {**simulator, "base_url": server_url, "timeout": 60, "code": str(SAGE_PROTOCOL)}
    model["rollout"] = {**model.get("rollout", {}), "max_turns": 2, "max_new_tokens": 16}
    model["rollout"]["max_context_tokens"] = 1024
    for section in ("trainer", "model"):  # the numerics are the recipe's own
        for key in ("precision", "dtype", "lora", "ppo", "actor_lr", "critic_lr", "gradient_checkpointing"):
            if not (float32_compute and key == "precision"):
                assert original[section].get(key) == config[section].get(key), (section, key)
    for section, allowed in TWIN_KEYS.items():
        original.setdefault(section, {})
        changed = {
            k
            for k in {*original[section], *config.get(section, {})}
            if original[section].get(k) != config.get(section, {}).get(k)
        }
        assert changed <= allowed, changed - allowed
    assert {k: v for k, v in config.items() if k not in TWIN_KEYS} == {
        k: v for k, v in original.items() if k not in TWIN_KEYS
    }
    path = workdir / f"{recipe}.twin.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    return path


def lay_out_data(workdir: Path) -> None:
    """The recipes read data/rlver/*.jsonl: the official sample where ../shared has it."""
    folder = workdir / "data" / "rlver"
    folder.mkdir(parents=True, exist_ok=True)
    if OFFICIAL_SAMPLE.is_file():
        shutil.copy(OFFICIAL_SAMPLE, folder / "train_profile.jsonl")
        shutil.copy(OFFICIAL_SAMPLE, folder / "test_profile.jsonl")
    else:  # a clone without ../shared: the bundled English profiles, in the same format
        for split, name in (("train", "en_train"), ("test", "en_test")):
            shutil.copy(
                REPO / "rlver" / "data" / "profiles" / f"{name}.jsonl", folder / f"{split}_profile.jsonl"
            )


def run_fit(workdir: Path, *args, timeout=1800, command="fit", fresh=False):
    """`fresh`: in a new interpreter (its own string-hash seed), not forked from the warm launcher."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLVER_SIMULATOR_API_KEY": API_KEY}
    result = run_rlver([command, *args], cwd=workdir, env=env, timeout=timeout, fresh=fresh)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def launch(
    workdir: Path, config: Path, *extra: str, chaos: str = "", group: bool = False, fresh: bool = False
) -> subprocess.Popen:
    """`rlver fit` in the background; `group`: in a process group of its own (its ranks with it);
    `fresh`: in a new interpreter, not forked from the warm launcher."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLVER_SIMULATOR_API_KEY": API_KEY, "RLVER_CHAOS": chaos}
    argv = ["fit", "--config", config, *extra]
    return start_rlver(argv, cwd=workdir, env=env, new_session=group, fresh=fresh)


def digests(workdir: Path, ranks=2):
    return [json.loads((workdir / "digests" / f"digest_rank{r}.json").read_text()) for r in range(ranks)]


def read_scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {tag: [e.value for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


# --------------------------------------------------------------------------- whitening over ranks
def _whiten_on_rank(rank, port, out, rewards, values):
    import torch.distributed as dist
    from rlver_plugins.advantages import GAEEstimator

    from rlver.core.interfaces import AdvantageBatch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)

    def reduce_sum(tensor):
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor

    mask = torch.ones(1, len(values[rank]), dtype=torch.long)
    token_rewards = torch.zeros(1, len(values[rank]))
    token_rewards[0, -1] = rewards[rank]
    batch = AdvantageBatch(token_rewards, torch.tensor([values[rank]]), mask, torch.tensor([0]))
    batch.reduce_sum = reduce_sum
    torch.save(GAEEstimator()(batch).advantages, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def whiten_on_two_ranks(tmp_path, rewards, values):
    context = torch.multiprocessing.get_context("spawn")
    port = free_port()
    workers = [
        context.Process(target=_whiten_on_rank, args=(rank, port, str(tmp_path), rewards, values))
        for rank in range(2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=900)
        if worker.is_alive():
            worker.terminate()
            pytest.fail("a rank hung")
        assert worker.exitcode == 0
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]


def test_ppo_advantages_whitened_over_two_ranks_equal_one_process(tmp_path):
    """One dialogue per rank, as in the paper's PPO recipes: the reward must survive whitening."""
    from rlver_plugins.advantages import GAEEstimator

    from rlver.core.interfaces import AdvantageBatch

    values = [[0.1, 0.3, 0.2], [0.2, 0.1, 0.4]]
    split = whiten_on_two_ranks(tmp_path, [0.0, 1.0], values)
    token_rewards = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    together = GAEEstimator()(AdvantageBatch(token_rewards, torch.tensor(values), torch.ones(2, 3), None))
    assert torch.allclose(torch.cat(split), together.advantages, atol=1e-6)
    # The rewarded dialogue's tokens are pushed up, the unrewarded one's down.
    assert (split[1] > 0).all() and (split[0] < 0).all()


# --------------------------------------------------------------------------- failures and resume
FAULTY = "FAULTY-PERSONA-7"


def two_profiles(workdir: Path) -> None:
    """Two training profiles, one per rank each step; the first one's user always fails to open."""
    from rlver.data.profiles import load_profile_sets

    folder = workdir / "data" / "rlver"
    folder.mkdir(parents=True, exist_ok=True)
    first, second = load_profile_sets(["builtin:en_train"])[:2]
    lines = []
    for profile, marker in ((first, f"\n* Note: {FAULTY}"), (second, "")):
        record = profile.to_record()
        record.pop("first_talk", None)  # the user model writes the opening
        record["player"] += marker
        lines.append(json.dumps(record))
    (folder / "train_profile.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "test_profile.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("recipe", ["ppo_think", "grpo_nothink"])
def test_a_simulator_failing_on_one_rank_only_neither_hangs_nor_trains(recipe, tmp_path, tiny_model_dir):
    # Every request for the faulty persona's opening gets a 500: its rank's dialogues all end
    # with simulator_error before the policy speaks, so that rank has nothing to train on.
    faults = {(FAULTY, "open", n): "500" for n in range(1, 200)}
    with ScriptedServer(Script(faults=faults)) as server:
        two_profiles(tmp_path)
        config = twin_config(recipe, tmp_path, tiny_model_dir, server.url)
        fast = "{backoff_seconds: 0.01, backoff_max_seconds: 0.02, max_retries: 1}"
        twin = yaml.safe_load(config.read_text())
        twin["model"]["simulator"].update(yaml.safe_load(fast))
        config.write_text(yaml.safe_dump(twin, allow_unicode=True))
        run_fit(tmp_path, "--config", config, "--data.shuffle", "false", timeout=1800)
        assert server.script.served["500"] == 2 * 2  # one opening, tried twice, each step
    per_rank = digests(tmp_path)
    assert per_rank[0]["tensors"] == per_rank[1]["tensors"]
    assert per_rank[0]["metrics"] == per_rank[1]["metrics"]
    group = twin["model"]["group_size"]
    scalars = read_scalars(tmp_path / "runs" / recipe / "tensorboard")
    assert scalars["rollout/simulator_errors"] == [float(group)] * 2  # summed over ranks
    assert scalars["simulator/dialogue_errors"] == [1.0, 1.0]  # one failed opening, shared by its group
    records = [
        json.loads(line)
        for rank in range(2)
        for line in (tmp_path / "runs" / recipe / "tensorboard" / "rollouts" / f"train_rank{rank}.jsonl")
        .read_text()
        .splitlines()
    ]
    failed = [r for r in records if r["termination"] == "simulator_error"]
    assert len(failed) == 2 * group and all(r["num_turns"] == 0 for r in failed)
    assert all(
        FAULTY not in r["system_prompt"] for r in records
    )  # the persona is the user's, not the policy's


def test_two_process_resume_from_last_is_exact(tmp_path, tiny_model_dir, server):
    recipe = "ppo_nothink"  # a critic: its advantages are never all zero, so weights tell runs apart
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for workdir in (straight, resumed):
        workdir.mkdir()
        lay_out_data(workdir)
    # Lockstep: every engine call holds the same dialogues in both runs, whatever the timing of
    # the users' answers (tests/integration/test_chaos.py says why bitwise equality needs it).
    lockstep = ("--model.rollout.schedule", "lockstep")
    # Fresh: the runs compared differ in their string-hash seed too (warm launches share one).
    config = twin_config(recipe, straight, tiny_model_dir, server.url, steps=3)
    run_fit(straight, "--config", config, *lockstep, fresh=True)
    config = twin_config(recipe, resumed, tiny_model_dir, server.url, steps=3)
    run_fit(resumed, "--config", config, *lockstep, "--trainer.max_steps", "1")
    checkpoint = resumed / "runs" / recipe / "checkpoints" / "last.ckpt"
    assert checkpoint.is_dir()  # the recipe's FSDP sharded checkpoint: a folder of shards
    assert read_checkpoint_state(checkpoint)["global_step"] == 1
    run_fit(resumed, "--config", config, *lockstep, "--ckpt_path", "last")
    for rank in range(2):
        a, b = digests(straight)[rank], digests(resumed)[rank]
        assert a["step"] == b["step"] == 3
        assert a["tensors"] == b["tensors"], [k for k in a["tensors"] if a["tensors"][k] != b["tensors"][k]][
            :5
        ]
    # The resumed run's dialogues are those of the uninterrupted run, step for step.
    for rank in range(2):
        name = f"runs/{recipe}/tensorboard/rollouts/train_rank{rank}.jsonl"
        texts = [
            [
                (r["step"], r["profile_id"], [t["text"] for t in r["turns"]])
                for r in map(json.loads, path.read_text().splitlines())
            ]
            for path in (straight / name, resumed / name)
        ]
        assert texts[0] == texts[1]


def test_fsdp_twin_syncs_gathered_weights_into_each_ranks_vllm_and_its_checkpoint_exports_and_talks(
    tmp_path, tiny_model_dir, server
):
    """The paper's engine under the paper's strategy: sharded weights gathered, pushed into vLLM.
    FSDP writes last.ckpt as a folder of shards: export and rollout read it in one process (one
    2-rank run serves both checks: they were two runs of the same shape)."""
    lay_out_data(tmp_path)
    config = twin_config(
        "grpo_nothink", tmp_path, tiny_model_dir, server.url, steps=2, vllm=True, float32_compute=True
    )
    run_fit(tmp_path, "--config", config)
    per_rank = digests(tmp_path)
    assert per_rank[0]["tensors"] == per_rank[1]["tensors"]
    scalars = read_scalars(tmp_path / "runs" / "grpo_nothink" / "tensorboard")
    # Step 1 samples from weights gathered out of FSDP shards after an update.
    assert max(scalars["rollout/logprob_gap"]) < 1e-3, scalars["rollout/logprob_gap"]

    checkpoint = tmp_path / "runs" / "grpo_nothink" / "checkpoints" / "last.ckpt"
    assert checkpoint.is_dir()
    state = read_checkpoint_state(checkpoint)["state_dict"]
    out = tmp_path / "exported"
    result = run_cli("export", "--ckpt", checkpoint, "--out", out)
    assert result.returncode == 0, result.stderr[-2000:]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    name = "model.layers.1.mlp.down_proj.weight"
    trained = next(v for k, v in state.items() if k.endswith(name) and k.startswith("policy_model."))
    assert torch.equal(exported[name], trained)
    assert not torch.equal(trained, AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()[name])
    result = run_cli(
        "rollout",
        "--model.policy",
        tiny_model_dir,
        "--ckpt",
        checkpoint,
        "--limit",
        "1",
        "--model.rollout",
        "{max_turns: 1, max_new_tokens: 8}",
        "--out",
        tmp_path / "talk.jsonl",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (record,) = [json.loads(line) for line in (tmp_path / "talk.jsonl").read_text().splitlines()]
    assert record["model"].endswith(f"@{checkpoint}")


def test_fsdp2_twin_trains_on_two_processes(tmp_path, tiny_model_dir, server):
    """The same recipe under FSDP2 (`fully_shard` over ModelParallelStrategy's data-parallel mesh)."""
    lay_out_data(tmp_path)
    config = twin_config("ppo_think", tmp_path, tiny_model_dir, server.url, steps=2)
    twin = yaml.safe_load(config.read_text())
    twin["trainer"]["strategy"] = {
        "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
        "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1},
    }
    config.write_text(yaml.safe_dump(twin, allow_unicode=True))
    run_fit(tmp_path, "--config", config)
    per_rank = digests(tmp_path)
    assert [d["step"] for d in per_rank] == [2, 2]
    assert per_rank[0]["tensors"] == per_rank[1]["tensors"]
    checkpoint = tmp_path / "runs" / "ppo_think" / "checkpoints" / "last.ckpt"
    state = read_checkpoint_state(checkpoint)["state_dict"]
    assert any(k.startswith("value_model.") for k in state) and any(
        k.startswith("policy_model.") for k in state
    )


def test_default_root_dir_moves_logs_transcripts_and_checkpoints_together(tmp_path, tiny_model_dir):
    config = twin_config("quickstart_hard", tmp_path, tiny_model_dir, "", steps=1, devices=1)
    elsewhere = tmp_path / "elsewhere"
    run_fit(tmp_path, "--config", config, "--trainer.default_root_dir", elsewhere)
    assert not (tmp_path / "runs").exists()  # nothing left at the recipe's own folder
    assert (elsewhere / "checkpoints" / "last.ckpt").is_file()
    assert (elsewhere / "tensorboard" / "rollouts" / "train_rank0.jsonl").is_file()
    assert list((elsewhere / "tensorboard").glob("events.out.tfevents.*"))
