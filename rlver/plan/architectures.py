"""A policy's architecture from its config.json, and the parameter counts that follow from it.

`rlver plan` sizes a run before any weights exist on the machine, so the config is found without
downloading anything: a local model folder, the Hugging Face cache, or one of the configs shipped
in `rlver/data/architectures/` (written from the published config.json files; the file name is the
hub id's last part, matched case-insensitively). The counts are exact for Llama-style decoders
(Llama, Qwen2, SmolLM2): embeddings, per layer q/k/v/o projections (q/k/v biases where
`attention_bias`, which Qwen2 has without saying so), the gated MLP (gate, up, down), two RMSNorms,
the final norm, and the LM head unless it is tied to the embeddings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from rlver.modeling.models import EMBEDDED_MODEL, cache_dir

_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


@dataclass(frozen=True)
class Architecture:
    """The sizes of a Llama-style decoder that memory depends on."""

    name: str
    source: str  # where the config was read: a path, or "shipped: <file>"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_positions: int | None = None  # config.json's max_position_embeddings: vLLM's default max_model_len

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str, source: str) -> Architecture:
        missing = [key for key in _REQUIRED if not isinstance(config.get(key), int)]
        if missing:
            raise ValueError(f"{source}: config.json lacks integer field(s) {', '.join(missing)}")
        heads = config["num_attention_heads"]
        qwen2 = config.get("model_type") == "qwen2"
        attention_bias = bool(config.get("attention_bias", qwen2))
        return cls(
            name=name,
            source=source,
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            vocab_size=config["vocab_size"],
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            o_bias=attention_bias and not qwen2,  # Qwen2's o_proj has no bias
            mlp_bias=bool(config.get("mlp_bias", False)),
            max_positions=config.get("max_position_embeddings"),
        )

    # ------------------------------------------------------------------ shapes
    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of a decoder layer, by its Hugging Face name."""
        h, inter = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, inter),
            "up_proj": (h, inter),
            "down_proj": (inter, h),
        }

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    # ------------------------------------------------------------------ parameter counts
    def decoder_layer_parameters(self) -> int:
        """One decoder layer: projections, their biases, and the two RMSNorms."""
        shapes = self.projections()
        weights = sum(fan_in * fan_out for fan_in, fan_out in shapes.values())
        biases = 0
        if self.qkv_bias:
            biases += sum(shapes[name][1] for name in ("q_proj", "k_proj", "v_proj"))
        if self.o_bias:
            biases += shapes["o_proj"][1]
        if self.mlp_bias:
            biases += sum(shapes[name][1] for name in ("gate_proj", "up_proj", "down_proj"))
        return weights + biases + 2 * self.hidden_size

    def largest_engine_module(self) -> int:
        """Parameters of vLLM's largest module (its fused q/k/v and gate/up projections, the
        embeddings or the LM head): its in-place reload materialises one module at a time."""
        shapes = self.projections()
        fused_qkv = self.hidden_size * sum(shapes[name][1] for name in ("q_proj", "k_proj", "v_proj"))
        fused_gate_up = self.hidden_size * 2 * self.intermediate_size
        return max(self.embedding_parameters(), fused_qkv, fused_gate_up)

    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    def parameter_count(self) -> int:
        """The causal LM: embeddings, layers, final norm, and the LM head unless tied."""
        head = 0 if self.tied_embeddings else self.embedding_parameters()
        return self.backbone_parameters() + head

    def backbone_parameters(self) -> int:
        """The base model without the LM head (what a critic is built on)."""
        return (
            self.embedding_parameters() + self.num_layers * self.decoder_layer_parameters() + self.hidden_size
        )

    def critic_parameter_count(self) -> int:
        """rlver's critic (rlver.modeling.critic.ValueModel): the backbone plus a 1-output value head."""
        return self.backbone_parameters() + self.hidden_size + 1

    def lora_parameters(self, rank: int, targets: tuple[str, ...]) -> int:
        """A and B matrices of one model's adapters: rank x (in + out) per targeted layer."""
        shapes = self._targeted(targets)
        return self.num_layers * rank * sum(fan_in + fan_out for fan_in, fan_out in shapes)

    def lora_targeted_weights(self, targets: tuple[str, ...]) -> int:
        """Base weights that get an adapter (what a merge rewrites)."""
        shapes = self._targeted(targets)
        return self.num_layers * sum(fan_in * fan_out for fan_in, fan_out in shapes)

    def _targeted(self, targets: tuple[str, ...]) -> list[tuple[int, int]]:
        shapes = self.projections()
        unknown = [name for name in targets if name not in shapes]
        if unknown:
            raise ValueError(
                f"--model.lora.target_modules: {', '.join(unknown)} not sized by rlver plan "
                f"(it knows {', '.join(shapes)})"
            )
        return [shapes[name] for name in targets]


# ---------------------------------------------------------------------- resolution
def shipped_architectures() -> dict[str, Path]:
    """The shipped config files by lower-case name (the hub id's last part)."""
    folder = resources.files("rlver.data") / "architectures"
    return {
        entry.name[: -len(".json")].lower(): Path(str(entry))
        for entry in folder.iterdir()
        if entry.name.endswith(".json")
    }


def resolve_architecture(policy: str) -> Architecture:
    """The architecture of `--model.policy`, read without downloading anything.

    A local folder's config.json; else the Hugging Face cache; else a shipped config whose name is
    the id's last part; else a ValueError naming the flag.
    """
    config_path = _local_config(policy) or _hub_cache_config(policy)
    if config_path is not None:
        source = str(config_path)
    else:
        shipped = shipped_architectures()
        config_path = shipped.get(policy.rstrip("/").rsplit("/", 1)[-1].lower())
        if config_path is None:
            raise ValueError(
                f"--model.policy: no config.json for {policy!r}: not a local model folder, not in the "
                f"Hugging Face cache, and not a shipped architecture ({', '.join(sorted(shipped))}); "
                f"fetch its config first (`hf download {policy} config.json`) or pass a local folder"
            )
        source = f"shipped: rlver/data/architectures/{config_path.name}"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--model.policy: cannot read {config_path}: {error}") from None
    return Architecture.from_config(config, name=policy, source=source)


def _local_config(policy: str) -> Path | None:
    if policy == EMBEDDED_MODEL:
        # The converted folder if an earlier run made it; converting here would load the weights.
        converted = sorted((cache_dir() / "models").glob(f"{EMBEDDED_MODEL}-*/config.json"))
        return converted[-1] if converted else None
    path = Path(policy).expanduser()
    if policy.startswith(("/", "./", "../", "~")) or path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model.policy: {path} is not a Hugging Face model folder (no config.json)")
        return path / "config.json"
    return None


def _hub_cache_config(policy: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(policy, "config.json")
    except (ImportError, ValueError):  # not a valid repo id
        return None
    return Path(cached) if isinstance(cached, str) else None
