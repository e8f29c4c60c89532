"""Streaming safetensors writer: header first, then tensor data chunk by chunk, never the whole model.

File format (safetensors): 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}` padded with spaces
to a multiple of 8, then the tensor bytes back to back in header order. Because every tensor's size
is known before any data exists, each shard's header is written first and its data streamed after.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I64": 8}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_WRITE_BUFFER = 8 << 20


@dataclass(frozen=True)
class TensorData:
    """One tensor to write: its checkpoint name, safetensors dtype, shape, and a chunk producer.

    `chunks()` yields 1-D uint8 tensors whose lengths add up to `nbytes`; it is called once, when
    the tensor's turn comes, so data is produced just in time.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * ITEMSIZE[self.dtype]


def plan_shards(tensors: list[TensorData], shard_bytes: int) -> list[list[TensorData]]:
    """Split tensors, in order, into shards of at most `shard_bytes` (a bigger tensor gets its own)."""
    shards: list[list[TensorData]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """HF shard file names: model.safetensors, or model-0000i-of-0000N.safetensors."""
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def header_bytes(tensors: list[TensorData], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header of a safetensors file holding `tensors` in this order."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_shard(path: Path, tensors: list[TensorData], on_bytes: Callable[[int], None] | None = None) -> int:
    """Write one safetensors file; return the number of tensor-data bytes written."""
    written = 0
    with open(path, "wb", buffering=_WRITE_BUFFER) as f:
        f.write(header_bytes(tensors))
        for t in tensors:
            got = 0
            for chunk in _checked(t):
                f.write(chunk.numpy())
                got += chunk.numel()
                if on_bytes is not None:
                    on_bytes(chunk.numel())
            if got != t.nbytes:
                raise RuntimeError(f"tensor {t.name}: produced {got} bytes, expected {t.nbytes}")
            written += got
    return written


def _checked(t: TensorData) -> Iterator[torch.Tensor]:
    for chunk in t.chunks():
        if chunk.dtype != torch.uint8 or chunk.dim() != 1 or not chunk.is_contiguous():
            raise RuntimeError(f"tensor {t.name}: chunks must be contiguous 1-D uint8 tensors")
        yield chunk


def write_checkpoint(
    out_dir: Path, tensors: list[TensorData], shard_bytes: int, on_bytes: Callable[[int], None] | None = None
) -> list[str]:
    """Write all tensors into `out_dir` as one file or as shards plus the index; return file names."""
    shards = plan_shards(tensors, shard_bytes)
    names = shard_names(len(shards))
    for name, shard in zip(names, shards):
        write_shard(out_dir / name, shard, on_bytes)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard},
        }
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        names.append(INDEX_NAME)
    return names
