"""The `hf` rollout engine: transformers `generate` on the training module itself."""

from rlver_plugins.hf_engine.engine import HFEngine

from rlver import hookimpl

__all__ = ["HFEngine"]


@hookimpl
def rlver_register_engines(register):
    register("hf", HFEngine)
