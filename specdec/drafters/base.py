"""What every drafter is: it proposes tokens; the loop, policy and verifier do the rest."""

from __future__ import annotations

from typing import Callable

import torch

from ..core.types import Draft
from ..plugins.component import Component
from ..plugins.hookspecs import hookimpl

KeepDrafting = Callable[..., "torch.Tensor | None"]


class Drafter(Component):
    """Subclass this and override ``propose`` (and ``check_target`` / ``begin`` / ``on_step`` /
    ``select_rows`` when the drafter keeps state such as a KV cache)."""

    kind = "drafter"

    def check_target(self, target) -> None:
        """Raise ``IncompatibleModelsError`` if this drafter cannot draft for ``target``."""

    def begin(self, state, target) -> None:
        """A new request starts."""

    def propose(self, state, max_tokens: torch.Tensor, keep_drafting: KeepDrafting) -> Draft:
        raise NotImplementedError

    def on_step(self, state, step) -> None:
        """The verifier has decided; update any cache of drafted tokens."""

    def select_rows(self, state, keep: torch.Tensor, keep_host: torch.Tensor) -> None:
        """Finished rows leave the batch."""

    @hookimpl
    def specdec_begin(self, state, target):
        with self.blame("begin"):
            self.begin(state, target)

    @hookimpl
    def specdec_propose(self, state, max_tokens, keep_drafting):
        with self.blame("propose"):
            return self.propose(state, max_tokens, keep_drafting)

    @hookimpl
    def specdec_on_step(self, state, step):
        with self.blame("on_step"):
            self.on_step(state, step)

    @hookimpl
    def specdec_select_rows(self, state, keep, keep_host):
        with self.blame("select_rows"):
            self.select_rows(state, keep, keep_host)
