"""GGUF block types the GPU kernels read, with their block geometry (plain Python: no torch, no triton).

A GGUF matrix [N, K] of a block type is N rows stored back to back, unpadded; a row is K / `block`
blocks of `block_bytes` bytes each. The ids are ggml's `enum ggml_type` values (the same numbers as
`gguf.GGMLQuantizationType`), which the kernels also use to select their decoder at compile time.
"""

from __future__ import annotations

from dataclasses import dataclass

from moestream.errors import MoestreamError


class UnsupportedTypeError(MoestreamError, ValueError):
    """A tensor type the GPU kernels do not read, or a shape its blocks cannot hold."""


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type: `block` weights stored in `block_bytes` bytes."""

    id: int  # ggml_type
    name: str  # GGUF spelling: "Q4_K", "MXFP4"
    block: int
    block_bytes: int
    fp16_at: tuple[int, ...] = ()  # byte offsets of the fp16 scales/mins in a block (ggml-common.h)

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k weights; k must be a positive whole number of blocks."""
        if k <= 0 or k % self.block:
            raise UnsupportedTypeError(
                f"{self.name} rows hold whole blocks of {self.block} weights; K={k} is not a multiple"
            )
        return k // self.block * self.block_bytes

    def nbytes(self, n: int, k: int) -> int:
        """Bytes of an [n, k] matrix."""
        return n * self.row_bytes(k)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block


_TYPES = (
    BlockType(2, "Q4_0", 32, 18, (0,)),
    BlockType(3, "Q4_1", 32, 20, (0, 2)),
    BlockType(6, "Q5_0", 32, 22, (0,)),
    BlockType(7, "Q5_1", 32, 24, (0, 2)),
    BlockType(8, "Q8_0", 32, 34, (0,)),
    BlockType(10, "Q2_K", 256, 84, (80, 82)),
    BlockType(11, "Q3_K", 256, 110, (108,)),
    BlockType(12, "Q4_K", 256, 144, (0, 2)),
    BlockType(13, "Q5_K", 256, 176, (0, 2)),
    BlockType(14, "Q6_K", 256, 210, (208,)),
    BlockType(20, "IQ4_NL", 32, 18, (0,)),
    BlockType(23, "IQ4_XS", 256, 136, (0,)),
    BlockType(39, "MXFP4", 32, 17),  # byte 0: an E8M0 exponent
)
TYPES: dict[str, BlockType] = {t.name: t for t in _TYPES}
_BY_ID: dict[int, BlockType] = {t.id: t for t in _TYPES}

TypeLike = str | int  # a GGUF name, or a ggml type id (gguf.GGMLQuantizationType is an int)


def block_type(qtype: TypeLike | BlockType) -> BlockType:
    """The block type named by a GGUF name ("Q4_K"), a ggml type id or enum member, or a BlockType."""
    if isinstance(qtype, BlockType):
        return qtype
    if isinstance(qtype, str):
        found = TYPES.get(qtype.upper())
    else:
        found = _BY_ID.get(int(qtype))
    if found is None:
        label = getattr(qtype, "name", qtype)
        raise UnsupportedTypeError(
            f"the GPU kernels do not read {label} blocks (they read {', '.join(TYPES)})"
        )
    return found
