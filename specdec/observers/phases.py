"""``phases``: where an iteration's time goes, per phase of the loop (lookahead, draft, verify,
commit, bookkeeping), summed over a ``generate`` call.

The loop marks the end of each phase only when a ``PhaseTimes`` observer is attached (otherwise it
calls nothing), and a mark reads the host clock: on a CPU that is the phase's time. On an
accelerator the host runs ahead of the device, so a phase's host time is its launch time, not its
work; ``sync = true`` synchronises the device at every mark (five syncs per iteration: for
profiling, never for speed).

``bookkeeping`` is everything after the commit: the observers and the policy (``on_step``, where
a draft model also drops its rejected slots) and rows leaving the batch.
"""

from __future__ import annotations

import time

import attrs

from ..core.components import Observer
from ..core.hookspecs import hookimpl

PHASES = ("lookahead", "draft", "verify", "commit", "bookkeeping")


@attrs.define(eq=False)
class PhaseTimes(Observer):
    """Seconds per phase of the loop, summed over the calls since ``reset`` (``seconds``, ``iterations``)."""

    name = "phases"

    sync: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    seconds: dict[str, float] = attrs.field(factory=lambda: dict.fromkeys(PHASES, 0.0), init=False)
    iterations: int = attrs.field(default=0, init=False)
    _last: float = attrs.field(default=0.0, init=False, repr=False)
    _device: object = attrs.field(default=None, init=False, repr=False)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.iterations = 0

    def begin(self, state, target) -> None:
        self._device = state.device

    def start(self) -> None:
        """An iteration begins (called by the loop)."""
        self._last = self._now()

    def mark(self, phase: str) -> None:
        """``phase`` ended now (called by the loop)."""
        now = self._now()
        self.seconds[phase] += now - self._last
        self._last = now
        if phase == PHASES[-1]:
            self.iterations += 1

    def _now(self) -> float:
        if self.sync and self._device is not None and self._device.type == "cuda":
            import torch

            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def per_iteration_ms(self) -> dict[str, float]:
        """Milliseconds per iteration of each phase, and their ``total``."""
        n = max(self.iterations, 1)
        out = {phase: 1000 * seconds / n for phase, seconds in self.seconds.items()}
        out["total"] = sum(out.values())
        return out


@hookimpl
def specdec_register(registry):
    registry.register_observer("phases", PhaseTimes)
