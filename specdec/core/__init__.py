"""The floor every other part stands on: the data the loop moves (types, state), the KV cache
with holes, the model runners and loaders, the hook specifications and the component base
classes. It imports nothing of specdec above it.

Names are imported on first use (PEP 562), so ``import specdec.core.hookspecs`` (what every plugin
module does) costs no torch or transformers import.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Component": "components", "Drafter": "components", "LookaheadPolicy": "components",
    "Observer": "components", "Verifier": "components", "DecodeState": "state",
    "DecodeOutput": "types", "DecodeStats": "types", "Draft": "types", "Step": "types", "Verdict": "types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
