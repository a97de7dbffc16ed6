"""The speculative loop and the preparation of a request for it. It sits above the strategies
it runs (their defaults included) and below the commands that run it."""

from .loop import SpeculativeDecoder

__all__ = ["SpeculativeDecoder"]
