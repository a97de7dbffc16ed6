"""Read CTranslate2's ``model.bin``: a small header, then named variables, then aliases.

The layout (little-endian), as CTranslate2 writes it (binary version 6; versions 1-5 differ only
where noted):

    u32 binary_version
    string spec_name, u32 spec_revision                 (version >= 2)
    u32 variable count, then per variable:
        string name
        u8 rank, u32 dims[rank]
        u8 dtype id, u32 payload bytes                  (version >= 4; before: u8 item size, u32 item count)
        payload
    u32 alias count, then per alias: string alias, string target   (version >= 3)

    string = u16 length (including a trailing NUL), the UTF-8 bytes, NUL

dtype ids: 0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16. Scalars (rank 0) carry the
spec's options (``encoder/num_heads``, ``decoder/activation``, ...). A quantised weight ``X/weight``
(int8 or int16) comes with ``X/weight_scale``: the float value is ``weight / weight_scale``
(int8: one scale per output row; int16: one scale for the tensor).

Written from the format's description, not from CTranslate2's code; checked against checkpoints
written by CTranslate2 4.x (``tests/test_convert_whisper.py``, ``docs/whisper.md``).
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Sequence

import attrs
import torch

from ..errors import ConfigError

DTYPES = {
    0: torch.float32,
    1: torch.int8,
    2: torch.int16,
    3: torch.int32,
    4: torch.float16,
    5: torch.bfloat16,
}
ITEM_SIZE_DTYPES = {4: torch.float32, 1: torch.int8, 2: torch.int16}  # binary versions 1-3
SUPPORTED_VERSIONS = range(1, 7)


@attrs.frozen
class CT2Checkpoint:
    """What a ``model.bin`` holds: the spec's name and revision, its variables (in their stored
    dtype) and its aliases (``alias -> variable name``)."""

    path: str
    binary_version: int
    spec: str
    revision: int
    variables: dict[str, torch.Tensor]
    aliases: dict[str, str]

    def get(self, name: str) -> torch.Tensor | None:
        """A variable by name, following an alias."""
        name = self.aliases.get(name, name)
        return self.variables.get(name)

    def scalar(self, name: str, default=None):
        value = self.get(name)
        return default if value is None else value.item()

    def float32(self, name: str) -> torch.Tensor | None:
        """The variable as float32, dequantised with its ``_scale`` when it is int8/int16."""
        value = self.get(name)
        if value is None:
            return None
        if value.is_floating_point():
            return value.to(torch.float32)
        scale = self.get(name + "_scale")
        if scale is None:
            raise ConfigError(f"{self.path}: {name} is stored as {value.dtype} without a {name}_scale to dequantise it")
        if self.get(name + "_zero") is not None:
            raise ConfigError(f"{self.path}: {name} is quantised with zero points (AWQ); only CTranslate2's own int8/int16 is supported")
        scale = scale.to(torch.float32)
        if scale.dim() == 1:  # int8: one scale per output row (a conv weight's rows are its output channels)
            scale = scale.reshape(-1, *([1] * (value.dim() - 1)))
        return value.to(torch.float32) / scale


class _Reader:
    def __init__(self, data: memoryview, path: str):
        self.data, self.offset, self.path = data, 0, path

    def take(self, size: int, what: str) -> memoryview:
        end = self.offset + size
        if end > len(self.data):
            raise ConfigError(
                f"{self.path} is truncated: {what} needs {size} bytes at offset {self.offset}, "
                f"but the file ends at {len(self.data)} bytes"
            )
        chunk = self.data[self.offset : end]
        self.offset = end
        return chunk

    def unpack(self, fmt: str, what: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))[0]

    def string(self, what: str) -> str:
        length = self.unpack("H", what)
        if length == 0:
            raise ConfigError(f"{self.path}: invalid string length 0 for {what} at offset {self.offset - 2}")
        raw = bytes(self.take(length, what))
        if raw[-1] != 0:
            raise ConfigError(f"{self.path}: {what} at offset {self.offset - length} is not NUL-terminated (not a CTranslate2 model.bin?)")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{self.path}: {what} at offset {self.offset - length} is not UTF-8 (not a CTranslate2 model.bin?)") from None


def read_model_bin(parts: str | Path | Sequence[str | Path]) -> CT2Checkpoint:
    """Read a CTranslate2 ``model.bin`` (or the parts it was split into, in order).

    Raises ``ConfigError`` naming the file for anything that is not a complete model.bin: an
    unknown binary version, a truncated file, a payload whose size does not match its shape, an
    unknown dtype, bytes left over at the end.
    """
    if isinstance(parts, (str, Path)):
        parts = [parts]
    paths = [Path(p) for p in parts]
    if not paths:
        raise ConfigError("no model.bin given")
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"{path}: no such file")
    name = str(paths[0]) if len(paths) == 1 else " + ".join(str(p) for p in paths)
    data = bytearray()
    for path in paths:
        data += path.read_bytes()
    reader = _Reader(memoryview(data), name)

    version = reader.unpack("I", "the binary version")
    if version not in SUPPORTED_VERSIONS:
        raise ConfigError(
            f"{name}: binary version {version} is not a CTranslate2 model.bin this reader knows "
            f"(versions {SUPPORTED_VERSIONS.start}-{SUPPORTED_VERSIONS.stop - 1}); is it a CTranslate2 model?"
        )
    spec, revision = "", 1
    if version >= 2:
        spec = reader.string("the spec name")
        revision = reader.unpack("I", "the spec revision")
    count = reader.unpack("I", "the variable count")
    variables: dict[str, torch.Tensor] = {}
    for index in range(count):
        var = reader.string(f"the name of variable {index}")
        rank = reader.unpack("B", f"the rank of {var}")
        shape = [reader.unpack("I", f"the shape of {var}") for _ in range(rank)]
        if version >= 4:
            type_id = reader.unpack("B", f"the dtype of {var}")
            if type_id not in DTYPES:
                raise ConfigError(f"{name}: variable {var} has dtype id {type_id}, not one of {sorted(DTYPES)}")
            dtype = DTYPES[type_id]
            size = reader.unpack("I", f"the size of {var}")
        else:
            item_size = reader.unpack("B", f"the item size of {var}")
            if item_size not in ITEM_SIZE_DTYPES:
                raise ConfigError(f"{name}: variable {var} has item size {item_size}")
            dtype = ITEM_SIZE_DTYPES[item_size]
            size = reader.unpack("I", f"the size of {var}") * item_size
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if size != expected:
            raise ConfigError(f"{name}: variable {var} of shape {shape} and dtype {dtype} should hold {expected} bytes, not {size}")
        payload = reader.take(size, f"variable {var} ({shape}, {dtype})")
        variables[var] = torch.frombuffer(bytearray(payload), dtype=dtype).reshape(shape) if size else torch.empty(shape, dtype=dtype)
    aliases: dict[str, str] = {}
    if version >= 3:
        for _ in range(reader.unpack("I", "the alias count")):
            alias = reader.string("an alias")
            aliases[alias] = reader.string(f"the target of alias {alias}")
    left = len(reader.data) - reader.offset
    if left:
        raise ConfigError(f"{name}: {left} bytes after the last alias; the file is not one complete model.bin")
    for alias, target in aliases.items():
        if target not in variables:
            raise ConfigError(f"{name}: alias {alias} points at {target}, which is not a variable of the file")
    return CT2Checkpoint(path=name, binary_version=version, spec=spec, revision=revision, variables=variables, aliases=aliases)
