"""Made tests/data/pre_split/ (run with PYTHONPATH=<repo>): a 2-step `rlver fit` of the quickstart twin."""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
from tests.integration.test_multiprocess import run_fit, twin_config  # noqa: E402
from tests.integration.test_resume_unsplit_module_checkpoint import make_small_model  # noqa: E402

work = Path(tempfile.mkdtemp(prefix="pre_split_"))
model_dir = make_small_model(work / "model")
config = twin_config("quickstart", work, model_dir, "", steps=2, devices=1)
data = yaml.safe_load(config.read_text())
data["trainer"]["callbacks"] = [c for c in data["trainer"]["callbacks"] if "probes" not in c["class_path"]]
data["model"]["policy"] = "SMALL_MODEL"  # the test puts its regenerated model's folder here
out = REPO / "tests" / "data" / "pre_split"
(out / "quickstart.twin.yaml").write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
data["model"]["policy"] = str(model_dir)
config.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
result = run_fit(work, "--config", config, "--model.engine", "hf")
print(result.stdout[-1500:])
ckpt = work / "runs" / "quickstart" / "checkpoints" / "last.ckpt"
state = torch.load(ckpt, weights_only=True)
print("global_step", state["global_step"], "size", ckpt.stat().st_size)
shutil.copy(ckpt, out / "last.ckpt")
