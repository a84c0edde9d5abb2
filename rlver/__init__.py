"""rlver: RL for empathetic chat models with verifiable emotion rewards."""

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("rlver")
"""Marker for plugin hook implementations: `@rlver.hookimpl`."""

__all__ = ["__version__", "hookimpl"]
