"""The `scripted` rollout engine: a fixed strategy in place of the policy, for probing simulators.

A simulated user is a verifiable reward only if the cheap ways to please it do not work. Each
strategy here is one such way (a stock sympathy line, the user's words handed back, agreement
with everything, a list of generic advice, a polite refusal, sorry for the user's own words then
a refusal, gladness at the user's trouble, one line said every turn, a reply of one word, a stage
direction acted out, one open question for everyone, not following what the user said, fluent
nonsense), in English and Chinese.
`rlver probe` runs every one against a recipe's simulator; `--model.engine '{name: scripted,
strategy: parrot}'` runs one anywhere an engine is named.
"""

from rlver_plugins.scripted_engine.engine import STRATEGIES, ScriptedEngine

from rlver import hookimpl

__all__ = ["STRATEGIES", "ScriptedEngine"]


@hookimpl
def rlver_register_engines(register):
    register("scripted", ScriptedEngine)
