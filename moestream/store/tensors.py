"""Reading whole tensors out of a checkpoint into anonymous memory (for the trunk and resident biases).

The trunk is read with plain file reads, not memory-mapped: a mapped file's pages can be reclaimed and
read again under a memory limit, and a file shrunk under a running process turns a page fault into a
SIGBUS. Read bytes are owned by the process.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from moestream.errors import CheckpointError
from moestream.store.safetensors_file import TensorRef

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


def read_bytes(ref: TensorRef) -> torch.Tensor:
    """The tensor's bytes as a fresh uint8 tensor [nbytes] (64-byte aligned, anonymous memory)."""
    out = torch.empty(ref.nbytes, dtype=torch.uint8)
    view = memoryview(out.numpy())
    fd = os.open(ref.file, os.O_RDONLY)
    try:
        got = 0
        while got < ref.nbytes:
            n = os.preadv(fd, [view[got:]], ref.offset + got)
            if n == 0:
                raise CheckpointError(f"{ref.file} ends inside tensor {ref.name} (the file is truncated)")
            got += n
    finally:
        os.close(fd)
    return out


def read_tensor(ref: TensorRef) -> torch.Tensor:
    """A dense tensor of the ref's dtype and shape, read into memory the process owns."""
    dtype = TORCH_DTYPES.get(ref.dtype)
    if dtype is None:
        raise CheckpointError(f"tensor {ref.name} has dtype {ref.dtype}, which moestream cannot load")
    return read_bytes(ref).view(dtype).view(ref.shape)


class LazyTensor:
    """A checkpoint tensor read on first use (`t[...]`), like safetensors' slices, so transformers reads
    only the tensors its model has a place for. Exposes the dtype and shape without reading."""

    def __init__(self, ref: TensorRef) -> None:
        self.ref = ref

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES.get(self.ref.dtype, torch.uint8)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.ref.shape)

    def get_shape(self) -> list[int]:
        return list(self.ref.shape)

    def get_dtype(self) -> str:
        return self.ref.dtype

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def __getitem__(self, index: object) -> torch.Tensor:
        tensor = read_tensor(self.ref)
        return tensor if index is Ellipsis else tensor[index]


class QuantizedTensor(LazyTensor):
    """A trunk tensor stored in a block type (GGUF's Q8_0, Q6_K, ...): [rows, cols] logically, `ref.nbytes`
    of blocks on disk. transformers gets a zero-size placeholder of the logical shape in `dtype` (no
    memory); the loader then gives the module the blocks (`raw`) or their dequantization."""

    def __init__(
        self,
        ref: TensorRef,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        dequantize: Callable[[torch.Tensor, str, tuple[int, ...]], torch.Tensor],
        rows: torch.Tensor | None = None,
        parts: tuple[TensorRef, ...] = (),
        cols: torch.Tensor | None = None,
    ) -> None:
        super().__init__(ref)
        self.logical_shape, self.placeholder_dtype, self._dequantize = tuple(shape), dtype, dequantize
        self.rows = rows  # row i is stored row rows[i] (whole rows of blocks move), or None: as stored
        # stored tensors of one type and width whose rows, one after another, are this one's (then
        # `rows`): `ref` then only describes the whole (shape, bytes), it is not read
        self.parts = parts
        # column j is stored column cols[j] (Qwen3.5's out_proj: whole heads of inputs moved, which would
        # split blocks): the blocks stay as stored and a product permutes its input instead
        # (`stored_inputs`); `dequantize` gives the moved matrix
        self.cols = cols

    @property
    def type_name(self) -> str:
        return self.ref.dtype

    @property
    def dtype(self) -> torch.dtype:
        return self.placeholder_dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.logical_shape)

    def get_shape(self) -> list[int]:
        return list(self.logical_shape)

    def is_floating_point(self) -> bool:
        return True

    def __getitem__(self, index: object) -> torch.Tensor:
        # every element the same zero: a stride-0 view of one element, whatever the logical size
        return torch.zeros((), dtype=self.placeholder_dtype).expand(self.logical_shape)

    def raw(self) -> torch.Tensor:
        """The stored blocks, uint8 [nbytes], read into memory the process owns (rows in `rows` order)."""
        data = torch.cat([read_bytes(p) for p in self.parts]) if self.parts else read_bytes(self.ref)
        if self.rows is None:
            return data
        return data.view(self.rows.numel(), -1)[self.rows].reshape(-1)

    @property
    def stored_inputs(self) -> torch.Tensor | None:
        """With `cols`: the order x[..., stored_inputs] of an input x (in the logical order) that the
        stored blocks multiply (x @ W^T = x[..., stored_inputs] @ stored^T); else None."""
        return None if self.cols is None else torch.argsort(self.cols)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        w = self._dequantize(self.raw(), self.type_name, self.logical_shape)
        return (w if self.cols is None else w[:, self.cols]).to(dtype)
