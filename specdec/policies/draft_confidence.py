"""``draft-confidence``: keep drafting while the draft is sure of its own tokens.

Transformers' dynamic speculation (``assistant_confidence_threshold``), per row: a row drafts up
to ``max_tokens`` tokens and stops after the first token whose draft probability falls below
``threshold`` (that token is still proposed; the target may well accept it).
"""

from __future__ import annotations

import attrs
import torch

from ..core.hookspecs import hookimpl
from ..core.components import LookaheadPolicy


def probability(instance, attribute, value):
    if value is None and attribute.default is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be a probability between 0 and 1, got {value!r}")


def at_least_one(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an integer of at least 1, got {value!r}")


def confident(token_probs: torch.Tensor | None, threshold: float) -> torch.Tensor | None:
    """[B] bool: rows whose latest draft token had probability >= ``threshold`` (None: no opinion)."""
    if token_probs is None:
        return None
    return token_probs >= threshold


@attrs.define(eq=False)
class DraftConfidenceLookahead(LookaheadPolicy):
    """Draft while the draft's probability of its own token stays >= ``threshold``, up to ``max_tokens``."""

    name = "draft-confidence"
    stops_early = True

    threshold: float = attrs.field(default=0.4, validator=probability)
    max_tokens: int = attrs.field(default=20, validator=at_least_one)

    def lookahead(self, state) -> torch.Tensor:
        return torch.full((state.active,), self.max_tokens, dtype=torch.long)

    def continue_drafting(self, state, position, tokens, token_probs, probs) -> torch.Tensor | None:
        return confident(token_probs, self.threshold)


@hookimpl
def specdec_register(registry):
    registry.register_policy("draft-confidence", DraftConfidenceLookahead)
