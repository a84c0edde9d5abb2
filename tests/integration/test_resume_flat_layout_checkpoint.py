"""A checkpoint written by the flat rlver/ layout (before issue 40's subpackages) resumes for step 3.

Its YAML names the callback by the old class path (`rlver.callbacks.BeforeAfter`), as a recipe or a
saved config of that time does; the checkpoint's callback states and loops are matched by name.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from tests.conftest import REPO

FIXTURE = REPO / "tests" / "data" / "pre_layers"


@pytest.mark.slow
def test_a_checkpoint_of_the_flat_layout_resumes_and_trains_step_3(tmp_path):
    from tests.integration.test_multiprocess import run_fit
    from tests.integration.test_resume_unsplit_module_checkpoint import make_small_model

    model_dir = make_small_model(tmp_path / "model")
    config = yaml.safe_load((FIXTURE / "quickstart.twin.yaml").read_text())
    assert "rlver.callbacks.BeforeAfter" in [c["class_path"] for c in config["trainer"]["callbacks"]]
    config["model"]["policy"] = str(model_dir)
    config["trainer"]["max_steps"] = 3
    path = tmp_path / "quickstart.twin.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    resumed_from = tmp_path / "pre_layers.ckpt"
    shutil.copy(FIXTURE / "last.ckpt", resumed_from)
    before = torch.load(resumed_from, map_location="cpu", weights_only=True)
    assert before["global_step"] == 2

    run_fit(tmp_path, "--config", path, "--ckpt_path", resumed_from)

    last = torch.load(
        tmp_path / "runs" / "quickstart" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True
    )
    assert last["global_step"] == 3
    assert before["state_dict"].keys() == last["state_dict"].keys()
    assert any(not torch.equal(before["state_dict"][n], last["state_dict"][n]) for n in before["state_dict"])
    assert before["callbacks"].keys() <= last["callbacks"].keys()  # the same state keys, carried on
    assert before["rlver_rng"].keys() == last["rlver_rng"].keys()
