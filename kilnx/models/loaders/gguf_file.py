"""Reading a GGUF file's header: metadata key/values and tensor infos, with tensor bytes memory-mapped.

Why not gguf.GGUFReader: it builds a numpy view per array element, so a 262k-token vocabulary
(gemma3: tokens + scores + types) takes ~45 s to open. Here arrays of numbers are one
np.frombuffer and strings a tight loop, which opens the same file in well under a second. The
format's constants (value types, block sizes) come from the gguf package.

Tensor data is exposed as uint8 (rows..., bytes_per_row) — the raw form kilnx.quant.from_gguf and
gguf.quants.dequantize take — so nothing is read until a tensor is used.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from kilnx.models.errors import CheckpointError

_FIX = "re-download or re-convert the file (llama.cpp's convert_hf_to_gguf.py)"


class _Truncated(Exception):
    pass


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]        # GGUF order: fastest-varying dim first (K, N)
    tensor_type: object           # gguf.GGMLQuantizationType
    data_offset: int              # absolute byte offset in the file
    n_bytes: int
    data: np.ndarray              # uint8 (rows..., bytes_per_row), memory-mapped

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise _Truncated(self.pos + n)
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")


# GGUF value type -> (struct format, numpy dtype) for the fixed-size kinds.
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9


def _value(cur: _Cursor, vtype: int):
    if vtype in _SCALARS:
        return cur.unpack(_SCALARS[vtype][0])
    if vtype == _STRING:
        return cur.string()
    if vtype == _ARRAY:
        etype, count = cur.unpack("<I"), cur.unpack("<Q")
        if etype in _SCALARS:
            dt = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
            return np.frombuffer(cur.take(count * dt.itemsize), dtype=dt).tolist()
        return [_value(cur, etype) for _ in range(count)]
    raise ValueError(f"unknown GGUF value type {vtype}")


class GGUFFile:
    """meta: dict of plain python values; tensors: name -> GGUFTensor (in file order)."""

    def __init__(self, path: str):
        import gguf
        self.path = path
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: no such file; pass a .gguf path or a known model name.")
        self.size = os.path.getsize(path)
        try:
            self._mm = np.memmap(path, dtype=np.uint8, mode="r") if self.size else np.zeros(0, np.uint8)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot be read ({e}).") from None
        try:
            self._parse(gguf)
        except _Truncated as e:
            raise CheckpointError(f"{path}: truncated — the header needs byte {e.args[0]} but the file has "
                                  f"{self.size} bytes; {_FIX}.") from None
        except (ValueError, UnicodeDecodeError, struct.error, OverflowError, MemoryError) as e:
            raise CheckpointError(f"{path}: not a valid GGUF file ({e}); it is corrupt — {_FIX}.") from None

    def _parse(self, gguf) -> None:
        cur = _Cursor(memoryview(self._mm))
        if bytes(cur.take(4)) != b"GGUF":
            raise ValueError("missing the GGUF magic bytes")
        version = cur.unpack("<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old (2+ supported)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        self.meta: dict = {}
        for _ in range(n_kv):
            key = cur.string()
            self.meta[key] = _value(cur, cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
            infos.append((name, dims, gguf.GGMLQuantizationType(cur.unpack("<I")), cur.unpack("<Q")))
        align = int(self.meta.get("general.alignment", 32))
        start = -(-cur.pos // align) * align
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, qtype, off in infos:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            if dims[0] % block:
                raise ValueError(f"tensor {name!r}: row length {dims[0]} is not a multiple of {block}")
            row_bytes = dims[0] // block * type_size
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            begin, n_bytes = start + off, rows * row_bytes
            if begin + n_bytes > self.size:
                raise CheckpointError(f"{self.path}: truncated — tensor {name!r} ends at byte {begin + n_bytes} "
                                      f"but the file has {self.size} bytes; {_FIX}.")
            data = self._mm[begin:begin + n_bytes].reshape(tuple(reversed(dims[1:])) + (row_bytes,))
            self.tensors[name] = GGUFTensor(name, dims, qtype, begin, n_bytes, data)
