"""``constant``: every row drafts ``k`` tokens every iteration."""

from __future__ import annotations

import attrs
import torch

from ..core.hookspecs import hookimpl
from ..core.components import LookaheadPolicy


def non_negative(instance, attribute, value):
    if value < 0:
        raise ValueError(f"{attribute.name} must be at least 0, got {value}")


@attrs.define(eq=False)
class ConstantLookahead(LookaheadPolicy):
    """Draft ``k`` tokens per row per iteration (0: plain target decoding)."""

    name = "constant"

    k: int = attrs.field(default=5, validator=[attrs.validators.instance_of(int), non_negative])

    def lookahead(self, state) -> torch.Tensor:
        return torch.full((state.active,), self.k, dtype=torch.long)


@hookimpl
def specdec_register(registry):
    registry.register_policy("constant", ConstantLookahead)
