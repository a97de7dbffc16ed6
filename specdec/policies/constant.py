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
    """Draft ``k`` tokens per row per iteration (0: plain target decoding).

    ``max_batch``: while more rows than this are decoding, take plain target steps instead (None,
    the default: always draft). vLLM's ``speculative_disable_by_batch_size`` in a batch's terms:
    a padded verify costs every row the widest draft, and on a CPU a batch pays for drafting more
    than a single row does (on the bundled pair, constant k = 5 runs 1.45x of the target at batch 1
    and 0.66-0.94x at batch 16; ``docs/benchmarks.md``, "At a glance"). Rows leave the batch as they
    finish, so a batch that starts above the cap drafts once few enough rows are left. Where the
    break-even batch size is not known, ``cost-aware`` measures it.
    """

    name = "constant"

    k: int = attrs.field(default=5, validator=integer(0))
    max_batch: int | None = attrs.field(default=None, validator=attrs.validators.optional(integer(1)))

    def lookahead(self, state) -> torch.Tensor:
        plain = self.max_batch is not None and state.active > self.max_batch
        return torch.full((state.active,), 0 if plain else self.k, dtype=torch.long)


@hookimpl
def specdec_register(registry):
    registry.register_policy("constant", ConstantLookahead)
