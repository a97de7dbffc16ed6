"""``progress``: a rich progress bar on stderr over the tokens a request may generate.

stderr, so that stdout keeps only the generated text; rich is imported when a request begins.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..core.console import stderr_console
from ..core.hookspecs import hookimpl
from ..core.components import Observer


@attrs.define(eq=False)
class ProgressObserver(Observer):
    """Show committed tokens against the budget (rows x max_new_tokens); rows that end early count in full."""

    name = "progress"

    description: str = attrs.field(default="decoding", validator=attrs.validators.instance_of(str))
    transient: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    _progress: Any = attrs.field(default=None, init=False, repr=False)  # a rich Progress while decoding
    _task = attrs.field(default=None, init=False, repr=False)

    def begin(self, state, target) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            transient=self.transient, console=stderr_console(),  # notices print above it
        )
        self._progress.start()
        self._task = self._progress.add_task(self.description, total=state.batch_size * state.max_new_tokens)

    def on_step(self, state, step) -> None:
        # A finished row will never use the rest of its budget: count it as done.
        unused = (state.max_new_tokens - (state.lengths_host[step.rows_host] - state.prompt_width)) * step.finished_host
        self._progress.advance(self._task, int(step.appended_host.sum() + unused.sum()))

    def on_finish(self, state, output) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


@hookimpl
def specdec_register(registry):
    registry.register_observer("progress", ProgressObserver)
