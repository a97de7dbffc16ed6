"""Drafters propose tokens for the target to check. One module per strategy, named after it."""

from ..core.components import Drafter
from .hidden_state import HiddenStateDrafter, HiddenStateHead
from .model import ModelDrafter
from .ngram import NGramDrafter
from .shared_encoder import SharedEncoderDrafter

__all__ = ["Drafter", "HiddenStateDrafter", "HiddenStateHead", "ModelDrafter", "NGramDrafter", "SharedEncoderDrafter"]
