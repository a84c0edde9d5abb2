"""The recipes' miniature twins, 2 processes over gloo (CPU): every recipe trains as it is written.

A twin (tests.integration.test_multiprocess.twin_config) is the recipe with only the model, steps, devices and
the simulator endpoint changed; its dtype, precision and strategy settings are the recipe's own.
A file of their own: xdist keeps a file on one worker, and these runs are the suite's longest.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.conftest import REPO
from tests.integration.test_multiprocess import (
    PAPER_RECIPES,
    digests,
    lay_out_data,
    read_scalars,
    run_fit,
    twin_config,
)

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- the recipes' twins
def test_env_normal_is_ppo_think_under_another_name():
    """So the ppo_think twin's run checks env_normal too (one run of that shape, not two)."""
    recipes = [
        yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())
        for name in ("ppo_think", "env_normal")
    ]
    for recipe in recipes:
        recipe["trainer"].pop("default_root_dir")
    assert recipes[0] == recipes[1]


@pytest.mark.parametrize("recipe", PAPER_RECIPES)
def test_paper_recipe_twin_trains_on_two_processes(recipe, tmp_path, tiny_model_dir, server):
    lay_out_data(tmp_path)
    config = twin_config(recipe, tmp_path, tiny_model_dir, server.url)
    run_fit(tmp_path, "--config", config)
    per_rank = digests(tmp_path)
    assert [d["step"] for d in per_rank] == [2, 2]
    # DDP kept the replicas identical: every tensor, policy and critic alike.
    assert per_rank[0]["tensors"] == per_rank[1]["tensors"]
    # At the recipe's own dtype, precision and learning rate the policy's weights really moved.
    assert per_rank[0]["policy_changed_fraction"] >= 0.9, per_rank[0]["policy_changed_fraction"]
    assert any(name.startswith("value_model.") for name in per_rank[0]["tensors"]) == recipe.startswith(
        ("ppo", "env")
    )
    if recipe.endswith("reference_user"):  # the reference's own think prompt reached the policy
        first = json.loads(
            (tmp_path / "runs" / recipe / "tensorboard" / "rollouts" / "train_rank0.jsonl")
            .read_text()
            .splitlines()[0]
        )
        assert (
            first["system_prompt"].strip().startswith("你在和你的朋友聊天") and first["start_emotion"] == 30
        )
    run_dir = tmp_path / "runs" / recipe
    scalars = read_scalars(run_dir / "tensorboard")
    assert len(scalars["reward/total"]) == 2 and len(scalars["ppo/grad_norm"]) == 2
    assert scalars["rollout/simulator_errors"] == [0.0, 0.0]
    # Every rank wrote its own dialogues; a step holds the whole world's batch.
    transcripts = [
        json.loads(line)
        for rank in range(2)
        for line in (run_dir / "tensorboard" / "rollouts" / f"train_rank{rank}.jsonl")
        .read_text()
        .splitlines()
    ]
    original = yaml.safe_load((REPO / "recipes" / f"{recipe}.yaml").read_text())
    group, data = original["model"]["group_size"], original["data"]
    batch = 1 if "profiles_per_step" in data else data["batch_size"]  # a twin: one profile a rank
    profiles = len((tmp_path / "data" / "rlver" / "train_profile.jsonl").read_text().splitlines())
    assert len(transcripts) == 2 * 2 * group * min(batch, profiles // 2)
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    assert checkpoint.exists()
    assert per_rank[0]["metrics"] == per_rank[1]["metrics"]  # the same keys on every rank


# --------------------------------------------------------------------------- the laptop recipes
def test_curriculum_twin_with_a_vllm_engine_per_rank(tmp_path, tiny_model_dir):
    """Each rank runs its own in-process vLLM engine and pushes its updated weights into it
    (curriculum: a laptop recipe that keeps vLLM; the quickstart generates with hf)."""
    config = twin_config("curriculum", tmp_path, tiny_model_dir, "", steps=2, vllm=True, float32_compute=True)
    result = run_fit(tmp_path, "--config", config)
    assert result.stdout.count("greedy mean final emotion") == 1  # rank 0 prints it
    per_rank = digests(tmp_path)
    assert per_rank[0]["tensors"] == per_rank[1]["tensors"]
    scalars = read_scalars(tmp_path / "runs" / "curriculum" / "tensorboard")
    # Step 1 samples after an update: the engines hold the trained weights (fp32 on both sides).
    assert max(scalars["rollout/logprob_gap"]) < 1e-3, scalars["rollout/logprob_gap"]
    assert all(seconds > 0 for seconds in scalars["perf/weight_sync_seconds"])


def test_overlapped_curriculum_twin_on_two_ranks_with_a_vllm_engine_each(tmp_path, tiny_model_dir):
    """`--model.overlap` on two ranks: each rank's next-step rollout runs on its own engine
    during the update, both ranks train alike, and the first step, sampled by the very weights
    it trains (float32 on both sides), has importance weights of exactly 1."""
    config = twin_config("curriculum", tmp_path, tiny_model_dir, "", steps=3, vllm=True, float32_compute=True)
    twin = yaml.safe_load(config.read_text())
    twin["model"]["overlap"] = {"max_importance_weight": 2.0}
    twin["trainer"]["callbacks"] = [
        c for c in twin["trainer"]["callbacks"] if "BeforeAfter" not in c["class_path"]
    ]
    config.write_text(yaml.safe_dump(twin))
    run_fit(tmp_path, "--config", config)
    per_rank = digests(tmp_path)
    assert per_rank[0]["step"] == 3 and per_rank[0]["tensors"] == per_rank[1]["tensors"]
    scalars = read_scalars(tmp_path / "runs" / "curriculum" / "tensorboard")
    assert scalars["offpolicy/staleness"] == [0.0, 1.0, 1.0]
    assert scalars["offpolicy/importance_weight_max"][0] == pytest.approx(1.0, abs=1e-3)
    # the engine takes the weights before each rollout: steps 1 and 2 start the next one
    assert all(seconds > 0 for seconds in scalars["perf/weight_sync_seconds"][:2])


@pytest.mark.parametrize("recipe", ["quickstart", "quickstart_hard", "curriculum"])
def test_laptop_recipe_twin_trains(recipe, tmp_path, tiny_model_dir):
    config = twin_config(recipe, tmp_path, tiny_model_dir, "", steps=2, devices=1)
    result = run_fit(tmp_path, "--config", config)
    (digest,) = digests(tmp_path, ranks=1)
    assert digest["step"] == 2
    # The recipe's own before/after evaluation closes the run, with where to look next.
    assert "greedy mean final emotion of 64 held-out users (test, evaluation seed 0" in result.stdout
    assert "before training" in result.stdout
    # the paired change with its interval over users, and every user's scores beside the run
    assert re.search(
        r"after 2 steps\s+[\d.]+\s+\([+-][\d.]+( \[[+-][\d.]+, [+-][\d.]+\])?; \d+/64 users", result.stdout
    )
    (record,) = (tmp_path / "runs" / recipe).rglob("before_after.json")
    scores = json.loads(record.read_text())
    assert len(scores["before"]) == len(scores["after"]) == 64 and scores["step"] == 2
    # ... and the greedy dialogues themselves, to read why a score moved
    dialogues = [json.loads(line) for line in (record.parent / "before_after" / "after.jsonl").open()]
    assert len(dialogues) == 64 and {d["profile_id"] for d in dialogues} == set(scores["after"])
    assert all(
        d["turns"][0]["role"] == "user" and d["final_emotion"] == scores["after"][d["profile_id"]]
        for d in dialogues
    )
    assert f"runs/{recipe}/checkpoints/last.ckpt" in result.stdout
    if recipe == "quickstart_hard":  # and users it never trained against (issue 56): the rubric alone
        assert re.search(r"on rubric\s+[\d.]+ -> [\d.]+\s+\([+-][\d.]+", result.stdout)
        rubric = scores["evaluations"]["rubric"]
        assert set(rubric["before"]) == set(rubric["after"]) == set(scores["after"])
        assert rubric["spec"] == {"name": "embedded", "judge": "rubric", "difficulty": "normal"}
        assert (record.parent / "before_after" / "after.rubric.jsonl").is_file()


@pytest.mark.parametrize("recipe", ["sentient_eval", "sentient_eval_own_prompts"])
def test_sentient_eval_twin_on_two_processes(recipe, tmp_path, tiny_model_dir, server):
    """`rlver test` on the benchmark recipes: both ranks' dialogues are scored together."""
    config = twin_config(recipe, tmp_path, tiny_model_dir, server.url, devices=2)
    twin = yaml.safe_load(config.read_text())
    twin["trainer"].pop("max_steps")
    twin["trainer"]["callbacks"] = []
    config.write_text(yaml.safe_dump(twin, allow_unicode=True))
    result = run_fit(tmp_path, "--config", config, command="test")
    assert "Sentient benchmark (100 dialogues" in result.stdout
    records = [
        json.loads(line)
        for path in sorted((tmp_path / "runs" / recipe.replace("_eval", "") / "sentient").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    assert len(records) == 100 and len({r["id"] for r in records}) == 100
