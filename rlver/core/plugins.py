"""Plugin loading and the registries of named components.

Every plugin, built-in or third-party, is a module named in the `rlver`
entry-point group. Loading calls `check_pending()`, so a hook implementation
with a misspelt name is an error instead of a silent no-op.

Environment:
    RLVER_DISABLE_PLUGINS: comma-separated entry-point names not to load.
    RLVER_TRACE_HOOKS: set to 1 to print every hook call to stderr.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TypeVar

import pluggy

from rlver.core import hookspecs
from rlver.core.interfaces import Component
from rlver.core.legacy_paths import legacy_module_paths

ENTRY_POINT_GROUP = "rlver"
T = TypeVar("T")

# kind -> registration hook; kinds are the plural nouns used in `rlver plugins`.
REGISTRATION_HOOKS: dict[str, str] = {
    "simulators": "rlver_register_simulators",
    "rewards": "rlver_register_rewards",
    "advantages": "rlver_register_advantages",
    "formats": "rlver_register_formats",
    "engines": "rlver_register_engines",
    "judges": "rlver_register_judges",
}


class PluginError(Exception):
    """A plugin could not be loaded or a component could not be resolved."""


@dataclass(frozen=True)
class Registration:
    name: str
    factory: Callable[..., Any]
    plugin: str


@dataclass
class PluginInfo:
    name: str
    module: str
    version: str | None
    registers: dict[str, list[str]] = field(default_factory=dict)


class Registry:
    """All registered components, by kind and name, with the plugin behind each."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("rlver")
        self.pm.add_hookspecs(hookspecs)
        self._entries: dict[str, dict[str, Registration]] = {kind: {} for kind in REGISTRATION_HOOKS}
        self.plugins: dict[str, PluginInfo] = {}
        self.tracing = os.environ.get("RLVER_TRACE_HOOKS") == "1"
        if self.tracing:
            self.pm.trace.root.setwriter(lambda message: sys.stderr.write(f"[rlver hooks] {message}"))
            self.pm.enable_tracing()

    # ------------------------------------------------------------------ loading
    def load_entry_points(self) -> None:
        disabled = {n.strip() for n in os.environ.get("RLVER_DISABLE_PLUGINS", "").split(",") if n.strip()}
        for entry_point in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name):
            if entry_point.name in disabled or entry_point.name in self.plugins:
                continue
            try:
                with legacy_module_paths():  # a plugin written against the flat layout's imports
                    module = entry_point.load()
            except Exception as error:  # a broken plugin must say which one it is
                raise PluginError(
                    f"plugin {entry_point.name!r} ({entry_point.value}) failed to import: {error}"
                ) from error
            version = entry_point.dist.version if entry_point.dist is not None else None
            self.add(module, name=entry_point.name, version=version)

    def add(self, plugin: object, *, name: str, version: str | None = None) -> None:
        """Register a plugin object (module or instance) and collect what it registers."""
        if name in self.plugins:
            raise PluginError(f"a plugin named {name!r} is already loaded")
        self.pm.register(plugin, name=name)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as error:
            self.pm.unregister(name=name)
            raise PluginError(f"plugin {name!r}: {error}") from error
        info = PluginInfo(
            name=name, module=getattr(plugin, "__name__", type(plugin).__name__), version=version
        )
        self.plugins[name] = info
        for kind, hook_name in REGISTRATION_HOOKS.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin_name == name:
                    # Called one plugin at a time (to know who registered what), so traced here.
                    if self.tracing:
                        sys.stderr.write(f"[rlver hooks] {hook_name}(register) in plugin {name!r}\n")
                    impl.function(register=self._register_function(kind, name, info))

    def _register_function(self, kind: str, plugin_name: str, info: PluginInfo) -> hookspecs.Register:
        def register(component_name: str, factory: Callable[..., Any]) -> None:
            if not isinstance(component_name, str) or not component_name:
                raise PluginError(f"plugin {plugin_name!r} registered a {kind[:-1]} with an empty name")
            if not callable(factory):
                raise PluginError(f"plugin {plugin_name!r}: {kind[:-1]} {component_name!r} is not callable")
            existing = self._entries[kind].get(component_name)
            if existing is not None:
                raise PluginError(
                    f"{kind[:-1]} {component_name!r} is registered twice: "
                    f"by plugin {existing.plugin!r} and by plugin {plugin_name!r}"
                )
            self._entries[kind][component_name] = Registration(component_name, factory, plugin_name)
            info.registers.setdefault(kind, []).append(component_name)

        return register

    # ------------------------------------------------------------------ lookup
    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[self._check_kind(kind)])

    def get(self, kind: str, name: str) -> Registration:
        entries = self._entries[self._check_kind(kind)]
        if name not in entries:
            available = ", ".join(sorted(entries)) or "none installed"
            raise PluginError(f"unknown {kind[:-1]} {name!r}; available: {available}")
        return entries[name]

    def build(self, kind: str, spec: str | Mapping[str, Any], *, flag: str, **context: Any) -> Any:
        """Create a component from a config spec: "name" or {"name": ..., <options>}.

        `flag` is the config key the spec came from, used in error messages.
        `context` holds arguments the framework passes itself (e.g. `policy=`).
        """
        registration, options = self.check(kind, spec, flag=flag, context=set(context))
        return registration.factory(**context, **options)

    def check(
        self, kind: str, spec: str | Mapping[str, Any], *, flag: str, context: set[str] | None = None
    ) -> tuple[Registration, dict[str, Any]]:
        """Resolve a spec's name and check its options without building anything."""
        name, options = split_spec(spec, flag=flag)
        try:
            registration = self.get(kind, name)
        except PluginError as error:
            raise PluginError(f"{flag}: {error}") from None
        check_options(registration.factory, options, flag=flag, reserved=context or set())
        return registration, options

    def call_observers(self, hook_name: str, **kwargs: Any) -> None:
        getattr(self.pm.hook, hook_name)(**kwargs)

    @staticmethod
    def _check_kind(kind: str) -> str:
        if kind not in REGISTRATION_HOOKS:
            raise PluginError(f"unknown component kind {kind!r}; kinds: {', '.join(REGISTRATION_HOOKS)}")
        return kind

    def describe(self) -> list[dict[str, Any]]:
        """What `rlver plugins` prints."""
        return [
            {"name": info.name, "module": info.module, "version": info.version, "registers": info.registers}
            for info in sorted(self.plugins.values(), key=lambda i: i.name)
        ]


