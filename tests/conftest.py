from __future__ import annotations

import os
import subprocess
import sys
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


def run_cli(*args, env=None, check=False):
    """Run `rlver <args>` in a fresh interpreter from the repo root; `env` adds variables."""
    return subprocess.run(
        [sys.executable, "-m", "rlver.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=check,
        env=None if env is None else {**os.environ, **env},
    )
