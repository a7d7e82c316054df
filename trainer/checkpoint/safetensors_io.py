"""The safetensors file format, read and written here a piece at a time: an 8-byte little-endian
header length, a JSON header giving each tensor's dtype, shape and byte range, then the raw bytes
in row-major order.

The safetensors package serialises only whole dictionaries of tensors held in memory, and reads
through a memory map, whose touched pages count as the reader's resident memory; a rank that
reads its shards of a large model through it shows the size of everything it read. Here a writer
streams tensor after tensor under a header written first, and a reader reads a block of rows
(or of a dimension's slice) with plain file reads into memory of its own.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from trainer.errors import ConfigError

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
CHUNK_BYTES = 64 << 20  # a read of rows whose other dimensions are sliced goes this much at a time


def encode_header(tensors: list[tuple[str, torch.dtype, list[int]]]) -> bytes:
    """The header for tensors (name, dtype, shape) whose bytes follow in this order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors' bytes start 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def _check_layout(path: Path, header: dict, start: int, size: int) -> None:
    """As the safetensors library holds a file to: each entry a supported dtype and a shape, its
    byte range exactly its dtype x shape, the ranges back to back from the first byte of the data
    to its last, so no two overlap and none runs past the end."""
    ranges = []
    for name, entry in header.items():
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if dtype not in DTYPES:
            raise ConfigError(f"{path}: {name} has dtype {dtype}, which is not supported")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)
                and isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(n, int) for n in offsets)):
            raise ConfigError(f"{path}: {name}'s shape or data_offsets are not counts")
        begin, end = offsets
        if end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
            raise ConfigError(f"{path}: {name}'s data_offsets {offsets} hold {end - begin} bytes, "
                              f"not the {math.prod(shape) * DTYPES[dtype].itemsize} of its dtype "
                              f"{dtype} and shape {shape}")
        ranges.append((begin, end, name))
    at, name = 0, None
    for begin, end, name in sorted(ranges):
        if begin != at:
            raise ConfigError(f"{path}: {name} starts at data byte {begin}, where "
                              f"{'the data starts' if at == 0 else 'the entry before ends'} "
                              f"({at}): {'overlapping' if begin < at else 'gapped'} entries")
        at = end
    if start + at > size:
        raise ConfigError(f"{path} is truncated: {name} ends at byte {start + at}, the file has "
                          f"{size}")
    if start + at < size:
        raise ConfigError(f"{path} holds {size - start - at} bytes after its last entry, which its "
                          "header does not describe")


class SafetensorsFile:
    """The header of a safetensors file, checked against the file's size, and reads of its
    tensors."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else size
            if 8 + length > size:
                raise ConfigError(f"{path} is not a safetensors file, or is truncated (its header "
                                  "runs past its end)")
            try:
                header = json.loads(f.read(length))
            except ValueError as e:
                raise ConfigError(f"{path}: the safetensors header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise ConfigError(f"{path}: the safetensors header is not a JSON object")
        header.pop("__metadata__", None)
        self.start, self.tensors = 8 + length, header
        _check_layout(path, header, self.start, size)

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name]["shape"])

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The block `box` (one slice of step 1 per dimension) of tensor `name`."""
        entry = self.tensors[name]
        dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        rows, rest = box[0], box[1:]
        whole_rows = all(s.start == 0 and s.stop == n for s, n in zip(rest, shape[1:]))
        out = torch.empty([s.stop - s.start for s in box], dtype=dtype)
        with open(self.path, "rb") as f:
            if whole_rows:  # one contiguous byte range, read straight into the result
                self._read_into(f, name, entry, rows.start * row_bytes,
                                out.view(-1).view(torch.uint8))
                return out
            step = max(1, CHUNK_BYTES // max(row_bytes, 1))
            for first in range(rows.start, rows.stop, step):
                last = min(first + step, rows.stop)
                chunk = torch.empty((last - first) * row_bytes, dtype=torch.uint8)
                self._read_into(f, name, entry, first * row_bytes, chunk)
                block = chunk.view(dtype).view(-1, *shape[1:])
                out[first - rows.start:last - rows.start] = block[(slice(None), *rest)]
        return out

    def _read_into(self, f, name: str, entry: dict, offset: int, buffer: torch.Tensor) -> None:
        f.seek(self.start + entry["data_offsets"][0] + offset)
        if buffer.numel() and f.readinto(buffer.numpy()) != buffer.numel():
            raise ConfigError(f"{self.path} is truncated inside {name}")
