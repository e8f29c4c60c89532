"""GGML block types on NVIDIA GPUs: Triton kernels that read the blocks as stored (`moestream.kernels`),
either multiplying directly (decode-sized batches) or dequantizing into a scratch tensor for a torch
matmul (large batches), as the measured route table says per type and batch."""

from __future__ import annotations

import torch

from moestream.runtime.formats.base import SlotTable, WeightFormat
from moestream.store.experts import StoredFormat


class GgufCuda(WeightFormat):
    """One GGML block type of one (layer, kind) on the GPU: [rows, cols] as rows of `row_bytes`."""

    name = "gguf-cuda"
    experts_at_once = True
    devices = ("cuda",)

    @staticmethod
    def check_type(name: str) -> None:
        """Raise `UnsupportedTypeError` unless the GPU kernels decode `name`."""
        from moestream import kernels

        kernels.block_type(name)

    def __init__(self, stored: StoredFormat, shapes: list[tuple[int, ...]], part_bytes: list[int]) -> None:
        from moestream import kernels

        super().__init__(stored, shapes, part_bytes)
        self.rows, self.cols = shapes[0]
        self._kernels = kernels
        kernels.block_type(stored.name)

    def view(self, raws: list[torch.Tensor]) -> torch.Tensor:
        return raws[0]  # the kernels read bytes at any offset

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # [t, in] -> [t, out] in x's dtype, fp32 accumulation
        return self._kernels.linear(x.contiguous(), weight, self.stored.name, self.rows)

    def accepts(self, tokens: int) -> bool:
        return self._kernels.choose(self.stored.name, tokens) == "direct"

    def linear_experts(self, x: torch.Tensor, weights: list[torch.Tensor] | SlotTable) -> torch.Tensor:
        # one grouped launch over the buffer the views share (a GPU slot buffer): the kernel and tile
        # `linear` runs for t rows, so every expert's rows come out with the same bits; rows the route
        # table sends elsewhere, or views in several buffers, go one `linear` each (the same bits again)
        e, t = len(weights), x.shape[-2]
        if not t or not self.accepts(t):
            return super().linear_experts(x, weights)
        shared = x.dim() == 2
        if isinstance(weights, SlotTable):  # offsets already on the device: nothing to copy or read back
            buffer, offsets = weights.buffer, weights.offsets
            starts = torch.arange(e + 1, dtype=torch.int64, device=x.device) * t
            rows = torch.arange(t, dtype=torch.int64, device=x.device).repeat(e) if shared else None
        else:
            storage = weights[0].untyped_storage()
            base = storage.data_ptr()
            if any(w.untyped_storage().data_ptr() != base for w in weights):
                return super().linear_experts(x, weights)
            buffer = torch.empty(0, dtype=torch.uint8, device=weights[0].device).set_(storage)
            host = [w.data_ptr() - base for w in weights] + [i * t for i in range(e + 1)]
            meta = torch.tensor(host + (list(range(t)) * e if shared else []), dtype=torch.int64)
            if x.is_cuda:  # one asynchronous copy (the caching host allocator keeps it alive)
                meta = meta.pin_memory().to(x.device, non_blocking=True)
            offsets, starts = meta[:e], meta[e : 2 * e + 1]
            rows = meta[2 * e + 1 :] if shared else None
        out = self._kernels.grouped_matmul(
            x.contiguous() if shared else x.reshape(e * t, x.shape[-1]).contiguous(),
            buffer,
            self.stored.name,
            self.rows,
            offsets,
            starts,
            rows=rows,
            max_rows=t,
        )
        return out.view(e, t, self.rows)

    def lookup(self, raw: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._kernels.dequantize(raw, self.stored.name, self.rows, self.cols, dtype, ids=ids)

    def fused(self, other: WeightFormat) -> WeightFormat | None:
        if not isinstance(other, GgufCuda) or other.stored != self.stored or other.cols != self.cols:
            return None
        return GgufCuda(
            self.stored, [(self.rows + other.rows, self.cols)], [self.part_bytes[0] + other.part_bytes[0]]
        )

    def expected_parts(self, out: int, inp: int) -> list[tuple[str, tuple[int, ...]]] | None:
        return [(self.stored.name, (out, inp))]

    def describe(self) -> str:
        return self.stored.name

    def kernels(self) -> str | None:
        from moestream.kernels.choice import MEASURED_TYPES

        routes = "measured" if self.stored.name in MEASURED_TYPES else "unmeasured"
        return f"Triton GGUF kernels ({routes} routes)"
