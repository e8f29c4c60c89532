"""GGUF block kernels (moestream.kernels) against gguf's own dequantization of the same bytes.

Runs on a CUDA GPU when there is one, else on the CPU in Triton's interpreter (TRITON_INTERPRET=1,
small shapes: seconds). Skipped when triton or gguf is not installed.

Tolerances, against ref = x @ W^T in fp64 with W = gguf.quants.dequantize (fp32) and x as given (bf16):
  * dequantize to fp32: exact in the interpreter; on a GPU 2^-20 of the largest weight, for fused
    multiply-adds (d * q + m rounded once);
  * matmul, FMA tiles (M <= 8): the one bf16 rounding of the output (2^-8 relative) plus fp32
    accumulation (K * 2^-23 of S = |x| @ |W|^T), elementwise;
  * matmul, tensor-core tiles: W rounded to bf16 as well (2^-8 of S), elementwise; and, as the
    elementwise bound is loose there, a relative Frobenius error below 4e-3 (measured 1.7-2.5e-3;
    a wrong scale in one block of eight gives ~0.3).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("gguf")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and TRITON_INTERPRET is not 1 (conftest sets it)", allow_module_level=True)

from gguf_blocks import check_product, ggml_blocks, random_blocks, reference  # noqa: E402

from moestream import kernels  # noqa: E402
from moestream.kernels import TYPES, KernelConfig, UnsupportedTypeError  # noqa: E402

ALL = list(TYPES)


def _shape(name: str) -> tuple[int, int]:
    """Rows not a multiple of any tile; K of several blocks, and for 32-weight blocks not a multiple of
    the tile's K either."""
    return 20, (512 if TYPES[name].block == 256 else 352)


def _weight(name: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    n, k = _shape(name)
    blocks = random_blocks(name, n, k, seed)
    w = torch.from_numpy(blocks).reshape(-1).to(DEVICE)
    return w, torch.from_numpy(reference(name, blocks)).to(DEVICE), n, k


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)


def test_types_match_gguf():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for name, bt in TYPES.items():
        assert GGMLQuantizationType[name].value == bt.id
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name]] == (bt.block, bt.block_bytes)
        assert kernels.block_type(GGMLQuantizationType[name]) is bt


@pytest.mark.parametrize("name", ALL)
def test_dequantize_equals_gguf(name):
    w, ref, n, k = _weight(name)
    got = kernels.dequantize(w, name, n, k, torch.float32)
    atol = 0.0 if DEVICE == "cpu" else 2**-20 * ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=0, atol=atol)
    bf16 = kernels.dequantize(w, name, n, k)  # round to nearest even, as torch's cast
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(
        bf16.float(), ref.to(torch.bfloat16).float(), rtol=2**-7 if DEVICE != "cpu" else 0, atol=0
    )


@pytest.mark.parametrize("m", [1, 5, 24])
@pytest.mark.parametrize("name", ALL)
def test_matmul_equals_gguf_product(name, m):
    w, ref_w, n, k = _weight(name)
    x = _x(m, k)
    y = kernels.matmul(x, w, name, n)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    check_product(y, x, ref_w, dot=kernels.default_config(m, n, k, x.dtype).dot)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "Q6_K", "MXFP4"])
