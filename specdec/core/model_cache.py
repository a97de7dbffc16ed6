"""Where specdec's converted models live, and model names that point there.

``specdec models fetch whisper-base`` converts into ``cache_root()/whisper-base`` (convert/fetch.py).
A plugins.toml, the CLI and the loaders may then name the model by that bare name
(``model = "whisper-base"``); a name that is neither a folder nor in the cache gets an error that
says which command fetches it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError


def cache_root() -> Path:
    """Where converted models live: ``$SPECDEC_CACHE/models``, else ``$XDG_CACHE_HOME/specdec/models``
    (``~/.cache/specdec/models``)."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"]).expanduser() / "models"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "specdec" / "models"


def is_bare_name(value: str) -> bool:
    """``whisper-base``: no folder separators, not a relative or home path."""
    return bool(value) and "/" not in value and "\\" not in value and not value.startswith((".", "~"))


def cached_model_dir(name: str) -> Path | None:
    """The cache folder of the model ``name`` when one has been converted there, else None."""
    if not is_bare_name(str(name)):
        return None
    path = cache_root() / str(name)
    return path if (path / "config.json").is_file() else None


def resolve_model_path(value: str | Path, who: str) -> Path:
    """A model folder: ``value`` itself, or the cache folder of the bare name ``value``; otherwise a
    ``ConfigError`` naming ``who`` and, for a bare name, the fetch command."""
    path = Path(value).expanduser()
    if path.is_dir():
        return path
    cached = cached_model_dir(str(value))
    if cached is not None:
        return cached
    raise ConfigError(f"{who}: model {str(value)!r} {missing_model_hint(str(value))}")


def missing_model_hint(value: str) -> str:
    if is_bare_name(value):
        return (f"is neither a folder nor in specdec's model cache ({cache_root()}); if it is a model specdec "
                f"converts, run: specdec models fetch {value}  (`specdec models list` shows them)")
    return "does not exist"
