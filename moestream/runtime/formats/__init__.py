"""Weight formats: how one stored matrix type is viewed in slot memory and multiplied.

A format is chosen per (layer, kind) from the `StoredFormat` the checkpoint source recorded, because
one file may mix types (a GGUF Q4_K_M keeps some `ffn_down` at Q6_K). A `WeightFormat` instance knows
the shapes of its parts, the alignment its kernels need, how to view slot bytes as a weight without
copying, and computes `linear(x, weight)` = x @ W^T for W [out, in]. This package is the only place
that looks at format names; a new stored type is one subclass registered here (or by a test): `base`
has the protocol and the torch formats, `ggml` the GGML block types computed by ggml on the CPU.

Shapes: t tokens routed to the expert, `out` x `in` the logical matrix.
"""

from __future__ import annotations

from moestream.errors import UnsupportedModelError
from moestream.runtime.formats.base import MXFP4, Dense, WeightFormat, dequantize_mxfp4
from moestream.store.experts import ExpertMap, Parts, StoredFormat

__all__ = [
    "MXFP4",
    "Dense",
    "WeightFormat",
    "dequantize_mxfp4",
    "describe_formats",
    "layer_formats",
    "make_format",
    "register",
    "unregister",
]

_REGISTRY: dict[str, type[WeightFormat]] = {
    "F32": Dense,
    "F16": Dense,
    "BF16": Dense,
    "F64": Dense,
    "mxfp4": MXFP4,
}


def register(stored_name: str, cls: type[WeightFormat]) -> type[WeightFormat] | None:
    """Make `cls` compute parts stored as `stored_name`. Returns the class it replaces (or None)."""
    previous = _REGISTRY.get(stored_name)
    _REGISTRY[stored_name] = cls
    return previous


def unregister(stored_name: str, previous: type[WeightFormat] | None = None) -> None:
    """Undo `register` (restoring `previous` when given)."""
    if previous is None:
        _REGISTRY.pop(stored_name, None)
    else:
        _REGISTRY[stored_name] = previous


def _block_format(name: str, device: str) -> type[WeightFormat] | None:
    """GGML block types (GGUF files): ggml's kernels on the CPU, the Triton GGUF kernels on CUDA, when
    they compute the type (on CUDA, ggml's CPU library is not needed)."""
    if device == "cuda":
        from moestream.kernels import TYPES

        if name not in TYPES:
            return None
        from moestream.runtime.formats.gguf_cuda import GgufCuda

        return GgufCuda
    from moestream.ggml import UnsupportedTypeError, type_table

    if name not in type_table():
        return None
    from moestream.runtime.formats.ggml import Ggml

    try:
        Ggml.check_type(name)
    except UnsupportedTypeError:
        return None
    return Ggml


def make_format(stored: StoredFormat, parts: Parts, device: str = "cpu") -> WeightFormat:
    """The format computing `parts` (one expert's parts of one kind: their shapes are every expert's) on
    a device of type `device`.

    Raises:
        UnsupportedModelError: no format computes this stored type (on this device).
    """
    cls = _REGISTRY.get(stored.name) or _block_format(stored.name, device)
    if cls is None:
        raise UnsupportedModelError(
            f"experts stored as {stored.name} are not supported (supported: {', '.join(sorted(_REGISTRY))}"
            " and the GGML block types ggml's CPU backend multiplies)"
        )
    if device not in cls.devices:
        raise UnsupportedModelError(f"experts stored as {stored.name} cannot be computed on {device} yet")
    return cls(stored, [ref.shape for ref in parts], [ref.nbytes for ref in parts])


def layer_formats(
    emap: ExpertMap, device: str = "cpu", ggml_floats: bool = False
) -> dict[tuple[int, str], WeightFormat]:
    """(layer, kind) -> format, for every streamed layer of an `ExpertMap` (experts of one layer share
    their formats and shapes, so expert 0's parts describe them all). `ggml_floats`: F32/F16/BF16
    matrices (gpt-oss's [in, out] ones transposed once read) and gpt-oss's MXFP4 blocks (rewritten as
    ggml's) are computed by ggml too (the ggml graphs' runner: one kernel library for every expert)."""
    return {
        (layer, kind): _format(stored, emap.units[(layer, 0)][kind], device, ggml_floats)
        for (layer, kind), stored in emap.formats.items()
    }


def _format(stored: StoredFormat, parts: Parts, device: str, ggml_floats: bool) -> WeightFormat:
    registered = _REGISTRY.get(stored.name)  # a format registered for the name (a test's) wins
    if ggml_floats and device == "cpu" and registered in (Dense, MXFP4):
        from moestream.runtime.formats.ggml import Ggml, GgmlMxfp4, GgmlTransposed

        shapes, nbytes = [ref.shape for ref in parts], [ref.nbytes for ref in parts]
        if registered is MXFP4:  # rewritten as ggml's blocks once read
            return GgmlMxfp4(stored, shapes, nbytes)
        if stored.name in ("F32", "F16", "BF16") and len(parts) == 1:  # gpt-oss's [in, out]: transposed
            return (GgmlTransposed if stored.transposed else Ggml)(stored, shapes, nbytes)
    return make_format(stored, parts, device)


def describe_formats(formats: dict[tuple[int, str], WeightFormat]) -> str:
    """'Q4_K (gate, up), Q6_K (down) by ggml 0.25.3 native (AVX2, ...)': the stored types of the
    experts, which kinds use each, and the kernels that compute them."""
    kinds: dict[str, list[str]] = {}
    for (_, kind), fmt in sorted(formats.items()):
        kinds.setdefault(fmt.describe(), [])
        if kind not in kinds[fmt.describe()]:
            kinds[fmt.describe()].append(kind)
    text = ", ".join(name if len(kinds) == 1 else f"{name} ({', '.join(k)})" for name, k in kinds.items())
    engines = sorted({k for k in (fmt.kernels() for fmt in formats.values()) if k})
    return text + (f" by {', '.join(engines)}" if engines else "")
