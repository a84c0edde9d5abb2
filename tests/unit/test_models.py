"""The embedded model: converted from the packaged GGUF once, quietly, into the cache folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

# As `rlver` runs it: the libraries' chatter and bars quieted first (rlver.core.console).
CONVERT = (
    "from rlver.core.console import quiet_libraries; quiet_libraries(); "
    "from rlver.modeling.models import embedded_model_folder; print(embedded_model_folder())"
)


@pytest.mark.slow
def test_the_first_use_converts_the_packaged_gguf_without_a_progress_bar(tmp_path):
    env = {**os.environ, "RLVER_CACHE_DIR": str(tmp_path)}
    env.pop("RLVER_VERBOSE", None)
    result = subprocess.run(
        [sys.executable, "-c", CONVERT], capture_output=True, text=True, cwd=REPO, env=env, timeout=1800
    )
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "models" / result.stdout.strip().rsplit("/", 1)[-1]
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    assert "quantization_config" not in (folder / "config.json").read_text()
    output = result.stdout + result.stderr
    assert "converting the embedded SmolLM2 weights" in output  # rlver's one line says what happens
    assert "de-quantizing" not in output and "it/s]" not in output, output[-2000:]  # no bar


def test_the_conversion_parses_the_gguf_once_and_puts_the_libraries_back():
    gguf = pytest.importorskip("gguf")
    import importlib.util
    from pathlib import Path

    from rlver.modeling import models

    spec = importlib.util.find_spec(models._GGUF_PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / models._GGUF_FILE
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with models._quiet_gguf_reading():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # the ~50k-entry vocabulary parsed once
        assert "tokenizer.ggml.tokens" in first.fields
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
