"""The safetensors files specdec's trained drafts are saved in: written whole or not at all, and read
back with their format checked, errors naming the file."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ConfigError


def write_weights(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write ``tensors`` and ``metadata`` to ``path`` through a temporary file, so that a reader never
    finds half a file."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    save_file({name: value.detach().contiguous().cpu() for name, value in tensors.items()}, str(temporary),
              metadata=metadata)
    temporary.replace(path)
    return path


def read_weights(path: Path, fmt: str, what: str, who: str,
                 missing_hint: str = "") -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """``(metadata, tensors)`` of a file written with ``format = fmt``; a ``ConfigError`` naming ``who``
    and the file when it is missing (``missing_hint`` says how to make one), not safetensors, or
    another kind of file (``what`` it should be)."""
    from safetensors import safe_open

    if not path.is_file():
        raise ConfigError(f"{who}: {what} file {str(path)!r} does not exist{missing_hint}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            info = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds
        raise ConfigError(f"{who}: {path} is not a safetensors file: {exc}") from None
    if info.get("format") != fmt:
        raise ConfigError(f"{who}: {path} is not a {what} (format {info.get('format')!r})")
    return info, tensors
