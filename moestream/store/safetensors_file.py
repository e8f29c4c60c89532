"""Safetensors headers: tensor name -> dtype, shape and absolute byte range in the file.

The safetensors library reads tensors but does not expose where they sit in the file, which is exactly
what O_DIRECT streaming needs, so the (documented, tiny) header format is parsed here: an 8-byte
little-endian header length, a JSON object, then the data section that `data_offsets` index into.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from moestream.errors import CheckpointError

# safetensors dtype string -> bytes per element
DTYPE_BYTES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorRef:
    """One tensor (or a contiguous slice of one) inside a checkpoint file."""

    file: str
    offset: int  # absolute byte offset in the file
    nbytes: int
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    name: str = ""

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def read_header(path: str | Path) -> dict[str, TensorRef]:
    """Parse one safetensors file's header into absolute tensor locations.

    Raises:
        CheckpointError: the file is missing, unreadable, truncated or its header is not valid.
    """
    path = str(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path} is not a safetensors file: it is only {size} bytes long")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"{path} has a corrupt safetensors header (declared length {header_len})"
                )
            raw = f.read(header_len)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} does not exist") from None
    except PermissionError:
        raise CheckpointError(f"checkpoint file {path} is not readable (permission denied)") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path} is a directory, not a safetensors file") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        return _tensor_refs(path, header, 8 + header_len, size)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} has a corrupt safetensors header ({exc})") from None


def _tensor_refs(path: str, header: dict, data_start: int, size: int) -> dict[str, TensorRef]:
    refs: dict[str, TensorRef] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = (int(v) for v in info["data_offsets"])
        dtype, shape = str(info["dtype"]), tuple(int(d) for d in info["shape"])
        if dtype not in DTYPE_BYTES or begin < 0 or end < begin or min(shape, default=0) < 0:
            raise ValueError(
                f"tensor {name} has dtype {dtype}, shape {list(shape)} and offsets {begin}..{end}"
            )
        expected = DTYPE_BYTES[dtype]
        for dim in shape:
            expected *= dim
        if expected != end - begin:
            raise ValueError(
                f"tensor {name} spans {end - begin} bytes but shape {list(shape)} needs {expected}"
            )
        refs[name] = TensorRef(path, data_start + begin, end - begin, dtype, shape, name)
    _check_disjoint(refs)
    return refs


def _check_disjoint(refs: dict[str, TensorRef]) -> None:
    """Two tensors sharing bytes would make one expert's read return another's weights."""
    previous: TensorRef | None = None
    for ref in sorted((r for r in refs.values() if r.nbytes), key=lambda r: (r.offset, r.end)):
        if previous is not None and ref.offset < previous.end:
            raise ValueError(
                f"tensors {previous.name} (bytes {previous.offset}..{previous.end}) and "
                f"{ref.name} (bytes {ref.offset}..{ref.end}) overlap"
            )
        previous = ref


def check_not_truncated(path: str, refs: dict[str, TensorRef]) -> None:
    """Fail with the name of the first tensor that runs past the end of a truncated file."""
    size = os.path.getsize(path)
    for ref in sorted(refs.values(), key=lambda r: r.end):
        if ref.end > size:
            raise CheckpointError(
                f"{path} is truncated: it ends at byte {size}, inside tensor {ref.name} "
                f"(bytes {ref.offset}..{ref.end})"
            )
