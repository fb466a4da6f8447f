"""Lazy, validated reader for one ``.safetensors`` file, including bfloat16.

Why not ``safetensors.safe_open(framework="numpy")``: numpy has no bfloat16, so that API
refuses the released Ling-3.0 checkpoint (bf16). The format is simple (8-byte little-endian
header length, JSON header, raw row-major data), so we parse the header ourselves, validate
every entry against the file size, and memory-map the data: a tensor is read from disk only
when it is used, and a 15.8 GB checkpoint never sits in RAM at once.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

# safetensors dtype tag -> numpy storage dtype (bf16 is stored as its raw 16-bit pattern).
_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, truncated, mis-shaped or of an unknown dtype."""


def bf16_to_float32(raw: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 bit patterns (uint16) to float32 exactly (bf16 is fp32's top half)."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


class SafetensorsFile:
    """Header of one file plus a read-only memory map of its data section."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path}: truncated (no safetensors header)")
                (header_len,) = struct.unpack("<Q", head)
                if header_len > _MAX_HEADER or 8 + header_len > size:
                    raise CheckpointError(
                        f"{self.path}: truncated or not safetensors (header of {header_len} "
                        f"bytes in a {size}-byte file)"
                    )
                header = json.loads(f.read(header_len))
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read: {e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header: {e}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header")
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        data_len = size - self._data_start
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            self._entries[name] = self._validate(name, info, data_len)
        self._map: np.memmap | None = None

    def _validate(
        self, name: str, info: object, data_len: int
    ) -> tuple[np.dtype, tuple[int, ...], int, int]:
        if not isinstance(info, dict):
            raise CheckpointError(f"{self.path}: tensor {name!r}: corrupt header entry")
        tag, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if tag not in _DTYPES:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has unsupported dtype {tag!r} "
                f"(expected one of {sorted(_DTYPES)})"
            )
        if (
            not isinstance(shape, list)
            or not all(isinstance(s, int) and s >= 0 for s in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
        ):
            raise CheckpointError(f"{self.path}: tensor {name!r}: corrupt shape or offsets")
        dtype = _DTYPES[tag]
        begin, end = offsets
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != expected or begin < 0:
            raise CheckpointError(
                f"{self.path}: tensor {name!r}: {end - begin} bytes for shape {shape} {tag}"
            )
        if end > data_len:
            raise CheckpointError(
                f"{self.path}: truncated: tensor {name!r} needs bytes up to {end} "
                f"but the data section has {data_len}"
            )
        return dtype, tuple(shape), begin, end

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def raw(self, name: str) -> np.ndarray:
        """Read-only view on the stored bytes (no copy; pages load when touched)."""
        dtype, shape, begin, end = self._entries[name]
        if begin == end:  # empty tensor (and mmap refuses an empty data section)
            return np.empty(shape, dtype=dtype)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start)
        return self._map[begin:end].view(dtype).reshape(shape)

    def float32(self, name: str) -> np.ndarray:
        """The tensor as float32: zero-copy for F32 files, converted otherwise."""
        dtype, *_ = self._entries[name]
        raw = self.raw(name)
        if dtype == np.dtype("<u2"):
            return bf16_to_float32(raw)
        if dtype == np.dtype("<f4"):
            return raw
        return raw.astype(np.float32)

    def float32_rows(self, name: str, rows: np.ndarray | int) -> np.ndarray:
        """Rows (first-axis entries) as float32, converting only those: an embedding lookup,
        or one expert of a merged expert tensor."""
        dtype, *_ = self._entries[name]
        raw = self.raw(name)[rows]
        if dtype == np.dtype("<u2"):
            return bf16_to_float32(raw)
        return raw.astype(np.float32, copy=False)
