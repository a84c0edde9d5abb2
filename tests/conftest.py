from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
OFFICIAL_SAMPLE = SHARED / "data" / "rlver_train_profiles_sample.jsonl"


@pytest.fixture(scope="session")
def policy():
    """The real embedded SmolLM2 policy, loaded once per test session."""
    from rlver.models import load_policy

    return load_policy("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tokenizer(policy):
    return policy.tokenizer
