"""The GGML types that ggml's CPU backend multiplies, with block geometry from ggml's own type traits.

A type is multipliable when the CPU backend has a dot-product kernel for it (`vec_dot` in
ggml_get_type_traits_cpu); that covers F32, F16, BF16, Q4_0..Q8_0, Q2_K..Q6_K, the IQ types, TQ*,
MXFP4, NVFP4 and Q1_0 in ggml 0.20+. Block sizes and bytes come from ggml and are checked against the
`gguf` package's GGML_QUANT_SIZES, which is what GGUF readers and writers size tensors with.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream.errors import MoestreamError
from moestream.ggml.lib import GgmlUnavailableError, library


class UnsupportedTypeError(MoestreamError):
    """A tensor type that ggml's CPU backend cannot multiply (or that no GGUF file can hold)."""


@dataclass(frozen=True)
class GgmlType:
    """A multipliable type; `vec_dot_type` is what ggml converts the f32 activations to (Q8_0, Q8_K...)."""

    id: int
    name: str  # GGUF spelling: "Q4_K", "MXFP4", "BF16"
    block: int  # weights per block
    block_bytes: int  # bytes per block
    vec_dot_type: str  # e.g. "Q8_K" for the K-quants: the activation precision of the product
    quantized: bool
    needs_imatrix: bool  # ggml_quantize_chunk refuses this type without an importance matrix

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k weights; k must be a whole number of blocks."""
        if k <= 0 or k % self.block:
            raise ValueError(
                f"{self.name} rows hold whole blocks of {self.block} weights; {k} is not a multiple"
            )
        return k // self.block * self.block_bytes

    def nbytes(self, rows: int, k: int) -> int:
        """Bytes of a [rows, k] matrix (rows are stored back to back, unpadded, as in GGUF)."""
        return rows * self.row_bytes(k)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block


TypeLike = int | str | GGMLQuantizationType | GgmlType


@cache
def type_table() -> dict[str, GgmlType]:
    """Every type of the GGUF enum that the loaded ggml multiplies on the CPU, by GGUF name."""
    lib = library()
    table = {}
    for t in GGMLQuantizationType:
        traits = lib.base.ggml_get_type_traits(t.value).contents
        name = (traits.type_name or b"").decode()
        if name.lower() != t.name.lower():  # the library and gguf disagree on what this id means
            raise GgmlUnavailableError(
                f"ggml calls type {t.value} {name!r} where gguf says {t.name}: "
                "this ggml version is not supported."
            )
        cpu = lib.cpu.ggml_get_type_traits_cpu(t.value).contents
        if not cpu.vec_dot:
            continue
        if GGML_QUANT_SIZES[t] != (traits.blck_size, traits.type_size):
            raise GgmlUnavailableError(
                f"{t.name} blocks are {traits.blck_size} weights in "
                f"{traits.type_size} bytes in ggml but {GGML_QUANT_SIZES[t]} in gguf."
            )
        table[t.name] = GgmlType(
            t.value,
            t.name,
            int(traits.blck_size),
            int(traits.type_size),
            GGMLQuantizationType(cpu.vec_dot_type).name,
            bool(traits.is_quantized),
            bool(lib.base.ggml_quantize_requires_imatrix(t.value)),
        )
    return table


def ggml_type(t: TypeLike) -> GgmlType:
    """Resolve an id, a GGUF name ("q4_k" or "Q4_K"), a gguf enum member or a GgmlType; refuse the rest."""
    if isinstance(t, GgmlType):
        return t
    table = type_table()
    if isinstance(t, str):
        name = t.upper()
    else:
        try:
            name = GGMLQuantizationType(int(t)).name
        except ValueError:
            raise UnsupportedTypeError(f"{t} is not a GGML tensor type.") from None
    if name not in table:
        known = name in GGMLQuantizationType.__members__
        raise UnsupportedTypeError(
            f"ggml's CPU backend cannot multiply {name} tensors."
            if known
            else f"{t!r} is not a GGML tensor type."
        )
    return table[name]


def row_bytes(t: TypeLike, k: int) -> int:
    """Bytes of one row of k weights of type t."""
    return ggml_type(t).row_bytes(k)