def test_weight_view_inside_a_larger_buffer(name):
    """A matrix read in place at a 32-byte (or any) offset inside a slot buffer gives the same bits."""
    w, _, n, k = _weight(name)
    x = _x(3, k)
    alone = kernels.matmul(x, w, name, n)
    buf = torch.zeros(w.numel() + 4096, dtype=torch.uint8, device=DEVICE)
    for offset in (32, 96 + 4096 // 2, 17):
        buf[offset : offset + w.numel()] = w
        view = buf[offset : offset + w.numel()]
        assert torch.equal(kernels.matmul(x, view, name, n), alone), offset
        assert torch.equal(kernels.dequantize(view, name, n, k), kernels.dequantize(w, name, n, k))


@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "MXFP4"])
def test_grouped_matmul_equals_one_matmul_per_expert(name, dot):
    """Three experts in one buffer at 32-byte-aligned offsets, one of them routed no rows, rows
    gathered from x: each segment equals its own matmul bit for bit (same tile config)."""
    n, k = _shape(name)
    mats = [_weight(name, seed)[0] for seed in (3, 4, 5)]
    offsets, buf_parts, cursor = [], [], 64
    buf = torch.zeros(64 + 3 * (mats[0].numel() + 96), dtype=torch.uint8, device=DEVICE)
    for mat in mats:
        offsets.append(cursor)
        buf[cursor : cursor + mat.numel()] = mat
        cursor += mat.numel() + 32 * (1 + len(buf_parts))
        buf_parts.append(mat)
    starts = [0, 2, 2, 5] if not dot else [0, 17, 17, 20]
    x = _x(starts[-1] + 3, k, seed=7)
    rows = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(2))[: starts[-1]]
    cfg = KernelConfig(16, 16, 64, dot=True) if dot else KernelConfig(4, 8, 64, dot=False)
    got = kernels.grouped_matmul(
        x,
        buf,
        name,
        n,
        torch.tensor(offsets, dtype=torch.int64, device=DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        rows=rows.to(DEVICE),
        max_rows=max(b - a for a, b in itertools.pairwise(starts)),
        config=cfg,
    )
    assert got.shape == (starts[-1], n)
    for e, mat in enumerate(mats):
        seg = slice(starts[e], starts[e + 1])
        want = kernels.matmul(x[rows[seg].to(DEVICE)], mat, name, n, config=cfg)
        assert torch.equal(got[seg], want), e


def test_grouped_matmul_without_rows_reads_x_in_order():
    w, ref_w, n, k = _weight("Q4_K")
    x = _x(4, k)
    offsets = torch.zeros(2, dtype=torch.int64, device=DEVICE)  # the same expert twice
    starts = torch.tensor([0, 1, 4], dtype=torch.int64, device=DEVICE)
    got = kernels.grouped_matmul(x, w, "Q4_K", n, offsets, starts, max_rows=3)
    check_product(got, x, ref_w, dot=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_activation_dtypes(dtype):
    w, ref_w, n, k = _weight("Q5_K")
    x = _x(24, k).to(dtype)
    y = kernels.matmul(x, w, "Q5_K", n)
    assert y.dtype == dtype
    ref = x.double() @ ref_w.double().T
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < (1e-6 if dtype == torch.float32 else 2e-3), rel  # fp32: FMA tiles, fp32 output


def test_linear_takes_the_route_it_is_given():
    w, _, n, k = _weight("Q6_K")
    x = _x(3, k)
    assert torch.equal(kernels.linear(x, w, "Q6_K", n, route="direct"), kernels.matmul(x, w, "Q6_K", n))
    scratch = torch.empty(n, k, dtype=torch.bfloat16, device=DEVICE)
    dense = x @ kernels.dequantize(w, "Q6_K", n, k).T
    assert torch.equal(kernels.linear(x, w, "Q6_K", n, scratch=scratch, route="dequant"), dense)


def test_bad_arguments_are_refused_with_one_sentence():
    w, _, n, k = _weight("Q4_K")
    x = _x(2, k)
    with pytest.raises(UnsupportedTypeError, match="do not read TQ1_0 blocks"):
        kernels.matmul(x, w, "TQ1_0", n)
    with pytest.raises(UnsupportedTypeError, match="K=500 is not a multiple"):
        kernels.matmul(_x(2, 500), w, "Q4_K", n)
    with pytest.raises(ValueError, match="fewer than the"):
        kernels.matmul(x, w[:-1], "Q4_K", n)
    with pytest.raises(ValueError, match="contiguous uint8"):
        kernels.matmul(x, w.view(torch.int8), "Q4_K", n)
    with pytest.raises(ValueError, match="2-D bf16/fp16/fp32"):
        kernels.matmul(x.to(torch.int32), w, "Q4_K", n)
    with pytest.raises(ValueError, match="power of two"):
        KernelConfig(3, 16, 64, dot=False)
    starts = torch.tensor([0, 2], device=DEVICE)
    with pytest.raises(ValueError, match="offsets must be a 1-D int64"):
        kernels.grouped_matmul(x, w, "Q4_K", n, torch.zeros(1, dtype=torch.int32, device=DEVICE), starts)
    with pytest.raises(ValueError, match="one more element than offsets"):
        kernels.grouped_matmul(x, w, "Q4_K", n, torch.zeros(2, dtype=torch.int64, device=DEVICE), starts)


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_blocks_quantized_by_ggml(name):
    """Blocks as llama-quantize writes them (ggml's quantizer), besides the random ones above."""
    n, k = _shape(name)
    blocks = ggml_blocks(name, n, k)
    if blocks is None:
        pytest.skip("moestream.ggml (libggml) is not usable here")
    w = torch.from_numpy(blocks).reshape(-1).to(DEVICE)
    ref_w = torch.from_numpy(reference(name, blocks)).to(DEVICE)
    atol = 0.0 if DEVICE == "cpu" else 2**-20 * ref_w.abs().max().item()
    torch.testing.assert_close(kernels.dequantize(w, name, n, k, torch.float32), ref_w, rtol=0, atol=atol)
    for m in (1, 24):
        x = _x(m, k)
        check_product(kernels.matmul(x, w, name, n), x, ref_w, dot=m > 8)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_dequantize_selected_rows(name):
    """An embedding lookup: the rows `ids` names, in that order, repeats allowed."""
    w, ref, n, k = _weight(name)
    ids = torch.tensor([3, 0, 19, 3, 7], dtype=torch.int64, device=DEVICE)
    got = kernels.dequantize(w, name, n, k, torch.float32, ids=ids)
    atol = 0.0 if DEVICE == "cpu" else 2**-20 * ref.abs().max().item()
    torch.testing.assert_close(got, ref[ids], rtol=0, atol=atol)
    assert kernels.dequantize(w, name, n, k, ids=ids[:0]).shape == (0, k)
