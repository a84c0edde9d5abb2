"""The `vllm` rollout engine: an in-process vLLM engine with live weight sync."""

from rlver_plugins.vllm_engine.engine import VLLMEngine

from rlver import hookimpl

__all__ = ["VLLMEngine"]


@hookimpl
def rlver_register_engines(register):
    register("vllm", VLLMEngine)
