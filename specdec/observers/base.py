"""What every observer is: it watches the loop and never steers it."""

from __future__ import annotations

from ..plugins.component import Component
from ..plugins.hookspecs import hookimpl


class Observer(Component):
    """Subclass this and override any of ``begin``, ``on_step`` and ``on_finish``."""

    kind = "observer"

    def begin(self, state, target) -> None:
        pass

    def on_step(self, state, step) -> None:
        pass

    def on_finish(self, state, output) -> None:
        pass

    @hookimpl
    def specdec_begin(self, state, target):
        with self.blame("begin"):
            self.begin(state, target)

    @hookimpl
    def specdec_on_step(self, state, step):
        with self.blame("on_step"):
            self.on_step(state, step)

    @hookimpl
    def specdec_on_finish(self, state, output):
        with self.blame("on_finish"):
            self.on_finish(state, output)
