"""``constant``: every row drafts ``k`` tokens every iteration."""

from __future__ import annotations

import attrs
import torch

from ..core.hookspecs import hookimpl
from ..core.components import LookaheadPolicy


def integer(minimum: int) -> list:
    """attrs validators: an int (not a bool) of at least ``minimum``; the registry turns their
    errors into ConfigErrors naming the plugin and the option."""
    return [attrs.validators.instance_of(int), attrs.validators.not_(attrs.validators.instance_of(bool)),
            attrs.validators.ge(minimum)]


@attrs.define(eq=False)
class ConstantLookahead(LookaheadPolicy):
    """Draft ``k`` tokens per row per iteration (0: plain target decoding)."""

    name = "constant"

    k: int = attrs.field(default=5, validator=integer(0))

    def lookahead(self, state) -> torch.Tensor:
        return torch.full((state.active,), self.k, dtype=torch.long)


@hookimpl
def specdec_register(registry):
    registry.register_policy("constant", ConstantLookahead)
