"""The base every component shares: a registered name and errors that name the plugin."""

from __future__ import annotations

import contextlib
from typing import ClassVar

from ..errors import PluginError


class Component:
    """Base of drafters, policies, verifiers and observers.

    ``name`` is the name the component is registered under (``ngram``, ``heuristic``, ...);
    ``kind`` is what it is. Both appear in every error the component raises while decoding.
    """

    kind: ClassVar[str] = "component"
    name: ClassVar[str] = ""

    @property
    def plugin_label(self) -> str:
        name = self.name or type(self).__name__
        return f"{self.kind} '{name}' ({type(self).__module__}.{type(self).__qualname__})"

    @contextlib.contextmanager
    def blame(self, hook: str):
        """Re-raise anything that escapes as a ``PluginError`` naming this plugin and the hook."""
        try:
            yield
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(
                f"{self.plugin_label} failed in {hook}: {type(exc).__name__}: {exc}",
                plugin=self.name or type(self).__name__,
                hook=hook,
            ) from exc
