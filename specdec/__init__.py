"""specdec: plugin-based speculative decoding for Hugging Face Transformers models.

The public names below are imported on first use (PEP 562): ``import specdec`` and the command
line's ``--help`` cost no torch or transformers import; ``specdec.SpeculativeDecoder`` does.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from .core.hookspecs import hookimpl
from .errors import ConfigError, IncompatibleModelsError, InputError, PluginError, SpecdecError

__version__ = "0.1.0"

_LAZY = {
    "DecodeOutput": ".core.types",
    "DecodeStats": ".core.types",
    "Draft": ".core.types",
    "Step": ".core.types",
    "Verdict": ".core.types",
    "DecodeState": ".core.state",
    "SpeculativeDecoder": ".decoding",
}

__all__ = [
    "ConfigError",
    "DecodeOutput",
    "DecodeState",
    "DecodeStats",
    "Draft",
    "IncompatibleModelsError",
    "InputError",
    "PluginError",
    "SpecdecError",
    "SpeculativeDecoder",
    "Step",
    "Verdict",
    "__version__",
    "bundled_pair_path",
    "hookimpl",
]


def bundled_pair_path() -> Path:
    """The folder of the bundled demo pair (``target/``, ``draft/``, ``classifier.safetensors``,
    ``prompts.jsonl``), wherever Python is started from.

    The pair is not package data: it lives in ``models/python-pair/`` at the root of the
    repository this package was installed from (an editable install, ``pip install -e .``,
    keeps ``specdec/`` inside that repository). ``SPECDEC_PAIR`` overrides the location, for a
    copy of the folder elsewhere. Raises ``FileNotFoundError`` saying so when neither exists
    (a wheel install has no bundled pair).
    """
    import os

    override = os.environ.get("SPECDEC_PAIR")
    path = Path(override) if override else Path(__file__).resolve().parent.parent / "models" / "python-pair"
    if not (path / "target").is_dir():
        raise FileNotFoundError(
            f"the bundled pair is not at {path}: it ships in the repository (models/python-pair), not in the "
            "package; install specdec with `pip install -e .` from a clone, or set SPECDEC_PAIR to a copy"
        )
    return path


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
