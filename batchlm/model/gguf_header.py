"""The layout of a GGUF file (v2/v3, little-endian): its metadata and where each tensor's data lies.

`read_header(path)` returns the metadata (key -> value; arrays as lists) and a `TensorInfo` per tensor
(type, numpy-order shape, byte offset and size in the file). It reads no tensor data; GGUFFile maps that.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchlm.errors import InvalidArgument

# NOTE: read here rather than with gguf.GGUFReader, which builds a Python object per array element:
# seconds for the ~98k strings of a 49k-token vocabulary and its merges, where this reads them at once.

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str  # GGMLQuantizationType's name ("Q4_1")
    shape: tuple[int, ...]  # numpy order: (rows, columns) for a matrix
    offset: int  # bytes from the start of the file
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """The metadata (key -> value; arrays as lists) and the tensors' layout, read from `path`."""
    import gguf

    with open(path, "rb") as f:
        data = f.read(1 << 20)
        reader = _Cursor(f, data)
        if reader.take(4) != _MAGIC:
            raise ValueError("no GGUF magic at the start")
        version = reader.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2, 3)")
        n_tensors, n_fields = reader.scalar("<Q"), reader.scalar("<Q")
        fields = {}
        for _ in range(n_fields):
            key = reader.string()
            fields[key] = reader.value(reader.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = reader.string()
            dims = [reader.scalar("<Q") for _ in range(reader.scalar("<I"))]
            kind, offset = reader.scalar("<I"), reader.scalar("<Q")
            infos.append((name, dims, kind, offset))
        alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-reader.position // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(kind)
        except ValueError:
            raise InvalidArgument(name, f"tensor type {kind} is unknown to the gguf package") from None
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims)) if dims else 1
        shape = tuple(int(d) for d in reversed(dims))
        tensors[name] = TensorInfo(name, qtype.name, shape, start + offset, count // block * size)
    return fields, tensors


class _Cursor:
    """Reads GGUF's little-endian values from a file, a buffer at a time."""

    def __init__(self, f, data: bytes) -> None:
        self._f, self._data, self._pos, self._base = f, data, 0, 0

    @property
    def position(self) -> int:
        return self._base + self._pos

    def take(self, n: int) -> bytes:
        if self._pos + n > len(self._data):
            self._base += self._pos
            self._data = self._data[self._pos:] + self._f.read(max(n, 1 << 20))
            self._pos = 0
            if n > len(self._data):
                raise ValueError("the file ends inside its header")
        out = self._data[self._pos:self._pos + n]
        self._pos += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.scalar("<Q")).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _SCALARS:
                fmt = _SCALARS[item]
                width = struct.calcsize(fmt)
                return np.frombuffer(self.take(width * count), dtype=np.dtype(fmt)).tolist()
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"metadata value type {kind} is unknown")
        value = self.scalar(_SCALARS[kind])
        # NOTE: a float32 as the shortest decimal that reads back as it (1e-05, not 9.999999747378752e-06),
        # the number the model's config.json had; equal once cast to float32 again
        return float(str(np.float32(value))) if kind == _FLOAT32 else value
