"""The ``specdec`` command line: the typer app and where each command lives.

Start-up is kept light: this module imports typer only. Each command imports what it needs
(torch, transformers, the plugins) when it runs, so ``--help``, ``--version`` and argument
errors answer without loading them (docs/cli.md has the measurements).
"""

from __future__ import annotations

import sys

import typer

from .bench import bench
from .drafter import drafter_app
from .generate import generate
from .models import models_app
from .plugins import plugins
from .policy import policy_app
from .transcribe import transcribe_command

app = typer.Typer(
    help="Speculative decoding for Hugging Face Transformers models: same output, less time.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"specdec {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Speculative decoding for Hugging Face Transformers models: same output, less time."""


app.command()(generate)
app.command()(plugins)
app.command()(bench)
app.command("transcribe")(transcribe_command)
app.add_typer(policy_app, name="policy")
app.add_typer(models_app, name="models")
app.add_typer(drafter_app, name="drafter")


def main():  # pragma: no cover - console script entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
