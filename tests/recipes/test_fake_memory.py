"""The trainer's memory measured by the real models on fake tensors (benchmarks/fake_memory.py)
against `rlver plan`, at a small shape: the plan may overcount, never undercount (on a GPU an
undercount is an out-of-memory), and it stays within reach of the measurement."""

from __future__ import annotations

import sys

import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_the_plan_bounds_the_measured_memory_of_each_phase(tmp_path, tiny_model_dir):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import fake_memory

    recipe = yaml.safe_load((REPO / "recipes" / "ppo_think.yaml").read_text())
    recipe["model"]["policy"] = str(tiny_model_dir)
    recipe["model"]["rollout"]["max_context_tokens"] = 512
    recipe["trainer"].update(num_nodes=1, devices=2)
    path = tmp_path / "ppo_think_small.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = fake_memory.measure(str(path), world_size=2)
    rows = {row["phase"].split(" (")[0]: row for row in result["rows"]}
    assert set(rows) == {"trainer resident", "scoring", "update"}
    for name, row in rows.items():
        assert 0 < row["measured_gib"] <= row["planned_gib"], (name, row)
        assert row["measured_gib"] >= 0.3 * row["planned_gib"], (name, row)
    # Between steps a rank holds float32 shards and AdamW's two states (12 B a parameter); the
    # plan counts the gradient shards too (16 B), which exist only from the backward to the step.
    assert rows["trainer resident"]["ratio"] == pytest.approx(12 / 16, abs=0.01)
    assert rows["update"]["measured_at_peak"].get("Temp", 0) > 0  # the logits' gradient, at least
