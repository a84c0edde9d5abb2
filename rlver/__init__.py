"""rlver: RL for empathetic chat models with verifiable emotion rewards.

The code is in layers, each a subpackage that imports only those below it (docs/architecture.md
draws them; pyproject.toml's import-linter contracts check it): `core` (the plugin contract) at
the bottom, then `rl` and `data`, `parallel`, `modeling`, `checkpoint`, `rollout`, `plan` and
`evaluate`, `train`, `commands`, and `rlver.cli` on top.
"""

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("rlver")
"""Marker for plugin hook implementations: `@rlver.hookimpl`."""

__all__ = ["__version__", "hookimpl"]
