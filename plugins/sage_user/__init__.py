"""LLM-played users over an OpenAI-compatible endpoint.

- `sage`: SAGE's two calls per turn with rlver's own prompts (English and Chinese).
- `sage_official`: SAGE's own simulator code from a checkout (leaderboard-comparable).
- `rlver_reference`: the RLVER reference's training user code from a checkout.
"""

from rlver import hookimpl
from rlver.core.hookspecs import Register

from .official import ReferenceUserSimulator, SageOfficialSimulator
from .simulator import SageUserSession, SageUserSimulator

__all__ = [
    "ReferenceUserSimulator",
    "SageOfficialSimulator",
    "SageUserSession",
    "SageUserSimulator",
    "rlver_register_simulators",
]


@hookimpl
def rlver_register_simulators(register: Register) -> None:
    register("sage", SageUserSimulator)
    register("sage_official", SageOfficialSimulator)
    register("rlver_reference", ReferenceUserSimulator)