def plain_config(value: Any) -> Any:
    """Config values may arrive as jsonargparse Namespaces; components get plain dicts and lists."""
    if hasattr(value, "as_dict"):
        return plain_config(value.as_dict())
    if isinstance(value, Mapping):
        return {k: plain_config(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_config(v) for v in value]
    return value


def split_spec(spec: str | Mapping[str, Any], *, flag: str) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, Mapping):
        options = dict(spec)
        name = options.pop("name", None)
        if not isinstance(name, str) or not name:
            raise PluginError(f"{flag}: needs a 'name' (got {dict(spec)!r})")
        return name, options
    raise PluginError(f"{flag}: expected a name or a mapping with 'name', got {type(spec).__name__}")


def check_options(
    factory: Callable[..., Any], options: Mapping[str, Any], *, flag: str, reserved: set[str]
) -> None:
    """Reject options the factory does not accept, naming the flag and the accepted ones.

    A plugin class's `renamed_options` (declared on `interfaces.Component`) names old options it
    still takes (mapping them itself, with a warning): those pass too, unlisted.
    """
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [
        n for n, p in params.items() if n not in reserved and n != "self" and p.kind is not p.VAR_POSITIONAL
    ]
    old_names = (
        set(factory.renamed_options)
        if isinstance(factory, type) and issubclass(factory, Component)
        else set()
    )
    for key in options:
        if key not in accepted and key not in old_names:
            raise PluginError(f"{flag}.{key}: unknown option; accepted: {', '.join(accepted) or 'none'}")


def implementing(interface: type[T], component: Any, flag: str) -> T:
    """`component`, once it is shown to implement `interface`: core reads only what the
    interface declares, so a plugin that does not subclass it is refused here, by its flag."""
    if not isinstance(component, interface):
        raise PluginError(
            f"{flag}: built a {type(component).__name__}, which does not implement "
            f"rlver.core.interfaces.{interface.__name__} (subclass it: CONTRIBUTING.md, 'Writing a plugin')"
        )
    return component


_default_registry: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, with every entry-point plugin loaded."""
    global _default_registry
    if _default_registry is None:
        registry = Registry()
        registry.load_entry_points()
        _default_registry = registry
    return _default_registry


def reset_registry() -> None:
    """Forget the loaded plugins (tests that install plugins call this)."""
    global _default_registry
    _default_registry = None
