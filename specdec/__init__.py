"""specdec: plugin-based speculative decoding for Hugging Face Transformers models."""

from .core import DecodeOutput, DecodeState, DecodeStats, Draft, Step, Verdict
from .decoding import SpeculativeDecoder
from .errors import ConfigError, IncompatibleModelsError, InputError, PluginError, SpecdecError
from .core.hookspecs import hookimpl

__version__ = "0.1.0"

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
    "hookimpl",
]
