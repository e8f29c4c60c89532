"""GGUF headers: metadata and every tensor's stored type, logical shape and absolute byte range.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array, which takes seconds
on a real vocabulary (6.0 s against 0.08 s here for 151,936 tokens and merges: BENCHMARKS.md), and
maps the whole file. Only the scalar metadata and the tensor table are needed (the tokenizer is built
by transformers from the file itself), so the documented header is parsed here with plain reads:
magic, version, counts, key/value pairs, tensor infos, then the data section at the next multiple of
`general.alignment`. Type names and block sizes come from the `gguf` package.

A split GGUF (`NAME-00001-of-00003.gguf`) is opened from its first part: every part has its own
tensors (offsets relative to its own data section); the first part holds the metadata.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream.errors import CheckpointError
from moestream.store.safetensors_file import TensorRef

MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# value type id -> struct format of a fixed-size value
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_SCALARS.update({10: "<Q", 11: "<q", 12: "<d"})
_FLOAT32, _STRING, _ARRAY = 6, 8, 9
_CHUNK = 1 << 20


@dataclass
class GgufFile:
    """A GGUF model: the first part's metadata and the tensors of every part."""

    path: Path  # the file that was opened (the first part of a split)
    files: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, TensorRef] = field(default_factory=dict)

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def split_parts(path: Path) -> list[Path]:
    """The files of the model `path` names: itself, or every part of the split it starts.

    Raises:
        CheckpointError: `path` is a later part of a split, or a part is missing.
    """
    match = _SPLIT.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if int(match["no"]) != 1:
        first = path.with_name(f"{match['stem']}-00001-of-{match['count']}.gguf")
        raise CheckpointError(
            f"{path} is part {int(match['no'])} of a split GGUF; open its first part {first}"
        )
    names = (f"{match['stem']}-{no:05d}-of-{match['count']}.gguf" for no in range(1, count + 1))
    parts = [path.with_name(name) for name in names]
    for part in parts:
        if not part.exists():
            raise CheckpointError(f"part {part.name} of the split GGUF {path} is missing")
    return parts


def open_gguf(path: Path) -> GgufFile:
    """Read the header of `path` (and of every other part of its split); no tensor data is read.

    Raises:
        CheckpointError: a file is not GGUF, is truncated, or two parts hold the same tensor.
    """
    model = GgufFile(path=path)
    for number, part in enumerate(split_parts(path)):
        metadata, tensors = read_header(part)
        if number == 0:
            model.metadata = metadata
        for name, ref in tensors.items():
            if name in model.tensors:
                raise CheckpointError(f"tensor {name} is in two parts of the split GGUF {path}")
            model.tensors[name] = ref
        model.files.append(str(part))
    return model


