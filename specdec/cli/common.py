"""What every command shares: one error style, config lookup, quiet transformers, terminal tests.

Kept free of torch and transformers: ``--help``, ``--version`` and argument errors import
nothing heavier than typer and rich.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

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
