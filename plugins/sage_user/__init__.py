"""The `sage` user simulator: SAGE's LLM-played user over an OpenAI-compatible endpoint."""

from rlver import hookimpl
from rlver.hookspecs import Register

from .simulator import SageUserSession, SageUserSimulator

__all__ = ["SageUserSession", "SageUserSimulator", "rlver_register_simulators"]


@hookimpl
def rlver_register_simulators(register: Register) -> None:
    register("sage", SageUserSimulator)
