"""MOESTREAM_GGML_REPACK=1 (experimental; `ggml/repack.py`, `engine/repacked.py`): the CPU path's steps of
up to REPACK_ROWS tokens compute the experts from a copy in ggml's repacked layout (ggml's CPU_REPACK
buffer type, llama.cpp's default), made once every expert is in its slot.

The oracles: ggml's own products over the blocks as stored (the slots), and the blocks dequantized by
the gguf package. The copy is checked expert by expert and kind by kind: its product through the
repacked kernels equals the slot's through the stored ones within 1e-5 of its magnitude (the same q8_K
activations, each product summed in another order). Through a model, another rounding can flip a
near-tied router to another expert at a position (as tests/test_gguf_cuda.py states for its kernels):
the logits stay within 2e-2 of the stored run's. A step longer than REPACK_ROWS (a long prompt's chunk)
computes from the slots: the stored run's bits exactly.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tiny_gguf import perturb_vectors, write_gguf
from tiny_models import write_tiny

import moestream
from moestream import ggml
from moestream.engine.repacked import REPACK_ROWS
from moestream.ggml.graphs import kernels
from moestream.ggml.lib import GgmlTensor
from moestream.ggml.net import F32, I32, Arena, Net
from moestream.ggml.repack import REPACK_ENV, Repacker

STEPS = [9, 150, 77, 31, 200, 6]


def _q4_k_m(layer: int, kind: str) -> Q:
    return Q.Q6_K if kind == "down" and layer == 0 else Q.Q4_K


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    """A tiny qwen3_moe as a Q4_K_M-like GGUF (Q4_K experts, layer 0's down Q6_K: no repacked kernels), of
    12 layers: more matrices than one small ggml context holds."""
    root = tmp_path_factory.mktemp("repack")
    hf = write_tiny(
        "qwen3_moe", root / "hf", hidden_size=512, moe_intermediate_size=512, num_hidden_layers=12
    )
    perturb_vectors(hf)
    return hf, write_gguf(hf, root / "model.gguf", ftype=Q.Q8_0, expert_type=_q4_k_m)


def _run(path, monkeypatch, repack: bool, prompt: list[int]):
    """The prompt's logits, then one step per STEPS token: [1 + len(STEPS), V]; the kinds repacked."""
    monkeypatch.setenv(REPACK_ENV, "1" if repack else "0")
    with moestream.load(str(path), cache="256MiB", threads=2) as engine:
        step = engine.runner
        logits, kv = step(prompt, None)
        out = [logits.clone()]
        for token in STEPS:
            logits, kv = step([token], kv)
            out.append(logits.clone())
        copy = engine.runner._repacked
        return torch.stack(out), (set(copy.kinds) if copy is not None else set()), engine.mode_line()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_short_steps_compute_the_repacked_copy_within_rounding(q4km, monkeypatch):
    _, path = q4km
    prompt = [5, 17, 33, 2, 99, 41, 7, 250, 3, 12, 80, 64]  # one chunk of 12 <= REPACK_ROWS tokens
    stored, kinds, _ = _run(path, monkeypatch, False, prompt)
    repacked, kinds, line = _run(path, monkeypatch, True, prompt)
    assert kinds == {"gate", "up", "down"}  # the Q4_K downs; layer 0's Q6_K down stays on the slots
    assert f"{REPACK_ENV}=1" in line
    assert _relative(repacked, stored) < 2e-2


def test_the_copy_holds_each_expert_in_the_repacked_layout(q4km, monkeypatch):
    """Each expert's matrix of each kind: through the copy and the repacked kernels as through its slot
    and the stored kernels (one expert at a time, then several tokens of several experts)."""
    _, path = q4km
    monkeypatch.setenv(REPACK_ENV, "1")
    gen = torch.Generator().manual_seed(0)
    with moestream.load(str(path), cache="256MiB", threads=2) as engine:
        _, kv = engine.runner([5, 17, 33], None)
        engine.runner([9], kv)  # a decoded token: the copy made
        runner = engine.runner
        first, stored = runner.experts.resident_slots(), runner.experts.graph_types()
        copies, E, H = runner._repacked.types, runner.experts.num_experts, runner.spec.hidden
        marked = 0
        for layer, t in stored.items():
            c = copies[layer]
            for kind in ("gate", "up", "down"):
                type_id = getattr(t, kind)
                shape = [H, t.inter, E] if kind != "down" else [t.inter, H, E]
                mark = (c.arena.repacked or {}).get(kind)
                marked += mark is not None
                for ids in [[[e]] for e in range(E)] + [[[0, E - 1], [E // 2, 1], [2, 3]]]:
                    ids = torch.tensor(ids, dtype=torch.int32)
                    x = torch.randn(ids.shape[0], shape[0], generator=gen)
                    slots = t.arena.address[kind] + first[layer] * t.arena.stride(kind)
                    copy = c.arena.address[kind] + first[layer] * c.arena.stride(kind)
                    want = _products(None, type_id, shape, x, ids, None, slots, None, t.arena.stride(kind))
                    got = _products(None, type_id, shape, x, ids, None, copy, mark, c.arena.stride(kind))
                    assert want.isfinite().all() and _relative(got, want) < 1e-5, (layer, kind, ids.tolist())
        assert marked == 3 * len(stored) - 1  # every gate and up, every down but layer 0's (Q6_K)


@pytest.fixture(scope="module")
def q4_0_trunk(q4km, tmp_path_factory):
    """The same model with its trunk's matrices in Q4_0 (q4km's are Q8_0, which has no repacked kernels
    on x86; Q4_K's 256-wide blocks do not fit the tiny model's 128 attention columns)."""
    hf, _ = q4km
    root = tmp_path_factory.mktemp("repack_trunk")
    return write_gguf(hf, root / "model.gguf", ftype=Q.Q4_0, expert_type=_q4_k_m)


def test_the_trunks_repacked_copy_holds_each_matrix_and_short_steps_read_it(q4km, q4_0_trunk, monkeypatch):
    """The trunk's Q4_0 matrices are copied once into the repacked layout (a Q8_0 trunk's: none); each
    copy's product through the repacked kernels equals the matrix's through the stored ones within 1e-5
    of its magnitude; short steps read the copies (their logits within rounding of the stored run's),
    a longer chunk the matrices as stored (bit for bit)."""
    from moestream.engine.repacked import RepackedTrunk, trunk_matrices

    _, q8_trunk = q4km
    monkeypatch.setenv(REPACK_ENV, "1")
    with moestream.load(str(q8_trunk), cache="256MiB", threads=2) as engine:
        copy = RepackedTrunk(trunk_matrices(engine.runner.spec))
        assert copy.map == {}  # Q8_0 and float matrices: nothing repacked, nothing allocated
        copy.close()
    gen = torch.Generator().manual_seed(0)
    with moestream.load(str(q4_0_trunk), cache="256MiB", threads=2) as engine:
        runner = engine.runner
        _, kv = runner([5, 17, 33], None)
        runner([9], kv)  # a decoded token: the copies made
        trunk = runner._trunk_copy
        q4_0 = [m for m in trunk_matrices(runner.spec) if m.type_id == int(Q.Q4_0)]
        assert q4_0 and {m.address for m in q4_0} == set(trunk.map)
        for m in q4_0:
            address, buffer, kernels = trunk.map[m.address]
            x = torch.randn(3, m.cols, generator=gen)
            ids = torch.zeros(3, 1, dtype=torch.int32)
            shape = [m.cols, m.rows, 1]
            want = _products(None, m.type_id, shape, x, ids, None, m.address, None, 0)
            got = _products(None, m.type_id, shape, x, ids, None, address, (buffer, kernels), 0)
            assert want.isfinite().all() and _relative(got, want) < 1e-5
    short = [5, 17, 33, 2, 99, 41, 7, 250, 3, 12, 80, 64]
    long = [(7 * i + 3) % 250 + 3 for i in range(REPACK_ROWS + 16)]
    # the experts from their slots, as stored: what differs is the trunk's
    from moestream.engine.ggml_runner import GgmlRunner

    monkeypatch.setattr(GgmlRunner, "_host_types", lambda self, tokens: self.experts.graph_types())
    for prompt in (short, long):
        stored, _, _ = _run(q4_0_trunk, monkeypatch, False, prompt)
        repacked, _, _ = _run(q4_0_trunk, monkeypatch, True, prompt)
        if prompt is long:
            assert torch.equal(repacked[0], stored[0])  # the chunk: the matrices as stored
        else:  # read from the copies (these steps' sums round otherwise: ~1e-7 here)
            assert not torch.equal(repacked[0], stored[0])
        assert _relative(repacked, stored) < 2e-2


def test_the_memory_plan_keeps_what_the_copies_take(q4_0_trunk, monkeypatch):
    """With the switch, an auto budget keeps room for the copies: the bytes `copy_bytes` plans (from the
    expert map and the spec, before any copy exists) are those the copies then take."""
    from moestream.engine import auto_budget
    from moestream.engine.repacked import copy_bytes

    kept = []
    parts = auto_budget._runner_parts
    monkeypatch.setattr(auto_budget, "_runner_parts", lambda *a: kept.extend(parts(*a)) or kept)
    monkeypatch.setenv(REPACK_ENV, "1")
    with moestream.load(str(q4_0_trunk), threads=2) as engine:  # cache auto
        runner = engine.runner
        _, kv = runner([5, 17, 33], None)
        runner([9], kv)  # a decoded token: both copies made
        made = runner._repacked.nbytes + runner._trunk_copy.nbytes
        planned = copy_bytes(runner.experts._runtime.emap, runner.spec)
        assert made > 0 and planned == made
        assert ("the repacked copies (MOESTREAM_GGML_REPACK=1)", made) in kept
    monkeypatch.setenv(REPACK_ENV, "0")
    kept.clear()
    moestream.load(str(q4_0_trunk), threads=2).close()
    assert kept and not any("repacked" in name for name, _ in kept)


def test_a_chunk_longer_than_the_repacked_rows_computes_the_slots(q4km, monkeypatch):
    _, path = q4km
    prompt = [(7 * i + 3) % 250 + 3 for i in range(REPACK_ROWS + 16)]
    stored, _, _ = _run(path, monkeypatch, False, prompt)
    repacked, kinds, _ = _run(path, monkeypatch, True, prompt)
    assert torch.equal(repacked[0], stored[0])  # the prompt's one chunk: the slots' blocks, bit for bit
    assert kinds and _relative(repacked[1:], stored[1:]) < 1e-3  # the decoded tokens: the copy


def test_the_switch_is_refused_where_it_cannot_hold(q4km, monkeypatch):
    _, path = q4km
    monkeypatch.setenv(REPACK_ENV, "1")
    with pytest.raises(Exception, match="MOESTREAM_GGML_REPACK=1 copies every expert once all are cached"):
        moestream.load(str(path), cache="1MiB", threads=2)  # experts streamed: no copy could stay right
    monkeypatch.setenv(REPACK_ENV, "yes")
    with pytest.raises(Exception, match="MOESTREAM_GGML_REPACK='yes': say 1"):
        moestream.load(str(path), cache="256MiB", threads=2)


def _products(raw, type_id, shape, x, ids, repacker, address=None, mark=None, stride=0):
    """ggml_mul_mat_id over `shape` [K, N, E] weights, x [T, K], ids [T, k]: [T, k, N]. The weights: `raw`
    (blocks as stored), or written by `repacker` into its buffer (its repacked kernels), or at `address`
    (experts `stride` bytes apart, as a cache's slots; its kernels `mark`, where given)."""
    lib = ggml.library()
    kern = kernels(2)
    T_, k = ids.shape
    out = torch.zeros(T_, k, shape[1])
    net = Net(lib, nodes=16)
    try:
        if address is not None:
            w = net.tensor(type_id, shape, address)
            GgmlTensor.from_address(w).nb[2] = stride
        elif repacker is None:
            w = net.tensor(type_id, shape, raw.data_ptr())
        else:
            handle, base = repacker.alloc(raw.numel())
            extra = repacker.repack(net.tensor(type_id, shape), handle, base, raw.data_ptr())
            assert extra
            w, mark = net.tensor(type_id, shape, base), (handle, extra)
        if mark is not None:
            Repacker.mark(w, *mark)
        xt = net.tensor(F32, [shape[0], 1, T_], x.data_ptr())
        y = net.mul_mat_id(w, xt, net.tensor(I32, [k, T_], ids.data_ptr()))
        net.finish([net.fix(y, out.data_ptr())], 2, kern.pool)
        arena = Arena([net])
        with kern._lock:
            net.run()
            kern.idle()
        arena.close()
    finally:
        net.close()
    return out


@pytest.mark.parametrize("name", ["Q4_K", "Q4_0", "Q2_K", "IQ4_NL", "MXFP4"])
def test_the_repacker_writes_ggmls_layout_for_types_that_have_kernels(name):
    """The types with repacked kernels on x86 (AVX2 and up): products through the repacked copy as through
    the blocks as stored, and as through the blocks dequantized by the gguf package."""
    gen = torch.Generator().manual_seed(0)
    E, K, N = 8, 512, 64
    w = torch.randn(E * N, K, generator=gen)
    raw = ggml.quantize(w, name)
    type_id = int(getattr(Q, name))
    repacker = Repacker(ggml.library())
    net = Net(ggml.library(), nodes=4)
    try:
        handle, base = repacker.alloc(raw.numel())
        if not repacker.repack(net.tensor(type_id, [K, N * E]), handle, base, raw.data_ptr()):
            pytest.skip(f"this ggml build has no repacked kernels for {name} on this CPU")
        weights = torch.from_numpy(
            gguf.quants.dequantize(raw.numpy().reshape(E * N, -1), getattr(Q, name)).copy()
        )
        for T_ in (1, 4, 20):
            x = torch.randn(T_, K, generator=gen)
            ids = torch.stack([torch.randperm(E, generator=gen)[:3] for _ in range(T_)]).to(torch.int32)
            stored = _products(raw, type_id, [K, N, E], x, ids, None)
            repacked = _products(raw, type_id, [K, N, E], x, ids, repacker)
            assert _relative(repacked, stored) < 1e-5
            # the dequantized blocks: up to the activations' rounding (q8_K, q8_0)
            want = torch.stack(
                [torch.stack([weights.view(E, N, K)[e] @ x[t] for e in ids[t]]) for t in range(T_)]
            )
            assert _relative(repacked, want) < 2e-2
    finally:
        net.close()
        repacker.close()


def test_a_type_without_repacked_kernels_is_left_as_stored():
    """Q6_K (a Q4_K_M's downs) has no repacked kernels: nothing written, none returned."""
    w = torch.randn(512, 512, generator=torch.Generator().manual_seed(1))
    q6 = ggml.quantize(w, "Q6_K")
    repacker = Repacker(ggml.library())
    net = Net(ggml.library(), nodes=4)
    try:
        handle, base = repacker.alloc(q6.numel())
        assert repacker.repack(net.tensor(int(Q.Q6_K), [512, 512]), handle, base, q6.data_ptr()) == 0
    finally:
        net.close()
        repacker.close()


def test_the_switch_is_refused_on_a_backend(q4km, monkeypatch):
    """ggml's CPU backend through the device path (as ggml's CUDA backend runs the graphs): the copy is the
    CPU path's, so the switch is refused there in one sentence, a GPU tier's too (its misses computed by
    the CPU from a copy measured slower on the H100 than from the slots: BENCHMARKS, 12-06 late)."""
    _, path = q4km
    monkeypatch.setenv(REPACK_ENV, "1")
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    words = r"repacks the experts for ggml's CPU path, not a backend's"
    with pytest.raises(Exception, match=words):
        moestream.load(str(path), cache="256MiB", threads=2)
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", "host")
    with pytest.raises(Exception, match=words):
        moestream.load(str(path), cache="256MiB", threads=2, gpu_tier="20MiB")
