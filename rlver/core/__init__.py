"""The contract: what plugins implement and see, and the types every layer shares.

Holds the plugin interfaces (`interfaces`), the trajectory types a rollout produces
(`trajectory`), the hook specifications and the plugin registry (`hookspecs`, `plugins`),
profiles and user turns (`types`), SAGE's emotion rules (`emotion`), process-independent hashing
(`seeding`), one-line terminal output (`console`) and how a reply's words are counted (`wording`).

The bottom layer: it imports nothing else from rlver (only the package root's `hookimpl`). It is
rlver's public contract: plugins import from here (CONTRIBUTING.md, "Writing a plugin").
"""
