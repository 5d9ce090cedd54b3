"""Where every tensor of a safetensors checkpoint lies, read from the files' headers alone.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor name to
its dtype, shape and byte range `[begin, end)` within the data section, then the data. `index_files`
reads only the headers, checks each one against its file (a tensor whose bytes run past the end of a
truncated file, a range that does not match dtype x shape) and returns one `TensorEntry` per tensor, so
the loader can read every byte straight into its destination with plain `readinto` calls: no mapping of
the file (which would count the page cache in the process's RSS), no second pass. A damaged file is one
line naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from moecache.errors import MoecacheError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: its file, dtype, shape and absolute byte offset in the file."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute, in the file
    nbytes: int


@dataclass(frozen=True)
class FileHeader:
    """One file's header: its size and the raw header bytes (the revision identity hashes these)."""

    file: Path
    size: int
    header: bytes


def read_header(file: Path) -> tuple[FileHeader, list[TensorEntry]]:
    """The header of one safetensors file and its tensors in file order; one line per defect."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise MoecacheError(f"{file}: not a safetensors file ({size} bytes, no header)")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER or 8 + length > size:
                raise MoecacheError(f"{file}: not a safetensors file or truncated (header of {length} bytes)")
            raw = f.read(length)
    except OSError as exc:
        raise MoecacheError(f"cannot read {file}: {' '.join(str(exc).split())}") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MoecacheError(f"{file}: the safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise MoecacheError(f"{file}: the safetensors header is not a JSON object")
    data_start = 8 + length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries.append(_entry(file, size, data_start, name, info))
    entries.sort(key=lambda e: e.offset)
    return FileHeader(file, size, raw), entries


def _entry(file: Path, size: int, data_start: int, name: str, info) -> TensorEntry:
    try:
        dtype = DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(v) for v in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise MoecacheError(f"{file}: tensor {name}: malformed header entry {info!r}") from exc
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes or begin < 0:
        raise MoecacheError(
            f"{file}: tensor {name}: byte range [{begin}, {end}) does not hold {info['dtype']} {list(shape)}"
        )
    if data_start + end > size:
        raise MoecacheError(
            f"{file}: truncated: tensor {name} ends at byte {data_start + end}, the file has {size} bytes"
        )
    return TensorEntry(name, file, dtype, shape, data_start + begin, nbytes)


def index_files(files: list[Path]) -> tuple[list[FileHeader], list[TensorEntry]]:
    """Every file's header and every tensor (in file order, then offset order); a name held by two
    files is refused."""
    headers, entries, seen = [], [], {}
    for file in files:
        header, found = read_header(file)
        headers.append(header)
        for entry in found:
            if entry.name in seen:
                raise MoecacheError(f"tensor {entry.name} is in both {seen[entry.name].name} and {file.name}")
            seen[entry.name] = file
        entries.extend(found)
    return headers, entries
