"""``trace``: one JSON line per iteration with what every row drafted, accepted and appended."""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from ..core.hookspecs import hookimpl
from ..core.components import Observer


@attrs.define(eq=False)
class TraceObserver(Observer):
    """Write a JSONL trace of every iteration to ``path``."""

    name = "trace"

    path: str = attrs.field(validator=attrs.validators.instance_of((str, Path)))
    _file = attrs.field(default=None, init=False, repr=False)

    def begin(self, state, target) -> None:
        self._close()
        self._file = open(self.path, "a", encoding="utf-8")

    def on_step(self, state, step) -> None:
        record = {
            "iteration": step.iteration,
            "rows": step.rows_host.tolist(),
            "drafted": step.drafted_host.tolist(),
            "accepted": step.accepted_host.tolist(),
            "appended": step.appended_host.tolist(),
            "finished": step.finished_host.tolist(),
        }
        self._file.write(json.dumps(record) + "\n")

    def on_finish(self, state, output) -> None:
        self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@hookimpl
def specdec_register(registry):
    registry.register_observer("trace", TraceObserver)
