"""The default user simulator, "embedded": a rule-based affective user that needs no LLM."""

from rlver import hookimpl
from rlver.core.hookspecs import Register

from .simulator import EmbeddedUserSession, EmbeddedUserSimulator

__all__ = ["EmbeddedUserSession", "EmbeddedUserSimulator", "rlver_register_simulators"]


@hookimpl
def rlver_register_simulators(register: Register) -> None:
    register("embedded", EmbeddedUserSimulator)
