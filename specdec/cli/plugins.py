"""``specdec plugins``: every registered drafter, policy, verifier and observer.

On a terminal: a table whose name column is never cut short. Piped or redirected: plain aligned
rows, one component per line, nothing truncated or wrapped. ``--json`` for programs.
"""

from __future__ import annotations

import json
import sys

import attrs
import typer

from .common import is_terminal, warn, write_stdout


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def _options_text(entry) -> str:
    return ", ".join(f"{o.name}={o.default!r}" if not o.required else f"{o.name} (required)" for o in entry.options()) or "-"


def plugins(as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON")):
    """List every registered drafter, policy, verifier and observer, with options and package."""
    from ..core.deferred import deferred_torch
    from ..plugins.manager import load_plugins

    with deferred_torch():  # listing reads the strategies' options; it never needs a tensor
        loaded = load_plugins(refresh=True)
    entries = loaded.registry.entries()
    if as_json:
        document = {
            "components": [
                {
                    "kind": e.kind,
                    "name": e.name,
                    "aliases": list(e.aliases),
                    "package": e.package,
                    "plugin": e.plugin,
                    "summary": e.summary,
                    "options": [{"name": o.name, "type": o.type, "default": _jsonable(o.default)} for o in e.options()],
                }
                for e in entries
            ],
            "failures": [attrs.asdict(f) for f in loaded.failures],
            "conflicts": loaded.registry.conflicts,
        }
        write_stdout(json.dumps(document, indent=2) + "\n")
        return
    rows = [(e.kind, e.name, _options_text(e), e.package, e.summary) for e in entries]
    header = ("kind", "name", "options (default)", "package", "summary")
    if is_terminal(sys.stdout):
        from rich.console import Console
        from rich.table import Table

        table = Table(title="specdec plugins")
        longest = max(len(r[1]) for r in rows) if rows else 4
        table.add_column("kind", no_wrap=True)
        table.add_column("name", no_wrap=True, min_width=longest)  # a name is never cut short
        table.add_column("options (default)", overflow="fold")
        table.add_column("package", overflow="fold")
        table.add_column("summary", overflow="fold")
        for row in rows:
            table.add_row(*row)
        Console(highlight=False).print(table)
    else:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths)) + "  " + row[4] for row in [header, *rows]]
        write_stdout("\n".join(line.rstrip() for line in lines) + "\n")
    for failure in loaded.failures:
        warn(f"plugin {failure.plugin!r} ({failure.package}) failed to load: {failure.error}")
    for conflict in loaded.registry.conflicts:
        warn(conflict)
