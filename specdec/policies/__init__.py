"""Lookahead policies decide how many tokens each row drafts. One module per strategy."""

from .base import LookaheadPolicy
from .constant import ConstantLookahead
from .heuristic import HeuristicLookahead

__all__ = ["ConstantLookahead", "HeuristicLookahead", "LookaheadPolicy"]
