"""Turning slot bytes into weight tensors: zero-copy views, or MXFP4 dequantization after the read."""

from __future__ import annotations

import torch

from moestream.cache.slots import PartRead
from moestream.io.memory import AlignedBuffer

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
}
# E2M1 values indexed by a 4-bit code (sign bit 3)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class SlotTensors:
    """Byte-level torch views of the cache's slot buffers, made once per buffer."""

    def __init__(self) -> None:
        self._bytes: dict[int, torch.Tensor] = {}

    def bytes_of(self, buffer: AlignedBuffer) -> torch.Tensor:
        """The whole buffer as a uint8 tensor (no copy)."""
        whole = self._bytes.get(id(buffer))
        if whole is None:
            whole = torch.frombuffer(buffer.view, dtype=torch.uint8)
            self._bytes[id(buffer)] = whole
        return whole

    def view(self, buffer: AlignedBuffer, offset: int, part: PartRead) -> torch.Tensor:
        """A tensor of the part's dtype and shape over its bytes in the slot (no copy when aligned)."""
        raw = self.bytes_of(buffer)[offset : offset + part.ref.nbytes]
        dtype = TORCH_DTYPES[part.ref.dtype]
        if offset % dtype.itemsize:
            raw = raw.clone()  # misaligned for the element type (odd header padding): copy once
        return raw.view(dtype).view(part.ref.shape)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 -> dense. blocks [R, K/32, 16] u8 (low nibble = even element), scales [R, K/32] u8 (E8M0).

    Returns [R, K] in `dtype`.
    """
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    rows, groups, _ = blocks.shape
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(rows, groups, 32)
    values = lut[codes.long()]  # [R, G, 32]
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents[..., None]).to(dtype).reshape(rows, groups * 32)
