"""Pluggy hook specifications, the plugin manager, the registry and plugins.toml loading."""

from .hookspecs import hookimpl, hookspec
from .manager import get_registry, load_plugins
from .registry import Registry

__all__ = ["Registry", "get_registry", "hookimpl", "hookspec", "load_plugins"]
