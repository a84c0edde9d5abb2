"""A checkpoint written before module.py and distributed.py were split still resumes."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import REPO, small_llama

sys.path.insert(0, str(REPO / "tests" / "gpu"))

FIXTURE = REPO / "tests" / "data" / "pre_split"


def make_small_model(folder: Path) -> Path:
    """The 1-layer, 512-word Llama (tied embeddings) the fixture was made on, with a word tokenizer.

    The embedded model's tokenizer gives prompts ids far above 512; tests/gpu/gpu_check_parts.py's
    word tokenizer fills exactly the model's 512 ids (text outside it becomes [UNK]).
    """
    from gpu_check_parts import word_tokenizer

    small_llama().save_pretrained(folder)
    word_tokenizer(512).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_checkpoint_written_before_the_split_resumes_and_trains_step_3(tmp_path):
    from tests.integration.test_multiprocess import run_fit

    model_dir = make_small_model(tmp_path / "model")
    config = yaml.safe_load((FIXTURE / "quickstart.twin.yaml").read_text())
    config["model"]["policy"] = str(model_dir)
    config["trainer"]["max_steps"] = 3
    path = tmp_path / "quickstart.twin.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    resumed_from = tmp_path / "pre_split.ckpt"
    shutil.copy(FIXTURE / "last.ckpt", resumed_from)
    fixture = torch.load(resumed_from, map_location="cpu", weights_only=True)
    assert fixture["global_step"] == 2
    # saved where the fixture was made: the config's folder must win (Lightning's own CLI would
    # take the checkpoint file's `model.*` settings and look for that folder)
    assert fixture["hyper_parameters"]["policy"] != str(model_dir)

    run_fit(tmp_path, "--config", path, "--ckpt_path", resumed_from)

    last = torch.load(
        tmp_path / "runs" / "quickstart" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True
    )
    assert last["global_step"] == 3
    assert last["hyper_parameters"]["policy"] == str(model_dir)
    before = torch.load(resumed_from, map_location="cpu", weights_only=True)["state_dict"]
    assert before.keys() == last["state_dict"].keys()
    assert any(not torch.equal(before[name], last["state_dict"][name]) for name in before)  # step 3 trained
