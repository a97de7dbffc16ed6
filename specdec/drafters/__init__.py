"""Drafters propose tokens for the target to check. One module per strategy, named after it."""

from ..core.components import Drafter
from .fallback import FallbackDrafter
from .hidden_state import HiddenStateDrafter
from .model import ModelDrafter
from .ngram import NGramDrafter
from .shared_encoder import SharedEncoderDrafter

__all__ = ["Drafter", "FallbackDrafter", "HiddenStateDrafter", "HiddenStateHead", "ModelDrafter", "NGramDrafter", "SharedEncoderDrafter"]


def __getattr__(name: str):
    # The head is a torch module: imported on first use, so listing plugins does not import torch.
    if name == "HiddenStateHead":
        from .hidden_state_head import HiddenStateHead

        return HiddenStateHead
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
