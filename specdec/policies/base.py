"""What every lookahead policy is: it decides how many tokens each row drafts."""

from __future__ import annotations

from typing import ClassVar

import torch

from ..plugins.component import Component
from ..plugins.hookspecs import hookimpl


class LookaheadPolicy(Component):
    """Subclass this and override ``lookahead``; override ``continue_drafting`` to stop rows
    mid-draft (and ``on_step`` to learn from what the target accepted).

    ``continue_drafting`` returning None means "no opinion": every row drafts its full lookahead
    and the draft loop needs no host sync. Returning a tensor lets the drafter stop as soon as no
    row wants to continue, at the price of one tiny sync per drafted position.
    """

    kind = "policy"
    stops_early: ClassVar[bool] = False

    def begin(self, state, target) -> None:
        """A new request starts: reset per-row state (indexed by original row id)."""

    def lookahead(self, state) -> torch.Tensor:
        """CPU LongTensor [B]: how many tokens each active row may draft."""
        raise NotImplementedError

    def continue_drafting(self, state, position, tokens, token_probs, probs) -> torch.Tensor | None:
        return None

    def on_step(self, state, step) -> None:
        """Learn from the iteration the target just verified."""

    @hookimpl
    def specdec_begin(self, state, target):
        with self.blame("begin"):
            self.begin(state, target)

    @hookimpl
    def specdec_lookahead(self, state):
        with self.blame("lookahead"):
            k = self.lookahead(state)
            return torch.as_tensor(k, dtype=torch.long).expand(state.active).clone()

    @hookimpl
    def specdec_continue_drafting(self, state, position, tokens, token_probs, probs):
        with self.blame("continue_drafting"):
            return self.continue_drafting(state, position, tokens, token_probs, probs)

    @hookimpl
    def specdec_on_step(self, state, step):
        with self.blame("on_step"):
            self.on_step(state, step)
