"""Plugin discovery: the process-wide pluggy manager (built-ins and entry points) and the registry
of named components. The hooks themselves are specified in ``specdec/core/hookspecs.py``."""

from .manager import get_registry, load_plugins
from .registry import Registry

__all__ = ["Registry", "get_registry", "load_plugins"]
