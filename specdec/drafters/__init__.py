"""Drafters propose tokens for the target to check. One module per strategy, named after it."""

from ..core.components import Drafter
from .model import ModelDrafter
from .ngram import NGramDrafter
from .shared_encoder import SharedEncoderDrafter

__all__ = ["Drafter", "ModelDrafter", "NGramDrafter", "SharedEncoderDrafter"]
