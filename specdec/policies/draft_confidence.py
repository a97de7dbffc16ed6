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
from .cost_aware import Calibration, DraftTimer

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

    A predicted acceptance (the draft's q, or the classifier's estimate) is first recalibrated
    online (``Calibration``: what share of positions with that prediction the target really
    accepted). A row's chance of reaching the next position is the product of its calibrated
    estimates so far; the whole batch drafts one more column while the tokens that column is
    expected to add are worth its measured time (``DraftTimer``), since a row that stops alone
    saves nothing in a padded verify.
    """

    def __init__(self, clock=None):
        self.calibration = Calibration()
        self.timer = DraftTimer() if clock is None else DraftTimer(clock=clock)
        self.reach = self.gained = None

    def begin(self, state) -> None:
        self.calibration.to(state.device)

    def lookahead(self, state) -> None:
        self.timer.start(state)
        self.reach = torch.ones(state.active, device=state.device)
        self.gained = torch.zeros(state.active, device=state.device)

    def keep(self, state, position, predicted) -> torch.Tensor:
        estimate = self.calibration.estimate(predicted)  # [B]
        self.reach = self.reach * estimate
        self.gained = self.gained + self.reach
        return self.timer.keep_drafting(state.active, position + 1, self.reach, self.gained, estimate)

    def on_step(self, step, predicted: torch.Tensor | None) -> None:
        """``predicted`` [B, K]: the prediction at every drafted position (None: nothing drafted)."""
        self.timer.stop(step)
        if predicted is None or predicted.shape[1] == 0:
            return
        position = torch.arange(predicted.shape[1], device=predicted.device)[None, :]  # [1, K]
        accepted = step.verdict.accepted[:, None]
        seen = (position <= accepted) & (position < step.draft.lengths[:, None])  # up to the first rejection
        self.calibration.add(predicted, (position < accepted).expand_as(seen), seen)


@attrs.define(eq=False)
class DraftConfidenceLookahead(LookaheadPolicy):
    """Draft while the draft's probability of its own token stays >= ``threshold``, up to ``max_tokens``.

    ``threshold = "auto"``: stop where the cost model says (``CostStop``): the draft's q is
    recalibrated online against what the target accepted, and the batch drafts one more token
    while its expected gain is worth its measured time.
    """

    name = "draft-confidence"
    allows_auto = True

    threshold: float | str = attrs.field(default=0.4, validator=probability)
    max_tokens: int = attrs.field(default=20, validator=integer(1))
    _stop: CostStop | None = attrs.field(default=None, init=False, repr=False)

    def begin(self, state, target) -> None:
        if self.threshold == AUTO:
            if self._stop is None:
                self._stop = CostStop()
            self._stop.begin(state)

    def lookahead(self, state) -> torch.Tensor:
        if self._stop is not None:
            self._stop.lookahead(state)
        return torch.full((state.active,), self.max_tokens, dtype=torch.long)

    def continue_drafting(self, state, position, tokens, token_probs, probs) -> torch.Tensor | None:
        if self._stop is not None and token_probs is not None:
            return self._stop.keep(state, position, token_probs)
        return confident(token_probs, self.threshold if self.threshold != AUTO else 0.0)

    def on_step(self, state, step) -> None:
        if self._stop is not None:
            self._stop.on_step(step, step.draft.token_probs)


@hookimpl
def specdec_register(registry):
    registry.register_policy("draft-confidence", DraftConfidenceLookahead)
