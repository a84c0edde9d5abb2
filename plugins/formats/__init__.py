"""Built-in prompt formats: `think` (<think>...</think> then the reply) and `nothink`."""

from rlver_plugins.formats.formats import NoThinkFormat, ThinkFormat

from rlver import hookimpl

__all__ = ["NoThinkFormat", "ThinkFormat"]


@hookimpl
def rlver_register_formats(register):
    register("think", ThinkFormat)
    register("nothink", NoThinkFormat)
