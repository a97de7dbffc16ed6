"""Prompt files, read one way everywhere (``specdec bench --prompts``, ``specdec policy train``)."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import InputError


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line, or JSON Lines with a "prompt" key (chosen by a .jsonl suffix or a first
    line starting with "{"). Blank lines are skipped. Every problem is an ``InputError`` naming
    the file (and the line)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"prompts file {str(path)!r} does not exist")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InputError(f"prompts file {str(path)!r} is not UTF-8 text: {exc}") from exc
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise InputError(f"prompts file {str(path)!r} holds no prompts")
    if path.suffix != ".jsonl" and not numbered[0][1].lstrip().startswith("{"):
        return [line for _, line in numbered]
    prompts = []
    for n, line in numbered:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{n}: not a JSON object: {exc}") from exc
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise InputError(f'{path}:{n}: each JSON line needs a non-empty string "prompt"')
        prompts.append(record["prompt"])
    return prompts
