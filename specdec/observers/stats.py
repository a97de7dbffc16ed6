"""``stats``: counts drafted and accepted tokens, calls and time into ``DecodeOutput.stats``.

The decoder always runs one, so every ``generate`` reports its numbers.
"""

from __future__ import annotations

import time

import attrs

from ..core.types import DecodeStats
from ..core.hookspecs import hookimpl
from ..core.components import Observer


@attrs.define(eq=False)
class StatsObserver(Observer):
    """Count drafted and accepted tokens, model calls and wall time into ``DecodeOutput.stats``."""

    name = "stats"

    stats: DecodeStats = attrs.field(factory=DecodeStats, init=False)
    _started: float = attrs.field(default=0.0, init=False, repr=False)

    def begin(self, state, target) -> None:
        self.stats = DecodeStats(rows=state.batch_size)
        self._started = time.perf_counter()

    def on_step(self, state, step) -> None:
        stats = self.stats
        stats.iterations += 1
        stats.row_steps += int(step.rows_host.numel())
        # Sums of host lists, not tensor ops: a plain step of a small model is counted in microseconds.
        stats.drafted += sum(step.drafted_host.tolist())
        stats.accepted += sum(step.accepted_host.tolist())
        stats.new_tokens += sum(step.appended_host.tolist())
        if step.siblings:
            stats.alternatives_read += 1
            stats.alternatives_taken += int(((step.accepted_host == 0) & (step.appended_host == 2)).sum())

    def on_finish(self, state, output) -> None:
        self.stats.target_calls = state.target_calls
        self.stats.draft_calls = state.draft_calls
        self.stats.wall_time_s = time.perf_counter() - self._started


@hookimpl
def specdec_register(registry):
    registry.register_observer("stats", StatsObserver)
