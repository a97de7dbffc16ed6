"""The loop and the data it moves. No strategy lives here."""

from .loop import SpeculativeDecoder
from .state import DecodeState
from .types import DecodeOutput, DecodeStats, Draft, Step, Verdict

__all__ = ["DecodeOutput", "DecodeState", "DecodeStats", "Draft", "SpeculativeDecoder", "Step", "Verdict"]
