"""GGML block types (GGUF's Q4_K, Q6_K, Q8_0, MXFP4, IQ4_XS, ...) as weight formats, computed by ggml's
CPU kernels on the blocks as stored.

ggml quantizes the activations to 8 bits inside its product (llama.cpp's behaviour), so results match a
dequantize-then-fp32 reference only within a tolerance; streamed and resident runs go through the same
kernel for the same batch and are identical. From a measured batch size per format and build
(`moestream.ggml.dequant_threshold`), dequantizing the blocks and running F.linear is faster (prefill).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moestream.cache.slots import Repack
from moestream.runtime.formats.base import SlotTable, WeightFormat
from moestream.store.experts import StoredFormat
from moestream.store.tensors import TORCH_DTYPES


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> a contiguous [M, N] (the 2-D rows ggml's elementwise ops take)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


class Ggml(WeightFormat):
    """One GGML block type of one (layer, kind): [rows, cols] stored as rows of `row_bytes` bytes."""

    name = "ggml"
    experts_at_once = True
    devices = ("cpu",)

    @staticmethod
    def check_type(name: str) -> None:
        """Raise `UnsupportedTypeError` unless ggml's CPU backend multiplies `name`."""
        from moestream import ggml

        ggml.ggml_type(name)

    def __init__(self, stored: StoredFormat, shapes: list[tuple[int, ...]], part_bytes: list[int]) -> None:
        from moestream import ggml

        super().__init__(stored, shapes, part_bytes)
        name = self.type_name
        self.type = ggml.ggml_type(name)  # raises for a type ggml cannot multiply
        self.rows, self.cols = self.matrix(shapes)
        lib = ggml.library()
        self._ggml = ggml
        self.threshold = ggml.dequant_threshold(name, lib.kind, ggml.compute_threads())
        # the ggml graphs' runner: every product by ggml_mul_mat_id, the kernel its graphs compute a
        # layer's cached experts with (so an expert computed alone gives their bits)
        self.by_id = False

    @property
    def type_name(self) -> str:
        """The GGML type of the blocks the kernels read."""
        return self.stored.name

    @staticmethod
    def matrix(shapes: list[tuple[int, ...]]) -> tuple[int, int]:
        """(rows, cols) of the logical matrix its parts hold."""
        rows, cols = shapes[0]
        return rows, cols

    @property
    def row_bytes(self) -> int:
        return self.type.row_bytes(self.cols)  # of the matrix the kernels read

    @property
    def alignment(self) -> int:
        return self._ggml.WEIGHT_ALIGNMENT

    def view(self, raws: list[torch.Tensor]) -> torch.Tensor:
        raw = raws[0]
        if raw.data_ptr() % self.alignment:
            raw = raw.clone()  # torch allocations are 64-byte aligned
        return raw

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # [t,in] @ dequantized [out,in]^T in the activations' dtype; never under the ggml graphs (`by_id`),
        # whose cached experts are mul_mat_id's whatever their rows: a streamed one must give those bits
        if x.shape[0] >= self.threshold and not self.by_id:
            return F.linear(x, self._ggml.dequantize(weight, self.type, self.rows, self.cols).to(x.dtype))
        product = self._ggml.linear_id if self.by_id else self._ggml.linear
        y = product(x.float().contiguous(), weight, self.type, self.rows)  # [t,out] f32
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def batch_groups(self) -> bool:
        # under the graphs (`by_id`): ggml's tiled kernel takes a K-quant matrix from 8 rows (`ggml.tiled`)
        from moestream.ggml import tiled

        return self.by_id and tiled.split(self.type.id, tiled.TILED_ROWS)

    def linear_experts(self, x: torch.Tensor, weights: list[Any] | SlotTable) -> torch.Tensor:
        # one ggml compute for every expert where `linear` would run ggml's mul_mat (its node, per expert);
        # rows that dequantize, and ggml_mul_mat_id under the graphs (`by_id`), go one `linear` each
        if isinstance(weights, SlotTable) or x.shape[-2] >= self.threshold or self.by_id:
            return super().linear_experts(x, weights)
        y = self._ggml.linear_experts(x.float().contiguous(), weights, self.type, self.rows)  # [E,t,out] f32
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        if gate.dtype != torch.float32 or up.dtype != torch.float32:
            return None
        return self._ggml.swiglu(_rows(gate), _rows(up)).view(gate.shape)  # elementwise: any leading dims

    def glu_oai(
        self, gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
    ) -> torch.Tensor | None:
        """gpt-oss's clamped SwiGLU by ggml's op (the one the ggml graphs compute it with), or None."""
        if gate.dtype != torch.float32 or up.dtype != torch.float32:
            return None
        return self._ggml.swiglu_oai(_rows(gate), _rows(up), alpha, limit).view(gate.shape)

    def lookup(self, raw: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        picked = self._ggml.get_rows(raw, self.type, self.rows, self.cols, ids.to(torch.int32))  # [n, cols]
        return picked.to(dtype)

    def fused(self, other: WeightFormat) -> WeightFormat | None:
        if not isinstance(other, Ggml) or other.stored != self.stored or other.cols != self.cols:
            return None
        return Ggml(
            self.stored, [(self.rows + other.rows, self.cols)], [self.part_bytes[0] + other.part_bytes[0]]
        )

    def expected_parts(self, out: int, inp: int) -> list[tuple[str, tuple[int, ...]]] | None:
        return [(self.stored.name, (out, inp))]

    def describe(self) -> str:
        return self.type.name

    def kernels(self) -> str | None:
        return self._ggml.describe()


class GgmlMxfp4(Ggml):
    """gpt-oss's MXFP4 safetensors experts under the ggml graphs: blocks [R, K/32, 16] u8 (low nibble =
    even element) and E8M0 scales [R, K/32] u8 as stored, rewritten by the cache once read (`repack`)
    into ggml's block_mxfp4 rows ({e, qs[16]} per 32 values: low nibbles elements 0-15, high 16-31), the
    same 17 bytes per 32 values; then computed like a GGUF's MXFP4 (ggml_mul_mat_id, activations as Q8_0
    blocks)."""

    repacks = True

    @property
    def type_name(self) -> str:
        return "MXFP4"

    @staticmethod
    def matrix(shapes: list[tuple[int, ...]]) -> tuple[int, int]:
        rows, groups, _ = shapes[0]
        return rows, 32 * groups

    def repack(self, rows: torch.Tensor | None) -> Repack | None:
        shape = self.shapes[0]

        def convert(parts: list[memoryview], out: memoryview) -> None:
            blocks = torch.frombuffer(parts[0], dtype=torch.uint8).view(shape)
            scales = torch.frombuffer(parts[1], dtype=torch.uint8).view(shape[:2])
            ggml_mxfp4(blocks, scales, rows, torch.frombuffer(out, dtype=torch.uint8))

        return Repack(self.type.nbytes(self.rows, self.cols), convert)

    def fused(self, other: WeightFormat) -> WeightFormat | None:
        return None

    def expected_parts(self, out: int, inp: int) -> list[tuple[str, tuple[int, ...]]] | None:
        return [("U8", (out, inp // 32, 16)), ("U8", (out, inp // 32))]


class GgmlTransposed(Ggml):
    """gpt-oss's bf16 (or f32) safetensors experts under the ggml graphs: stored [in, out] (x @ W), which
    ggml's products cannot take as they are (they contract each row's contiguous elements); the cache
    rewrites each matrix once read (`repack`) as its transpose [out, in], the same bytes reordered."""

    repacks = True

    @staticmethod
    def matrix(shapes: list[tuple[int, ...]]) -> tuple[int, int]:
        cols, rows = shapes[0]
        return rows, cols

    def repack(self, rows: torch.Tensor | None) -> Repack | None:
        dtype = TORCH_DTYPES[self.stored.name]
        shape = (self.cols, self.rows)

        def convert(parts: list[memoryview], out: memoryview) -> None:
            stored = torch.frombuffer(parts[0], dtype=torch.uint8)
            if stored.data_ptr() % dtype.itemsize:  # a safetensors file's odd header
                stored = stored.clone()
            # [in, out] -> [out, in] into a new tensor (`out` overlaps the part), then its rows in order
            laid = stored.view(dtype).view(shape).t().contiguous()
            dest = torch.frombuffer(out, dtype=torch.uint8).view(dtype).view(laid.shape)
            if rows is None:
                dest.copy_(laid)
            else:
                torch.index_select(laid, 0, rows, out=dest)

        return Repack(self.part_bytes[0], convert)

    def fused(self, other: WeightFormat) -> WeightFormat | None:
        return None

    def expected_parts(self, out: int, inp: int) -> list[tuple[str, tuple[int, ...]]] | None:
        return [(self.stored.name, (inp, out))]


def ggml_mxfp4(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """HF's MXFP4 blocks [R, G, 16] u8 (byte j: elements 2j, 2j+1 in its low, high nibble) and E8M0
    scales [R, G] u8 -> ggml's block_mxfp4 rows [R, G, 17] u8 (the scale, then byte j: elements j and
    16 + j), into `out` when given (it may overlap the inputs: they are copied first); `rows` [R]: the
    source row of each output row. 64-bit words of 8 bytes (little-endian), ~1 GB/s on one core."""
    R, G, _ = blocks.shape
    flat = blocks.reshape(R, G * 16)
    flat = flat.index_select(0, rows) if rows is not None else flat.clone()
    scales = scales.index_select(0, rows) if rows is not None else scales.clone()
    words = flat.view(torch.int64).view(R * G, 2)
    lo, hi = words[:, 0], words[:, 1]  # byte i: elements 2i, 2i+1 (lo) and 16+2i, 17+2i (hi)
    out = torch.empty(R, G, 17, dtype=torch.uint8) if out is None else out.view(R, G, 17)
    o = out.view(R * G, 17)
    o[:, 0] = scales.reshape(-1)
    o[:, 1::2] = ((lo & _LOW) | ((hi & _LOW) << 4)).view(torch.uint8).view(-1, 8)  # elements 2i, 16+2i
    o[:, 2::2] = (((lo >> 4) & _LOW) | (hi & _HIGH)).view(torch.uint8).view(-1, 8)  # 2i+1, 17+2i
    return out


_LOW = 0x0F0F0F0F0F0F0F0F  # each byte's low nibble
_HIGH = -0x0F0F0F0F0F0F0F10  # 0xF0F0F0F0F0F0F0F0 as an int64: each byte's high nibble
