"""The weight format protocol and the formats torch computes: plain floating point, and gpt-oss's MXFP4
safetensors blocks (dequantized after each read)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from moestream.cache.slots import Repack
from moestream.store.experts import StoredFormat
from moestream.store.tensors import TORCH_DTYPES

# E2M1 values indexed by a 4-bit code (sign bit 3)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass
class SlotTable:
    """Several experts' matrices of one kind in one slot buffer, located by byte offsets that live on the
    device (gathered there from the routing, so no host readback is needed): `linear_experts` takes it
    in place of a list of views where the format `accepts` the batch."""

    buffer: torch.Tensor  # uint8, the whole slot buffer
    offsets: torch.Tensor  # int64 [E] on buffer's device: where each expert's matrix starts

    def __len__(self) -> int:
        return self.offsets.numel()


class WeightFormat(ABC):
    """One stored matrix type, for the parts of one (layer, kind)."""

    name: ClassVar[str] = "abstract"
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")  # device types whose kernels compute it
    # `linear_experts` computes several experts in one call (not one `linear` each): a layer's experts
    # that are all held are worth computing as one batch (`runtime/switch.py`)
    experts_at_once: ClassVar[bool] = False
    # the cache rewrites its parts once read (`repack`): its kernels do not read them as stored
    repacks: ClassVar[bool] = False

    def accepts(self, tokens: int) -> bool:
        """Whether `linear_experts` computes experts on `tokens` rows in one batched kernel, from views or
        from a `SlotTable` (the device tables of runtime/resident.py need that)."""
        return False

    def __init__(self, stored: StoredFormat, shapes: list[tuple[int, ...]], part_bytes: list[int]) -> None:
        self.stored, self.shapes, self.part_bytes = stored, shapes, part_bytes

    @property
    def alignment(self) -> int:
        """A part's first byte must sit at a multiple of this for `view` to be zero-copy."""
        return 1

    @abstractmethod
    def view(self, raws: list[torch.Tensor]) -> Any:
        """uint8 tensors over each part's bytes (slot memory, any device) -> the weight, zero-copy when
        the bytes are aligned."""

    @abstractmethod
    def linear(self, x: torch.Tensor, weight: Any) -> torch.Tensor:
        """x [t, in] -> [t, out]."""

    def fused(self, other: WeightFormat) -> WeightFormat | None:
        """The format of this matrix with `other`'s rows appended right after its bytes (one matmul for
        both, e.g. gate and up), or None when the two cannot be computed as one."""
        return None

    def expected_parts(self, out: int, inp: int) -> list[tuple[str, tuple[int, ...]]] | None:
        """(stored dtype, shape) of each part of a logical [out, in] matrix in this format, for the check
        at load; None: the format does not say (its parts are not checked)."""
        return None

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row of the first part."""
        return self.part_bytes[0] // self.shapes[0][0]

    def describe(self) -> str:
        return self.stored.name

    def lookup(self, raw: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` [n] of the matrix stored in `raw`, dequantized: [n, cols] (embedding lookups)."""
        raise NotImplementedError(f"{self.describe()} matrices cannot be looked up by row")

    def batch_groups(self) -> bool:
        """Whether a batch of sequences' rows go to this format's products in groups of at most 7
        (`ggml.tiled.row_groups`), so that each row gets the bits it gets alone. Here: no."""
        return False

    def kernels(self) -> str | None:
        """What computes this format when it is not plain torch (for the mode line)."""
        return None

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up by this format's own kernels ([..., I] each), or None: the family computes it in
        torch."""
        return None

    def repack(self, rows: torch.Tensor | None) -> Repack | None:
        """How the cache is to rewrite this kind's parts once read, into the one part `view` then takes
        (its rows in the order `rows` [R] gives, when given: a family's choice), or None: the kernels
        read the parts as stored."""
        return None

    def linear_experts(self, x: torch.Tensor, weights: list[Any] | SlotTable) -> torch.Tensor:
        """Several experts' products, the one batched linear of a format (mlx-lm's
        QuantizedSwitchLinear): x [t, in] (the same rows for every expert) or [E, t, in] (expert i's own
        rows) by weights[i] -> [E, t, out], bit for bit what `linear` gives one by one (E >= 1). Here:
        `linear` one by one; a format with a kernel that takes several experts at once
        (`experts_at_once`) overrides it."""
        if isinstance(weights, SlotTable):
            raise TypeError(f"{self.describe()} experts cannot be computed from a device slot table")
        rows = [x] * len(weights) if x.dim() == 2 else list(x)
        return torch.stack([self.linear(r, w) for r, w in zip(rows, weights)])


class Dense(WeightFormat):
    """Plain floating-point matrices: a view of the bytes, cast to the compute dtype when it differs."""

    name = "dense"

    def __init__(self, stored: StoredFormat, shapes: list[tuple[int, ...]], part_bytes: list[int]) -> None:
        super().__init__(stored, shapes, part_bytes)
        self.storage = TORCH_DTYPES[stored.name]

    @property
    def alignment(self) -> int:
        return self.storage.itemsize

    def view(self, raws: list[torch.Tensor]) -> torch.Tensor:
        raw = raws[0]
        if raw.data_ptr() % self.alignment:
            raw = raw.clone()  # misaligned for the element type (odd header padding): copy once
        return raw.view(self.storage).view(self.shapes[0])

    def expected_parts(self, out: int, inp: int) -> list[tuple[str, tuple[int, ...]]] | None:
        return [(self.stored.name, (inp, out) if self.stored.transposed else (out, inp))]

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return x @ weight if self.stored.transposed else F.linear(x, weight)  # [in,out] or [out,in]

    def fused(self, other: WeightFormat) -> WeightFormat | None:
        if (
            not isinstance(other, Dense)
            or other.stored != self.stored
            or self.stored.transposed
            or other.shapes[0][1:] != self.shapes[0][1:]
        ):
            return None
        rows = self.shapes[0][0] + other.shapes[0][0]
        return Dense(self.stored, [(rows, *self.shapes[0][1:])], [self.part_bytes[0] + other.part_bytes[0]])


class MXFP4(WeightFormat):
    """OCP MXFP4 as gpt-oss safetensors store it: blocks [R, K/32, 16] u8 (low nibble = even element) and
    E8M0 scales [R, K/32] u8, two parts; dequantized after each read, then multiplied densely."""

    name = "mxfp4"

    def view(self, raws: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return raws[0].view(self.shapes[0]), raws[1].view(self.shapes[1])

    def expected_parts(self, out: int, inp: int) -> list[tuple[str, tuple[int, ...]]] | None:
        groups = inp // 32  # 32 elements per E8M0 scale, packed two per byte
        return [("U8", (out, groups, 16)), ("U8", (out, groups))]

    def linear(self, x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return x @ dequantize_mxfp4(*weight, x.dtype).T  # [R,K] -> [K,R], as transformers computes it


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 -> dense. blocks [R, K/32, 16] u8, scales [R, K/32] u8 (E8M0). Returns [R, K] in `dtype`."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    rows, groups, _ = blocks.shape
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(rows, groups, 32)
    values = lut[codes.long()]  # [R, G, 32]
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents[..., None]).to(dtype).reshape(rows, groups * 32)
