"""Verifiers decide which drafts the target keeps. One module per strategy."""

from .base import Verifier
from .greedy import GreedyVerifier

__all__ = ["GreedyVerifier", "Verifier"]
