"""The floor every other part stands on: the data the loop moves (types, state), the KV cache
with holes, the model runners and loaders, the hook specifications and the component base
classes. It imports nothing of specdec above it."""

from .components import Component, Drafter, LookaheadPolicy, Observer, Verifier
from .state import DecodeState
from .types import DecodeOutput, DecodeStats, Draft, Step, Verdict

__all__ = [
    "Component", "DecodeOutput", "DecodeState", "DecodeStats", "Draft", "Drafter", "LookaheadPolicy",
    "Observer", "Step", "Verdict", "Verifier",
]
