"""Prompt and text files, read one way everywhere (``specdec bench --prompts``, ``specdec policy
train``, ``specdec drafter train --corpus``)."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import InputError


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line, or JSON Lines with a "prompt" key (chosen by a .jsonl suffix or a first
    line starting with "{"). Blank lines are skipped. Every problem is an ``InputError`` naming
    the file (and the line)."""
    return _read_records(Path(path), "prompt", "prompts file", "no prompts", documents=False)


def read_corpus(path: str | Path) -> list[str]:
    """Texts: JSON Lines with a "text" key (a .jsonl suffix or a first line starting with "{"), else
    plain text split into documents at blank lines."""
    return _read_records(Path(path), "text", "corpus", "no text", documents=True)


def _read_records(path: Path, key: str, what: str, empty: str, documents: bool) -> list[str]:
    if not path.is_file():
        raise InputError(f"{what} {str(path)!r} does not exist")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} {str(path)!r} is not UTF-8 text: {exc}") from exc
    numbered = [(n, line) for n, line in enumerate(content.splitlines(), 1) if line.strip()]
    if not numbered:
        raise InputError(f"{what} {str(path)!r} holds {empty}")
    if path.suffix != ".jsonl" and not numbered[0][1].lstrip().startswith("{"):
        if documents:
            return [block.strip() for block in content.split("\n\n") if block.strip()]
        return [line for _, line in numbered]
    records = []
    for n, line in numbered:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{n}: not a JSON object: {exc}") from exc
        if not isinstance(record, dict) or not isinstance(record.get(key), str) or not record[key]:
            raise InputError(f'{path}:{n}: each JSON line needs a non-empty string "{key}"')
        records.append(record[key])
    return records
