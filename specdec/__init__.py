"""specdec: plugin-based speculative decoding for Hugging Face Transformers models."""

from .core import DecodeOutput, DecodeState, DecodeStats, Draft, SpeculativeDecoder, Step, Verdict
from .errors import ConfigError, IncompatibleModelsError, InputError, PluginError, SpecdecError
from .plugins.hookspecs import hookimpl

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
