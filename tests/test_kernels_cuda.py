"""GGUF block kernels on a real GPU at real shapes (skipped without one): Qwen3-30B-A3B experts
(gate/up 768 x 2048, down 2048 x 768) and gpt-oss (2880 x 2880), decode and prefill row counts, a layer
of experts in one grouped launch over a GPU slot buffer, weights read in place from pinned host memory,
and repeatability (streamed == resident needs the same bits from the same bytes). Tolerances: as in
tests/test_kernels.py (the small shapes, which also run on the GPU when there is one)."""

from __future__ import annotations

from functools import cache

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
pytest.importorskip("triton")
pytest.importorskip("gguf")

from gguf_blocks import check_product, random_blocks, reference  # noqa: E402

from moestream import kernels  # noqa: E402
from moestream.kernels import TYPES  # noqa: E402

# (N, K) per type, as the real files hold them: K-quants need K % 256 == 0, so gpt-oss's 2880 goes to
# the 32-weight types (its GGUFs use Q5_0 / Q8_0 / MXFP4)
SHAPES = {name: (768, 2048) for name in TYPES}
SHAPES |= {"Q6_K": (2048, 768), "Q5_K": (2048, 768), "Q8_0": (2880, 2880), "Q5_0": (2880, 2880)}
SHAPES["MXFP4"] = (2880, 2880)


@cache
def _weight(name: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = SHAPES[name]
    blocks = random_blocks(name, n, k, seed)
    return torch.from_numpy(blocks).reshape(-1).cuda(), torch.from_numpy(reference(name, blocks)).cuda()


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantize_real_shapes(name):
    w, ref = _weight(name)
    n, k = SHAPES[name]
    got = kernels.dequantize(w, name, n, k, torch.float32)
    torch.testing.assert_close(got, ref, rtol=0, atol=2**-20 * ref.abs().max().item())


@pytest.mark.parametrize("m", [1, 4, 16, 64, 256])
@pytest.mark.parametrize("name", list(TYPES))
def test_matmul_real_shapes(name, m):
    w, ref_w = _weight(name)
    n, k = SHAPES[name]
    x = _x(m, k)
    y = kernels.matmul(x, w, name, n)
    check_product(y, x, ref_w, dot=kernels.default_config(m, n, k, x.dtype).dot)
    dense = kernels.linear(x, w, name, n, route="dequant")
    check_product(dense, x, ref_w, dot=True)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "MXFP4", "Q8_0"])
def test_repeated_calls_give_the_same_bits(name):
    w, _ = _weight(name)
    n, k = SHAPES[name]
    for m in (1, 8, 64):
        x = _x(m, k)
        first = kernels.matmul(x, w, name, n)
        assert all(torch.equal(kernels.matmul(x, w, name, n), first) for _ in range(3))


@pytest.mark.parametrize("name", ["Q4_K", "MXFP4"])
def test_pinned_host_weights_are_read_in_place(name):
    w, _ = _weight(name)
    n, k = SHAPES[name]
    host = w.cpu().pin_memory()
    x = _x(3, k)
    assert torch.equal(kernels.matmul(x, host, name, n), kernels.matmul(x, w, name, n))
    on_gpu = kernels.dequantize(host, name, n, k, device="cuda")
    assert on_gpu.is_cuda and torch.equal(on_gpu, kernels.dequantize(w, name, n, k))
    with pytest.raises(ValueError, match="not pinned"):
        kernels.matmul(x, w.cpu(), name, n)


@pytest.mark.parametrize("tokens", [1, 64])
def test_a_layer_of_experts_in_one_grouped_launch(tokens):
    """8 experts' fused gate+up (Q4_K, [1536, 2048]) in slots of one GPU buffer (256-byte-aligned
    slots, as GpuSlotTier lays them out), top-8 routing of `tokens` tokens: one launch equals one
    matmul per expert, bit for bit, and gguf's product."""
    n, k, experts, top_k = 1536, 2048, 8, 8
    mats = [random_blocks("Q4_K", n, k, seed) for seed in range(experts)]
    nbytes = mats[0].size
    slot_bytes = (nbytes + 255) // 256 * 256 + 256
    buf = torch.zeros(experts * slot_bytes + 4096, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(experts, generator=torch.Generator().manual_seed(0)).tolist()
    for e, mat in enumerate(mats):
        start = slots[e] * slot_bytes + 32
        buf[start : start + nbytes] = torch.from_numpy(mat).reshape(-1).cuda()
    g = torch.Generator().manual_seed(3)
    picks = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])  # [T, top_k]
    order = torch.argsort(picks.reshape(-1), stable=True)  # token-expert pairs sorted by expert
    counts = torch.bincount(picks.reshape(-1), minlength=experts)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    rows = order // top_k  # the token of each sorted pair
    x = _x(tokens, k)
    offsets = torch.tensor([slots[e] * slot_bytes + 32 for e in range(experts)], dtype=torch.int64)
    got = kernels.grouped_matmul(
        x, buf, "Q4_K", n, offsets.cuda(), starts.cuda(), rows=rows.cuda(), max_rows=int(counts.max())
    )
    cfg = kernels.default_config(int(counts.max()), n, k, x.dtype)
    for e in range(experts):
        seg = slice(int(starts[e]), int(starts[e + 1]))
        w_e = buf[int(offsets[e]) : int(offsets[e]) + nbytes]
        want = kernels.matmul(x[rows[seg].cuda()], w_e, "Q4_K", n, config=cfg)
        assert torch.equal(got[seg], want), e
        ref_w = torch.from_numpy(reference("Q4_K", mats[e])).cuda()
        check_product(got[seg], x[rows[seg].cuda()], ref_w, dot=cfg.dot)
