"""``heuristic``: Transformers' assisted-generation schedule, per row.

Each row starts at ``initial`` tokens; after a draft the target accepted in full it drafts
``increase`` more next time, otherwise ``decrease`` fewer (never below ``min_tokens``). Unlike
Transformers, which keeps one number for its single row, every row keeps its own.
"""

from __future__ import annotations

import attrs
import torch

from ..core.hookspecs import hookimpl
from ..core.components import LookaheadPolicy
from .constant import integer


def _not_below_min(instance, attribute, value):
    if value < instance.min_tokens:
        raise ValueError(f"max_tokens ({value}) must not be below min_tokens ({instance.min_tokens})")


@attrs.define(eq=False)
class HeuristicLookahead(LookaheadPolicy):
    """Per row: +``increase`` after a fully accepted draft, -``decrease`` otherwise (Transformers' schedule)."""

    name = "heuristic"

    initial: int = attrs.field(default=5, validator=integer(1))
    increase: int = attrs.field(default=2, validator=integer(0))
    decrease: int = attrs.field(default=1, validator=integer(0))
    min_tokens: int = attrs.field(default=1, validator=integer(1))
    max_tokens: int = attrs.field(default=32, validator=[attrs.validators.instance_of(int), _not_below_min])
    _k: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)

    def begin(self, state, target) -> None:
        self._k = torch.full((state.batch_size,), self.initial, dtype=torch.long)  # by original row

    def lookahead(self, state) -> torch.Tensor:
        return self._k[state.rows_host]

    def on_step(self, state, step) -> None:
        rows = step.rows_host
        drafted, accepted = step.drafted_host, step.accepted_host
        all_accepted = (drafted > 0) & (accepted == drafted)
        k = self._k[rows]
        k = torch.where(all_accepted, k + self.increase, torch.where(drafted > 0, k - self.decrease, k))
        self._k[rows] = k.clamp(self.min_tokens, self.max_tokens)


@hookimpl
def specdec_register(registry):
    registry.register_policy("heuristic", HeuristicLookahead)
