"""The process-wide plugin manager: built-ins and entry points, registered the same way.

Built-in strategies are plugin modules listed in ``DEFAULT_PLUGINS``; third-party packages
declare an entry point in the ``specdec`` group. Each module's ``specdec_register`` hook is
called on its own, so one broken plugin is reported (``specdec plugins``) instead of stopping
the others from loading.
"""

from __future__ import annotations

import importlib
import importlib.metadata

import attrs
import pluggy

from ..core import hookspecs
from .registry import Registry

ENTRY_POINT_GROUP = "specdec"

DEFAULT_PLUGINS = (
    "specdec.drafters.fallback",
    "specdec.drafters.model",
    "specdec.drafters.hidden_state",
    "specdec.drafters.ngram",
    "specdec.drafters.shared_encoder",
    "specdec.policies.constant",
    "specdec.policies.cost_aware",
    "specdec.policies.heuristic",
    "specdec.policies.draft_confidence",
    "specdec.policies.target_confidence",
    "specdec.policies.classifier",
    "specdec.verifiers.greedy",
    "specdec.verifiers.rejection",
    "specdec.observers.stats",
    "specdec.observers.phases",
    "specdec.observers.progress",
    "specdec.observers.trace",
)


@attrs.frozen
class PluginFailure:
    plugin: str
    package: str
    error: str


@attrs.define
class Plugins:
    manager: pluggy.PluginManager
    registry: Registry
    failures: list[PluginFailure]
    packages: dict[str, str]


_loaded: Plugins | None = None


def _new_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    return manager


def load_plugins(refresh: bool = False) -> Plugins:
    """Load built-in and installed plugins once per process (``refresh`` re-reads entry points)."""
    global _loaded
    if _loaded is not None and not refresh:
        return _loaded
    manager = _new_manager()
    failures: list[PluginFailure] = []
    packages: dict[str, str] = {}

    for module_name in DEFAULT_PLUGINS:
        packages[module_name] = "specdec"
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # a built-in whose dependency is missing is reported like any plugin
            failures.append(PluginFailure(module_name, "specdec", f"{type(exc).__name__}: {exc}"))
            continue
        manager.register(module, name=module_name)

    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        package = entry_point.dist.name if entry_point.dist is not None else "?"
        if manager.get_plugin(entry_point.name) is not None or manager.is_blocked(entry_point.name):
            continue
        try:
            plugin = entry_point.load()
            manager.register(plugin, name=entry_point.name)
        except Exception as exc:  # one broken plugin must not stop the others
            failures.append(PluginFailure(entry_point.name, package, f"{type(exc).__name__}: {exc}"))
            continue
        packages[entry_point.name] = package

    registry = Registry()
    for impl in manager.hook.specdec_register.get_hookimpls():
        registry._from(impl.plugin_name, packages.get(impl.plugin_name, "?"))
        try:
            impl.function(registry=registry)
        except Exception as exc:
            failures.append(
                PluginFailure(impl.plugin_name, packages.get(impl.plugin_name, "?"), f"{type(exc).__name__}: {exc}")
            )
    registry.failures = failures
    _loaded = Plugins(manager=manager, registry=registry, failures=failures, packages=packages)
    return _loaded


def get_registry(refresh: bool = False) -> Registry:
    return load_plugins(refresh).registry
