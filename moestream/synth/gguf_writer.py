"""Streaming GGUF writer for synthetic models: the header and every tensor's info first, then the data
tensor by tensor, quantized in row blocks by a pool of threads, never the whole model in memory.

The values are those of the safetensors synth of the same arguments and seed, by construction: every
checkpoint tensor is produced by the same `chunks_for`, positioned at the noise chunk it gets in the
safetensors file order (`first_chunks`), so the GGUF can stack per-expert tensors into llama.cpp's
`[E, rows, cols]` expert tensors and write tensors in llama.cpp's order. The source values
(bf16 unless `--dtype` says otherwise) are widened to f32 and quantized with ggml's own
`ggml_quantize_chunk` (the quantizer llama-quantize calls) through moestream.ggml.

File layout (gguf.GGUFWriter writes the header, key-values and tensor infos): each tensor's data
starts at a multiple of `general.alignment` (32) after the info section, padded with zeros, in the
order of the infos.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
import torch

from moestream.synth.gguf_meta import Names
from moestream.synth.gguf_quant import ggml_n_dims, loader_order, tensor_types
from moestream.synth.layout import TensorSpec
from moestream.synth.noise import NoiseSource
from moestream.synth.weights import TORCH_DTYPE, InitScheme, chunks_for, first_chunks

_BLOCK_SOURCE_BYTES = 8 << 20  # rows handed to one quantize call: about 8 MiB of source values
_FLOAT = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor inside a GGUF tensor, and the noise chunk its values start at."""

    spec: TensorSpec
    at: int


@dataclass(frozen=True)
class GgufTensor:
    """One GGUF tensor: name, numpy-order shape ((E, rows, k) for experts), GGML type, and the
    checkpoint tensors it stacks along its first dimension."""

    name: str
    shape: tuple[int, ...]
    type: str
    pieces: tuple[Piece, ...]

    @property
    def ne(self) -> tuple[int, ...]:
        """GGML dimension order: ne[0] is the row length."""
        return tuple(reversed(self.shape))

    @property
    def nbytes(self) -> int:
        return row_nbytes(self.type, self.shape[-1]) * (prod(self.shape) // self.shape[-1])


def row_nbytes(type_name: str, k: int) -> int:
    """Bytes of one row of `k` values of a GGML type."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    return k // block * size


def plan_tensors(
    specs: list[TensorSpec], names: Names, quant: str, n_layer: int, n_expert: int
) -> list[GgufTensor]:
    """The GGUF tensors of a checkpoint, in llama.cpp's order, with the types `quant` gives them."""
    at = first_chunks(specs)
    single: dict[str, tuple[tuple[int, ...], tuple[Piece, ...]]] = {}
    stacks: dict[str, list[Piece]] = {}
    for spec, k in zip(specs, at):
        if spec.routed:
            proj = spec.name.rsplit(".", 2)[-2]  # ...experts.{e}.gate_proj.weight -> gate_proj
            stacks.setdefault(names.experts(spec.layer, proj), []).append(Piece(spec, k))
        else:
            single[names.of(spec.name)] = (spec.shape, (Piece(spec, k),))
    for name, pieces in stacks.items():
        pieces.sort(key=lambda p: p.spec.expert)
        if [p.spec.expert for p in pieces] != list(range(len(pieces))):
            raise RuntimeError(f"{name}: experts are not 0..{len(pieces) - 1}")
        single[name] = ((len(pieces), *pieces[0].spec.shape), tuple(pieces))
    ne = [(name, tuple(reversed(shape))) for name, (shape, _) in single.items()]
    types = tensor_types(ne, quant, n_layer, n_expert)
    out = []
    for n in loader_order(single):
        shape = single[n][0]
        if quant != "BF16":  # llama-quantize writes ggml's dimensions: [1, hidden] becomes [hidden]
            shape = shape[len(shape) - ggml_n_dims(tuple(reversed(shape))) :]
        out.append(GgufTensor(n, shape, types[n], single[n][1]))
    return out


class BlockSource:
    """Produces the source values of checkpoint tensors, positioned by their first noise chunk."""

    def __init__(self, scheme: InitScheme, source: NoiseSource, model: Any, seed: int) -> None:
        self._args = (scheme, source, model, seed)

    def row_blocks(self, piece: Piece) -> Iterator[torch.Tensor]:
        """The piece's bytes as whole-row blocks (1-D uint8) of about 8 MiB each."""
        spec = piece.spec
        scheme, source, model, seed = self._args
        row = spec.shape[-1] * TORCH_DTYPE[spec.dtype].itemsize
        block = max(1, _BLOCK_SOURCE_BYTES // row) * row
        return regroup(chunks_for(spec, scheme, source, model, seed, at=piece.at), block)


def regroup(chunks: Iterable[torch.Tensor], block: int) -> Iterator[torch.Tensor]:
    """Re-cut 1-D uint8 chunks into pieces of exactly `block` bytes (the last one may be shorter)."""
    pending: list[torch.Tensor] = []
    size = 0
    for chunk in chunks:
        pending.append(chunk)
        size += chunk.numel()
        while size >= block:
            buf = pending[0] if len(pending) == 1 else torch.cat(pending)
            yield buf[:block]
            rest = buf[block:]
            pending, size = ([rest] if rest.numel() else []), rest.numel()
    if size:
        yield pending[0] if len(pending) == 1 else torch.cat(pending)


def encode(block: torch.Tensor, source_dtype: str, k: int, type_name: str) -> np.ndarray:
    """Row block (uint8 bytes of `source_dtype` values, rows of `k`) -> its bytes in GGML `type_name`."""
    from moestream import ggml

    src = TORCH_DTYPE[source_dtype]
    if type_name == source_dtype:
        return block.numpy()
    values = block.view(src).reshape(-1, k).to(torch.float32)
    if type_name in _FLOAT:
        out = values.to(_FLOAT[type_name]).reshape(-1).view(torch.uint8)
    else:
        out = ggml.quantize(values.contiguous(), type_name, threads=1)
    expected = row_nbytes(type_name, k) * values.shape[0]
    if out.numel() != expected:
        raise RuntimeError(
            f"encoding {values.shape[0]} rows as {type_name} gave {out.numel()} bytes, not {expected}"
        )
    return out.numpy()


def write_data(
    fout: Any,
    tensors: list[GgufTensor],
    blocks: BlockSource,
    alignment: int,
    threads: int,
    on_bytes: Callable[[int], None] | None = None,
) -> int:
    """Write every tensor's data in order (each padded to `alignment`); return the data bytes written.

    Row blocks are encoded by `threads` workers; at most 2 x threads blocks are in flight, so memory
    stays bounded whatever the model size.
    """
    written = 0
    queue: deque[Future[np.ndarray] | bytes] = deque()

    def drain(limit: int) -> None:
        nonlocal written
        while len(queue) > limit:
            item = queue.popleft()
            data = item if isinstance(item, bytes) else item.result()
            fout.write(memoryview(data))
            if not isinstance(item, bytes):
                written += len(data)
                if on_bytes is not None:
                    on_bytes(len(data))

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="gguf-quantize") as pool:
        try:
            for t in tensors:
                for piece in t.pieces:
                    for block in blocks.row_blocks(piece):
                        queue.append(pool.submit(encode, block, piece.spec.dtype, t.shape[-1], t.type))
                        drain(2 * threads)
                queue.append(bytes(-t.nbytes % alignment))
            drain(0)
        except BaseException:
            for item in queue:
                if isinstance(item, Future):
                    item.cancel()
            raise
    return written
