"""Drafters propose tokens for the target to check. One module per strategy, named after it."""

from .base import Drafter
from .model import ModelDrafter
from .ngram import NGramDrafter

__all__ = ["Drafter", "ModelDrafter", "NGramDrafter"]
