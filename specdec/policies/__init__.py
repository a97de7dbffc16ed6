"""Lookahead policies decide how many tokens each row drafts. One module per strategy."""

from ..core.components import LookaheadPolicy
from .classifier import ClassifierLookahead
from .constant import ConstantLookahead
from .cost_aware import CostAwareLookahead
from .draft_confidence import DraftConfidenceLookahead
from .heuristic import HeuristicLookahead
from .target_confidence import TargetConfidenceLookahead

__all__ = [
    "ClassifierLookahead",
    "ConstantLookahead",
    "CostAwareLookahead",
    "DraftConfidenceLookahead",
    "HeuristicLookahead",
    "LookaheadPolicy",
    "TargetConfidenceLookahead",
]
