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
from .constant import integer
from .cost_aware import Calibration, CostAwareLookahead

AUTO = "auto"


def probability(instance, attribute, value):
    if value is None and attribute.default is None:
        return
    if value == AUTO and getattr(instance, "allows_auto", False):
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        also = " or 'auto'" if getattr(instance, "allows_auto", False) else ""
        raise ValueError(f"{attribute.name} must be a probability between 0 and 1{also}, got {value!r}")




def confident(token_probs: torch.Tensor | None, threshold: float) -> torch.Tensor | None:
    """[B] bool: rows whose latest draft token had probability >= ``threshold`` (None: no opinion)."""
    if token_probs is None:
        return None
    return token_probs >= threshold


class CostStop:
    """The ``threshold = "auto"`` rule shared by ``draft-confidence`` and ``classifier``.

    Whether to draft at all is ``cost-aware``'s call: a plain target step (k = 0) where no draft
    is expected to pay for its measured time, with its probing to notice when drafting pays again
    (a batch of 4 on a CPU verifies to its widest row, and there a draft that always starts lost
    to the target alone). How far to draft is the confidence's: a predicted acceptance (the
    draft's q, or the classifier's estimate) is recalibrated online (``Calibration``: what share
    of positions with that prediction the target really accepted); a row's chance of reaching the
    next position is the product of its calibrated estimates so far, and the whole batch drafts
    one more column while the tokens that column is expected to add are worth its time (a line
    through the planner's iteration times by width), since a row that stops alone saves nothing
    in a padded verify. Before a batch size has a line, drafts run to the widths of ``explore``
    in turn.
    """

    explore = (2, 5)

    def __init__(self, max_tokens: int, clock=None):
        self.max_tokens = max_tokens
        self.calibration = Calibration()
        self.planner = CostAwareLookahead(max_k=max_tokens, **({} if clock is None else {"clock": clock}))
        self.reach = self.gained = self.line = None
        self._explored = 0

    def begin(self, state, target) -> None:
        self.calibration.to(state.device)
        self.planner.begin(state, target)

    def lookahead(self, state) -> torch.Tensor:
        """[B] CPU: ``max_tokens`` for every row, or 0 where the planner takes a plain step."""
        self.planner.plan(state)
        self.reach = torch.ones(state.active, device=state.device)
        self.gained = torch.zeros(state.active, device=state.device)
        costs = self.planner.cost_model(state.active)
        self.line = None if costs is None or 2 not in costs else (2 * costs[1] - costs[2], costs[2] - costs[1])
        self._explored += 1
        return torch.full((state.active,), self.max_tokens if self.planner.decision.k > 0 else 0, dtype=torch.long)

    def keep(self, state, position, predicted) -> torch.Tensor:
        """[B] bool, every row alike: draft column ``position + 2`` after ``predicted`` [B] at ``position``?"""
        estimate = self.calibration.estimate(predicted)  # [B]
        self.reach = self.reach * estimate
        self.gained = self.gained + self.reach
        width = position + 1
        if self.line is None:
            wanted = self.explore[self._explored % len(self.explore)]
            return torch.full_like(self.reach, width < wanted, dtype=torch.bool)
        a, b = self.line
        now = a + b * width  # seconds of an iteration this wide
        tokens = self.reach.shape[0] + self.gained.sum()  # expected committed tokens so far (1 per row + kept drafts)
        more = (self.reach * estimate).sum()
        # (tokens + more) / (now + b) >= tokens / now, on the device: no sync here.
        return ((tokens + more) * now >= tokens * (now + b)).expand(self.reach.shape[0])

    def on_step(self, state, step, predicted: torch.Tensor | None) -> None:
        """``predicted`` [B, K]: the prediction at every drafted position (None: nothing drafted)."""
        self.planner.time_at_width(step.draft.width)  # the lookahead was a cap; the confidence set the width
        self.planner.on_step(state, step)
        if predicted is None or predicted.shape[1] == 0:
            return
        position = torch.arange(predicted.shape[1], device=predicted.device)[None, :]  # [1, K]
        accepted = step.verdict.accepted[:, None]
        seen = (position <= accepted) & (position < step.draft.lengths[:, None])  # up to the first rejection
        self.calibration.add(predicted, (position < accepted).expand_as(seen), seen)


@attrs.define(eq=False)
class DraftConfidenceLookahead(LookaheadPolicy):
    """Draft while the draft's probability of its own token stays >= ``threshold``, up to ``max_tokens``.

    ``threshold = "auto"``: decide from measured costs (``CostStop``): a plain target step where
    no draft pays (``cost-aware``'s choice of k = 0); otherwise the draft's q is recalibrated
    online against what the target accepted, and the batch drafts one more token while its
    expected gain is worth its measured time.
    """

    name = "draft-confidence"
    allows_auto = True

    threshold: float | str = attrs.field(default=0.4, validator=probability)
    max_tokens: int = attrs.field(default=20, validator=integer(1))
    _stop: CostStop | None = attrs.field(default=None, init=False, repr=False)

    def begin(self, state, target) -> None:
        if self.threshold == AUTO:
            if self._stop is None:
                self._stop = CostStop(self.max_tokens)
            self._stop.begin(state, target)

    def lookahead(self, state) -> torch.Tensor:
        if self._stop is not None:
            return self._stop.lookahead(state)
        return torch.full((state.active,), self.max_tokens, dtype=torch.long)

    def continue_drafting(self, state, position, tokens, token_probs, probs) -> torch.Tensor | None:
        if self._stop is not None and token_probs is not None:
            return self._stop.keep(state, position, token_probs)
        return confident(token_probs, self.threshold if self.threshold != AUTO else 0.0)

    def on_step(self, state, step) -> None:
        if self._stop is not None:
            self._stop.on_step(state, step, step.draft.token_probs)


@hookimpl
def specdec_register(registry):
    registry.register_policy("draft-confidence", DraftConfidenceLookahead)
