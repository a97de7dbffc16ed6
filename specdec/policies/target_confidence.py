"""``target-confidence``: draft only where the target was sure of the token it committed last.

Before drafting, each row looks at the target's probability of the token it appended at the last
verification (``Step.target_probs_host``, copied to the host in the loop's one sync). Below
``threshold`` the text is at a hard spot where drafts are likely to be wasted, so the row takes a
plain target step (k = 0); otherwise it drafts ``k`` tokens. A row that was never verified drafts.
With ``draft_threshold`` set, drafting also stops after a draft token the draft itself was unsure
of, as ``draft-confidence`` does.

``threshold = "auto"``: no fixed cut. The acceptance that follows each bin of the target's
confidence is measured online (truncation-aware, as ``cost-aware`` counts it) and handed to the
``cost-aware`` planner as the rows' alpha; it picks k (0 included) from measured iteration times.
"""

from __future__ import annotations

import attrs
import torch

from ..core.hookspecs import hookimpl
from ..core.components import LookaheadPolicy
from .cost_aware import Calibration, CostAwareLookahead
from .constant import integer
from .draft_confidence import AUTO, confident, probability


@attrs.define(eq=False)
class TargetConfidenceLookahead(LookaheadPolicy):
    """Draft ``k`` tokens where the target's probability of its last token was >= ``threshold``, else none."""

    name = "target-confidence"
    allows_auto = True

    threshold: float | str = attrs.field(default=0.5, validator=probability)
    k: int = attrs.field(default=5, validator=integer(1))
    draft_threshold: float | None = attrs.field(default=None, validator=probability)
    _confidence: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)
    _planner: CostAwareLookahead | None = attrs.field(default=None, init=False, repr=False)
    _calibration: Calibration | None = attrs.field(default=None, init=False, repr=False)
    _asked: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)

    def begin(self, state, target) -> None:
        self._confidence = torch.full((state.batch_size,), float("nan"))  # [R] CPU by original row; NaN: unknown
        if self.threshold == AUTO:
            if self._planner is None:
                self._planner = CostAwareLookahead(max_k=self.k, initial_k=self.k)
                self._calibration = Calibration()
                self._calibration.to("cpu")
            self._planner.begin(state, target)

    def lookahead(self, state) -> torch.Tensor:
        confidence = self._confidence[state.rows_host]  # [B] CPU
        if self._planner is not None:
            # Acceptance expected at this confidence, as measured so far; the cost model picks k.
            self._asked = confidence
            return self._planner.plan(state, self._calibration.estimate(confidence).double())
        return torch.where(confidence < self.threshold, 0, self.k)  # NaN compares False: draft

    def continue_drafting(self, state, position, tokens, token_probs, probs) -> torch.Tensor | None:
        if self.draft_threshold is None:
            return None
        return confident(token_probs, self.draft_threshold)

    def on_step(self, state, step) -> None:
        if self._planner is not None:
            self._planner.on_step(state, step)
            requested = self._planner.requested
            asked = requested > 0
            if bool(asked.any()):
                # Truncation-aware, like cost-aware: one success per accepted draft, one failure if
                # the row got fewer than it asked for.
                accepted = step.accepted_host[asked].float()
                failed = (step.accepted_host[asked] < requested[asked]).float()
                index = self._calibration.bins(self._asked[asked])
                self._calibration.accepted.index_add_(0, index, accepted)
                self._calibration.seen.index_add_(0, index, accepted + failed)
        if step.target_probs_host is not None:
            self._confidence[step.rows_host] = step.target_probs_host.float()


@hookimpl
def specdec_register(registry):
    registry.register_policy("target-confidence", TargetConfidenceLookahead)
