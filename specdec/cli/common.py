"""What every command shares: one error style, config lookup, quiet transformers, terminal tests.

Kept free of torch and transformers: ``--help``, ``--version`` and argument errors import
nothing heavier than typer and rich.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import typer

from ..core.console import stderr_console

if TYPE_CHECKING:
    from ..config import SpecdecConfig

CONFIG_HELP = "plugins.toml to use (default: ./plugins.toml, else the repository's)"
USER_ERROR = 2  # every mistake the user can fix (bad option, file, config) exits with 2, as click's own do


def fail(message: str, code: int = USER_ERROR) -> typer.Exit:
    """Print ``Error: message`` on stderr (the one error style of every command) and return the exit."""
    from rich.markup import escape

    stderr_console().print(f"[bold red]Error:[/] {escape(message)}")
    return typer.Exit(code=code)


def warn(message: str) -> None:
    from rich.markup import escape

    stderr_console().print(f"[yellow]Warning:[/] {escape(message)}")


def is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def colour(stream) -> bool:
    """Whether to style text written to ``stream`` (a terminal, and no NO_COLOR)."""
    return is_terminal(stream) and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


@contextlib.contextmanager
def phase_progress(labels: dict[str, str], every_s: float = 30.0,
                   clock: Callable[[], float] = time.monotonic) -> Iterator[Callable[[str, int, int], None]]:
    """``on_progress(phase, done, total)`` for a long command's phases (a training command's teacher
    pass, its steps): a rich bar per phase on a terminal. Where stderr is a log or a pipe, rich draws
    nothing until the command ends, so a half-hour job looked dead there; it gets a plain line per
    phase instead, at its first report, at most every ``every_s`` seconds after, and at its end, as
    tqdm writes to a log. ``labels`` name the phases."""
    console = stderr_console()
    if console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            tasks: dict[str, int] = {}

            def on_bar(phase: str, done: int, total: int) -> None:
                if phase not in tasks:
                    tasks[phase] = progress.add_task(labels.get(phase, phase), total=total)
                progress.update(tasks[phase], completed=done, total=total)

            yield on_bar
        return
    started: dict[str, float] = {}
    printed: dict[str, float] = {}
    ended: set[str] = set()

    def on_line(phase: str, done: int, total: int) -> None:
        now = clock()
        start = started.setdefault(phase, now)
        if done < total and now - printed.get(phase, -math.inf) < every_s or phase in ended:
            return
        if done >= total:
            ended.add(phase)
        printed[phase] = now
        elapsed = now - start
        line = f"{labels.get(phase, phase)}: {done}/{total}"
        if total:
            line += f" ({100 * done / total:.0f}%)"
        line += f", {_duration(elapsed)} elapsed"
        if 0 < done < total and elapsed >= 1:  # from the first report on: no rate before it
            line += f", about {_duration(elapsed * (total - done) / done)} left"
        console.print(line, markup=False, highlight=False)

    yield on_line


@contextlib.contextmanager
def status_progress(first: str, every_s: float = 30.0,
                    clock: Callable[[], float] = time.monotonic) -> Iterator[Callable[[str], None]]:
    """``on_status(message)`` for a long command whose progress is a message (``specdec bench``: the
    repeat, batch and contender at work): a spinner with the message and the time on a terminal,
    gone at the end. Where stderr is a log or a pipe, a plain line at the first message and at most
    every ``every_s`` seconds after, with the time elapsed (rich would write nothing there, and a
    grid runs for half an hour). ``first`` is the message until the command sends one."""
    console = stderr_console()
    if console.is_terminal:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      transient=True) as progress:
            task = progress.add_task(first)
            yield lambda message: progress.update(task, description=message)
        return
    start, printed = clock(), [-math.inf]

    def on_line(message: str) -> None:
        now = clock()
        if now - printed[0] < every_s:
            return
        printed[0] = now
        console.print(f"{message} ({_duration(now - start)} elapsed)", markup=False, highlight=False)

    on_line(first)
    yield on_line


def repository_root() -> Path:
    """The folder above the ``specdec`` package: the repository root of a clone / editable install."""
    return Path(__file__).resolve().parent.parent.parent


def find_config(path: Optional[Path]) -> Path:
    if path is not None:
        return path
    for candidate in (Path.cwd() / "plugins.toml", repository_root() / "plugins.toml"):
        if candidate.is_file():
            return candidate
    raise fail("no plugins.toml here and none in the repository; pass --config FILE")


class _Notices(logging.Handler):
    """specdec's own records on stderr, dimmed (``specdec: ...``): what a command is doing while it seems
    idle, such as timing this CPU's packed weights on a first run (core/packed_linear.py)."""

    def emit(self, record: logging.LogRecord) -> None:
        from rich.markup import escape

        stderr_console().print(f"[dim]specdec: {escape(record.getMessage())}[/]")


VERBOSITIES = ("debug", "info", "warning", "error", "critical")


def set_up_logging() -> None:
    """Transformers' deprecation warnings, info logs and weight-loading bars are noise on a command
    whose output is text or a table (TRANSFORMERS_VERBOSITY still wins when set); specdec's own notices
    go to stderr from INFO on (SPECDEC_VERBOSITY=warning silences them)."""
    import warnings

    verbosity = os.environ.get("SPECDEC_VERBOSITY", "info").lower()
    if verbosity not in VERBOSITIES:
        raise fail(f"SPECDEC_VERBOSITY={verbosity!r} is not a level; use one of {', '.join(VERBOSITIES)}")
    specdec_logger = logging.getLogger("specdec")
    if not any(isinstance(handler, _Notices) for handler in specdec_logger.handlers):
        specdec_logger.addHandler(_Notices())
    specdec_logger.setLevel(verbosity.upper())

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    if not os.environ.get("TRANSFORMERS_VERBOSITY"):
        transformers_logging.set_verbosity_error()
    # A deprecation is attributed to the caller's module (stacklevel), so filter by category: they
    # are for developers of the code that calls transformers, never for a command's user.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for module in (r"transformers(\.|$)", r"torch(\.|$)"):
        warnings.filterwarnings("ignore", category=UserWarning, module=module)


def with_policy_memory(spec: "SpecdecConfig", sampling: dict) -> "SpecdecConfig":
    """``spec`` with ``cost-aware``'s ``memory`` in specdec's cache, where it is the policy and no
    ``memory`` was set (``-P memory=none`` keeps it off): one file per setting (the target and its
    options, the drafter, the verifier, the policy's options, the sampling), so that each call of a
    command starts from what earlier calls with the same setting measured, not from nothing."""
    import hashlib
    import json

    from ..core.model_cache import cache_root
    from ..plugins.registry import canonical

    if canonical(spec.policy.use) != "cost-aware" or "memory" in spec.policy.options:
        return spec
    setting = {"target": spec.target, "sampling": sampling, "policy": spec.policy.options,
               **{kind: [getattr(spec, kind).use, getattr(spec, kind).options] for kind in ("drafter", "verifier")}}
    digest = hashlib.sha256(json.dumps(setting, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = cache_root().parent / "policies" / f"cost-aware-{digest}.json"
    return spec.with_choices(policy_options={"memory": str(path)})


def load_config(path: Optional[Path]) -> "SpecdecConfig":
    from ..config import SpecdecConfig
    from ..errors import SpecdecError

    try:
        return SpecdecConfig.from_toml(find_config(path))
    except SpecdecError as exc:
        raise fail(str(exc)) from None


def write_stdout(text: str) -> None:
    """Write text to stdout unchanged: no wrapping, no markup, no tab expansion (rich does all three)."""
    sys.stdout.write(text)
    sys.stdout.flush()