def read_header(path: Path) -> tuple[dict[str, Any], dict[str, TensorRef]]:
    """(metadata, tensors) of one GGUF file. Arrays under `tokenizer.` are kept as their length only."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            cursor = _Cursor(f, path, size)
            if cursor.take(4) != MAGIC:
                raise CheckpointError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
            version, n_tensors, n_kv = cursor.unpack("<IQQ")
            if version not in _VERSIONS:
                raise CheckpointError(f"{path} is GGUF version {version}; moestream reads versions 2 and 3")
            metadata = {}
            for _ in range(n_kv):
                key = cursor.string()
                keep = not key.startswith("tokenizer.")  # vocabularies: their length only
                metadata[key] = cursor.value(cursor.unpack("<I")[0], keep_arrays=keep)
            infos = [_tensor_info(cursor) for _ in range(n_tensors)]
            alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
            data_start = -(-cursor.position // alignment) * alignment
    except FileNotFoundError:
        raise CheckpointError(f"GGUF file {path} does not exist") from None
    except PermissionError:
        raise CheckpointError(f"GGUF file {path} is not readable (permission denied)") from None
    tensors = {name: _ref(path, name, dims, kind, data_start + offset) for name, dims, kind, offset in infos}
    _check_not_truncated(path, size, tensors)
    return metadata, tensors


def _tensor_info(cursor: _Cursor) -> tuple[str, list[int], int, int]:
    name = cursor.string()
    (n_dims,) = cursor.unpack("<I")
    dims = list(cursor.array("Q", n_dims))
    type_id, offset = cursor.unpack("<IQ")
    return name, dims, type_id, offset


def _ref(path: Path, name: str, dims: list[int], type_id: int, offset: int) -> TensorRef:
    """dims are ggml's ne (fastest first); the ref's shape is numpy order, e.g. [E, rows, cols]."""
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise CheckpointError(f"tensor {name} in {path} has ggml type id {type_id} (unknown)") from None
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    cols = dims[0] if dims else 1
    if cols % block:
        raise CheckpointError(
            f"tensor {name} in {path} has rows of {cols} values: not whole {qtype.name} blocks"
        )
    rows = 1
    for dim in dims[1:]:
        rows *= dim
    shape = tuple(reversed(dims)) or (1,)
    return TensorRef(str(path), offset, rows * (cols // block) * block_bytes, qtype.name, shape, name)


def _check_not_truncated(path: Path, size: int, tensors: dict[str, TensorRef]) -> None:
    for ref in sorted(tensors.values(), key=lambda r: r.end):
        if ref.end > size:
            raise CheckpointError(
                f"{path} is truncated: it ends at byte {size}, inside tensor {ref.name} "
                f"(bytes {ref.offset}..{ref.end})"
            )


class _Cursor:
    """Sequential reads of a header through a growing buffer (headers are small; vocabularies are not)."""

    def __init__(self, f: BinaryIO, path: Path, size: int) -> None:
        self.f, self.path, self.size = f, path, size
        self.buf, self.pos, self.base = b"", 0, 0  # buf holds file bytes [base, base + len(buf))

    @property
    def position(self) -> int:
        return self.base + self.pos

    def _need(self, n: int) -> None:
        if self.pos + n <= len(self.buf):
            return
        if self.position + n > self.size:  # also catches absurd lengths in a corrupt header
            raise CheckpointError(f"{self.path} is truncated inside its GGUF header")
        more = self.f.read(max(n, _CHUNK))
        self.base += self.pos
        self.buf, self.pos = self.buf[self.pos :] + more, 0
        if len(self.buf) < n:
            raise CheckpointError(f"{self.path} is truncated inside its GGUF header")

    def take(self, n: int) -> bytes:
        self._need(n)
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        self._need(size)
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def array(self, code: str, count: int) -> tuple:
        """`count` values of struct type `code`; the count comes from the file, so it is checked first."""
        self._need(count * struct.calcsize("<" + code))
        return self.unpack(f"<{count}{code}") if count else ()

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        try:
            return self.take(length).decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path} has a corrupt GGUF header (a string is not UTF-8)") from None

    def value(self, type_id: int, keep_arrays: bool) -> Any:
        """One metadata value; an array not kept is returned as its length (and skipped)."""
        if type_id == _FLOAT32:  # the shortest decimal that is this float32: 1e-06, not 9.99999997e-07
            return float(str(np.float32(self.unpack("<f")[0])))
        if type_id in _SCALARS:
            return self.unpack(_SCALARS[type_id])[0]
        if type_id == _STRING:
            return self.string()
        if type_id != _ARRAY:
            raise CheckpointError(f"{self.path} has a corrupt GGUF header (value type {type_id})")
        item_type, count = self.unpack("<IQ")
        if item_type in _SCALARS:
            values = self.array(_SCALARS[item_type][1], count)
            if not keep_arrays:
                return count
            return [float(str(np.float32(v))) for v in values] if item_type == _FLOAT32 else list(values)
        if item_type == _STRING and not keep_arrays:
            for _ in range(count):
                self.take(self.unpack("<Q")[0])
            return count
        return [self.value(item_type, keep_arrays) for _ in range(count)]
