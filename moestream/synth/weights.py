"""Initial values of synthetic weights, chosen so that the random model routes like a trained one.

With the plain init (every matrix N(0, 0.02)) each attention block adds a component that all tokens
share, the residual stream drifts towards it with depth, and deep routers send most tokens to the
same few experts: a cache would look far better than on a real model. The realistic init scales the
token embeddings up and the residual-branch outputs (attention output and MLP down projections,
routed, shared and dense) down, so the residual stream stays dominated by the token itself and every
layer routes by token: flat expert load and little overlap between neighbouring tokens, like real
2025-26 MoEs. docs/synth.md has the measurements behind the factors.
"""

from __future__ import annotations

import copy
import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from moestream.synth import noise as _noise
from moestream.synth.layout import TensorSpec

TORCH_DTYPE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# E2M1 code points of MXFP4 (sign bit 3): uniform random codes have this RMS
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_RMS = math.sqrt(sum(v * v for v in _FP4) / len(_FP4))
# scales are jittered by -1/0/+1 in the exponent, which multiplies the mean square by (1/4+1+4)/3
_SCALE_JITTER_RMS = math.sqrt((0.25 + 1.0 + 4.0) / 3)


@dataclass(frozen=True)
class InitScheme:
    """Standard deviations of the synthetic weights: `std` for matrices, times `embed_scale` for the
    token embeddings and times `out_scale` for attention output and MLP down projections."""

    std: float = 0.02
    embed_scale: float = 20.0
    out_scale: float = 0.02

    @classmethod
    def plain(cls) -> InitScheme:
        """transformers' own init: every matrix N(0, 0.02)."""
        return cls(embed_scale=1.0, out_scale=1.0)

    def std_for(self, role: str) -> float:
        """Standard deviation of a tensor of the given layout role."""
        if role == "embed":
            return self.std * self.embed_scale
        if role in ("out", "down"):
            return self.std * self.out_scale
        return self.std


def transformers_init(model: Any, param: str, seed: int) -> torch.Tensor:
    """The value transformers' `_init_weights` gives one small parameter or buffer (norm weights,
    zero-centred norms, A_log, dt_bias, conv kernels, sinks, routing biases), on CPU.

    Only the owning module's own tensors are materialised, on a copy, under a seed derived from
    the parameter name, so the result is reproducible and the meta model is left untouched.
    """
    owner_name, _, attr = param.rpartition(".")
    owner = copy.deepcopy(model.get_submodule(owner_name))
    owner.to_empty(device="cpu", recurse=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed ^ zlib.crc32(param.encode()))
        model._init_weights(owner)
    return getattr(owner, attr).detach()


def chunks_for(
    spec: TensorSpec,
    scheme: InitScheme,
    source: _noise.NoiseSource,
    model: Any,
    seed: int,
    at: int | None = None,
) -> Iterable[torch.Tensor]:
    """The bytes of one tensor, produced lazily in chunks of at most 64 MiB.

    `at` is the number of noise chunks that the tensors before this one drew (`first_chunks`):
    given, the tensor is produced out of order with the bytes it gets in sequence.
    """
    if spec.role == "zeros":
        return _noise.zeros(spec.nbytes)
    if spec.role == "init":
        value = transformers_init(model, spec.param or spec.name, seed)
        return _noise.tensor_bytes(value.to(TORCH_DTYPE[spec.dtype]))
    std = scheme.std_for(spec.role)
    if spec.mxfp4 == "blocks":
        return source.uniform_bytes(spec.nbytes, at)  # uniform random E2M1 codes
    if spec.mxfp4 == "scales":
        return mxfp4_scales(source, spec.nbytes, std, at)
    numel = spec.nbytes // TORCH_DTYPE[spec.dtype].itemsize
    return source.gaussian(numel, std, TORCH_DTYPE[spec.dtype], at)


def noise_chunks(spec: TensorSpec) -> int:
    """How many noise chunks `chunks_for` draws for `spec` (zeros and transformers-init tensors: none)."""
    if spec.role in ("zeros", "init"):
        return 0
    if spec.mxfp4:
        return _noise.byte_chunks(spec.nbytes)
    itemsize = TORCH_DTYPE[spec.dtype].itemsize
    return _noise.gaussian_chunks(spec.nbytes // itemsize, itemsize)


def first_chunks(specs: list[TensorSpec]) -> list[int]:
    """For each tensor, written in this order, the number of noise chunks drawn before it."""
    out, k = [], 0
    for spec in specs:
        out.append(k)
        k += noise_chunks(spec)
    return out


def mxfp4_scale_exponent(std: float) -> int:
    """Biased E8M0 exponent that gives uniform random FP4 codes (with jittered scales) RMS ~= std."""
    return 127 + round(math.log2(std / (FP4_RMS * _SCALE_JITTER_RMS)))


def mxfp4_scales(
    source: _noise.NoiseSource, nbytes: int, std: float, at: int | None = None
) -> Iterable[torch.Tensor]:
    """E8M0 scale bytes around `mxfp4_scale_exponent(std)`, each jittered by -1, 0 or +1."""
    base = mxfp4_scale_exponent(std) - 1
    for chunk in source.uniform_bytes(nbytes, at):
        yield torch.remainder(chunk, 3).add_(base)
