"""Verifiers decide which drafts the target keeps. One module per strategy."""

from ..core.components import Verifier
from .greedy import GreedyVerifier
from .rejection import RejectionVerifier

__all__ = ["GreedyVerifier", "RejectionVerifier", "Verifier"]
