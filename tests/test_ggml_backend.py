"""ggml's backend API through moestream's binding, checked on the CPU backend (here, no GPU): a graph built
from host addresses computes on a device's buffers (`DeviceMemory`) with the very bits the in-place CPU
path gives; inputs are copied before each run and outputs after; what the backend cannot have is refused
in one sentence; and without a CUDA library or GPU, asking for ggml's CUDA backend says what is missing.
"""

from __future__ import annotations

import os

import pytest
import torch

from moestream import ggml
from moestream.ggml.backend import DeviceMemory, cpu_backend, cuda_backend
from moestream.ggml.lib import GgmlTensor
from moestream.ggml.net import F32, I32, Arena, Net

H, I, E, K, T = 64, 96, 6, 2, 5  # hidden, expert rows, experts, per token, tokens


def _experts(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 experts [E, I, H] stacked, and norm weights [H]."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.stack([ggml.quantize(torch.randn(I, H, generator=g), "Q8_0") for _ in range(E)])
    return blocks.contiguous(), torch.rand(H, generator=g) + 0.5


def _build(net: Net, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, norm: torch.Tensor, out) -> list:
    """rms_norm(x) * norm, then each token's K experts by mul_mat_id, into `out` [T, K, I]."""
    q8 = ggml.ggml_type("Q8_0").id
    xt = net.tensor(F32, [H, 1, T], x.data_ptr())
    h = net.mul(net.rms_norm(xt, 1e-6), net.weight(norm, [H]))
    idt = net.tensor(I32, [K, T], ids.data_ptr())
    wt = net.tensor(q8, [H, I, E], w.data_ptr())
    return [net.fix(net.mul_mat_id(wt, h, idt), out.data_ptr())]


def _compute(memory: DeviceMemory | None, x, ids, w, norm, runs: int = 1) -> list[torch.Tensor]:
    out = torch.full((T, K, I), float("nan"))
    kern = ggml.kernels(1)
    net = Net(ggml.library(), memory=memory)
    results = []
    try:
        net.finish(_build(net, x, ids, w, norm, out), 1, kern.pool)
        arena = Arena([net], memory)
        for r in range(runs):
            x.add_(0.5 if r else 0.0)  # a new input each run reaches the device (rms_norm ignores scale)
            with kern._lock:
                net.run()
            results.append(out.clone())
        arena.close()
    finally:
        net.close()
    return results


@pytest.fixture
def memory():
    backend = cpu_backend(2)
    mem = DeviceMemory(backend)
    yield mem
    mem.close()
    backend.close()


def test_a_graph_on_a_backend_gives_the_in_place_bits(memory):
    w, norm = _experts(0)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    x_dev = x.clone()
    memory.register(x_dev, "io", "x")
    memory.register(ids, "io", "ids")
    want = _compute(None, x.clone(), ids, w, norm, runs=3)
    # the output's host region is registered by the caller too: its bytes come back after each run
    out_dev = _compute_registered(memory, x_dev, ids, w, norm, runs=3)
    for a, b in zip(want, out_dev):
        assert torch.equal(a, b)
    assert not torch.equal(want[0], want[1])  # the runs differ: each one's input reached the device
    # the weights were copied once, to buffers of the backend, not read in place
    weights = [r for r in memory.regions.values() if r.role == "weight"]
    assert {r.host for r in weights} == {w.data_ptr(), norm.data_ptr()}
    assert all(r.device not in (w.data_ptr(), norm.data_ptr()) for r in weights)


def _compute_registered(memory, x, ids, w, norm, runs):
    out = torch.full((T, K, I), float("nan"))
    memory.register(out, "io", "out")
    kern = ggml.kernels(1)
    net = Net(ggml.library(), memory=memory)
    results = []
    try:
        net.finish(_build(net, x, ids, w, norm, out), 1, kern.pool)
        assert len(net._inputs) == 2 and len(net._outputs) == 1  # x, ids in; out back
        arena = Arena([net], memory)
        for r in range(runs):
            x.add_(0.5 if r else 0.0)
            out.fill_(float("nan"))
            net.run()
            results.append(out.clone())
        arena.close()
    finally:
        net.close()
    return results


def test_device_regions_and_expert_stacks_are_addressed_on_the_device(memory):
    """An expert stack made on the device alone (`alloc`, bytes written in) is addressed by its device
    address, with a per-expert stride of its own: the same products as the host stack."""
    w, norm = _experts(3)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    ids = torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    stack = memory.alloc(w.nbytes, "experts")
    for e in range(E):
        row = w[e]
        memory.write(stack, e * row.nbytes, row.data_ptr(), row.nbytes)
    out = torch.full((T, K, I), float("nan"))
    for t in (x, ids, out):
        memory.register(t, "io")
    q8 = ggml.ggml_type("Q8_0").id
    kern = ggml.kernels(1)
    net = Net(ggml.library(), memory=memory)
    try:
        xt = net.tensor(F32, [H, 1, T], x.data_ptr())
        h = net.mul(net.rms_norm(xt, 1e-6), net.weight(norm, [H]))
        wt = net.tensor(q8, [H, I, E], stack.device)
        assert GgmlTensor.from_address(wt).nb[2] == w[0].nbytes
        y = net.mul_mat_id(wt, h, net.tensor(I32, [K, T], ids.data_ptr()))
        net.finish([net.fix(y, out.data_ptr())], 1, kern.pool)
        arena = Arena([net], memory)
        net.run()
        arena.close()
    finally:
        net.close()
    (want,) = _compute(None, x.clone(), ids, w, norm)
    assert torch.equal(out, want)


def test_the_expert_cache_slots_are_never_taken_for_weights(memory):
    slots = torch.zeros(4096, dtype=torch.uint8)
    memory.forbid(slots.data_ptr(), slots.nbytes, "the expert cache's slots")
    kern = ggml.kernels(1)
    net = Net(ggml.library(), memory=memory)
    try:
        y = net.scale(net.tensor(F32, [16], slots.data_ptr() + 64), 2.0)
        out = torch.zeros(16)
        memory.register(out, "io")
        with pytest.raises(RuntimeError, match="reads the expert cache's slots on the host"):
            net.finish([net.fix(y, out.data_ptr())], 1, kern.pool)
    finally:
        net.close()
    del kern


def test_weights_copied_at_once_compute_after_their_host_pages_are_given_back(memory):
    """`upload_weights` copies weights before any graph reads them (a view inside one is found in its
    region): once their host pages are given back (they read as zeros), a graph computes the bits it
    computed over the host copy; a graph that reads a given-back range outside what was copied raises
    (lazily copied, it would have computed over zeros)."""
    from moestream.io.memory import drop_pages

    w, norm = _experts(6)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(7))
    ids = torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(8), dtype=torch.int32)
    (want,) = _compute(None, x.clone(), ids, w, norm)
    memory.register(x, "io", "x")
    memory.register(ids, "io", "ids")
    placed = memory.upload_weights([("w", w), ("norm", norm), ("w[1]", w[1])])
    assert placed == w.nbytes + norm.nbytes
    assert sorted(r.name for r in memory.regions.values() if r.role == "weight") == ["norm", "w"]
    given = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in (w, norm)]
    assert sum(drop_pages(start, end - start) for start, end in given) > 0
    memory.release_host(given, [])
    assert torch.count_nonzero(w) < w.numel()  # whole pages of it read as zeros now
    (got,) = _compute_registered(memory, x, ids, w, norm, runs=1)
    assert torch.equal(got, want)
    other = torch.rand(H, generator=torch.Generator().manual_seed(9)) + 0.5  # never copied
    memory.release_host([(other.data_ptr(), other.data_ptr() + other.nbytes)], [])
    net = Net(ggml.library(), memory=memory)
    try:
        y = net.mul(net.rms_norm(net.tensor(F32, [H, T], x.data_ptr()), 1e-6), net.weight(other, [H]))
        with pytest.raises(RuntimeError, match="given back at load, that were not copied to the device"):
            net.finish([y], 1, ggml.kernels(1).pool)
    finally:
        net.close()


def test_without_a_cuda_library_the_error_says_what_to_do():
    """This machine's ggml has no libggml-cuda (and there is no GPU): one sentence with the remedy."""
    with pytest.raises(ggml.GgmlUnavailableError) as err:
        cuda_backend()
    text = str(err.value)
    assert "CUDA" in text and "make native CUDA=1" in text and "\n" not in text


# --- the ggml runner on a backend: the same graphs, every expert in stacks on the device ------------

ARCHS_WITH_GRAPHS = [
    "qwen3_moe",
    "qwen2_moe",
    "olmoe",
    "mixtral",
    "glm4_moe",
    "deepseek_v2",
    "gpt_oss",
    "gpt_oss_mxfp4",
    "qwen3_next",
    "qwen3_5_moe",
]


def _logits(path, monkeypatch, backend: str, **load) -> tuple[torch.Tensor, str]:
    from test_ggml_runner import _runner_logits

    import moestream

    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", backend)
    if not backend:
        monkeypatch.delenv("MOESTREAM_GGML_BACKEND")
    with moestream.load(str(path), cache=load.pop("cache", "64MiB"), trunk="ggml", **load) as engine:
        return _runner_logits(engine), engine.mode_line()


@pytest.mark.parametrize("arch", ARCHS_WITH_GRAPHS)
def test_the_runner_on_a_backend_gives_the_in_place_bits(arch, tiny_dir, monkeypatch):
    """Every family's prefill and decode logits, the graphs computed by ggml's CPU backend over device
    copies (weights, the KV cache, the experts' stacks; the step's buffers copied around each compute),
    equal the CPU path's in place bit for bit: the same kernels over the same bytes."""
    path = tiny_dir(arch)
    want, _ = _logits(path, monkeypatch, "")
    got, mode = _logits(path, monkeypatch, "cpu")
    assert "on ggml's cpu backend" in mode
    assert torch.equal(got, want)


def _ops(engine) -> list[str]:
    """The op names of the decode step's one graph (the last one-token whole-step set built)."""
    runner = engine.runner
    net = [gs.whole[1] for (t, *_), gs in runner._sets.items() if t == 1 and gs.whole is not None][-1]
    b = net.lib.base
    nodes = (b.ggml_graph_node(net.gf, i) for i in range(b.ggml_graph_n_nodes(net.gf)))
    return [b.ggml_op_name(GgmlTensor.from_address(p).op).decode() for p in nodes]


@pytest.mark.parametrize("query", ["view", "reshape"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v2"])
def test_flash_attentions_query_uncopied_gives_the_same_bits(arch, query, tiny_dir, monkeypatch):
    """MOESTREAM_GGML_QUERY=view (the permuted query as the CPU path gives it) and =reshape (a one-token
    query as the contiguous tensor the copy makes, not copied): the in-place bits, and a decoded token's
    graph without the query's copies (one CONT a layer with the default copy)."""
    from test_ggml_runner import _runner_logits

    import moestream

    path = tiny_dir(arch)
    want, _ = _logits(path, monkeypatch, "")
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    conts = {}
    for mode in ("copy", query):
        monkeypatch.setattr("moestream.ggml.net._QUERY", mode)
        with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
            assert torch.equal(_runner_logits(engine), want)
            conts[mode] = _ops(engine).count("CONT")
    assert conts[query] < conts["copy"]


def test_a_query_mode_of_neither_is_refused_in_a_sentence(tiny_dir, monkeypatch):
    import moestream
    from moestream.ggml.lib import GgmlUnavailableError

    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    monkeypatch.setattr("moestream.ggml.net._QUERY", "permute")
    with pytest.raises(GgmlUnavailableError, match="MOESTREAM_GGML_QUERY='permute': say copy, view or"):
        moestream.load(str(tiny_dir("qwen3_moe")), cache="64MiB", trunk="ggml")


def test_chunks_spans_and_a_restream_on_a_backend(tiny_dir, monkeypatch):
    """Prefill chunks and attention spans across graph sets (built and dropped, their device copies with
    them), and a restream (new expert slots: the device's stacks made again): the in-place bits."""
    from test_ggml_runner import _runner_logits, _small_steps

    import moestream

    _small_steps(monkeypatch)
    path = tiny_dir("qwen3_moe")
    want, _ = _logits(path, monkeypatch, "")
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        assert torch.equal(_runner_logits(engine), want)
        memory = engine.runner.memory
        held = len(memory.regions)
        engine.restream(cache="32MiB", preload=True)
        assert torch.equal(_runner_logits(engine), want)
        assert len(memory.regions) == held  # the old stacks and sets freed, new ones in their place


def test_a_backend_without_room_for_every_expert_says_so(tiny_dir, monkeypatch):
    """The device computes a step as one graph over every expert: a cache that cannot hold them all is
    refused in one sentence naming the way out, and the CPU path runs the same model."""
    import moestream
    from moestream.cache.size_classes import budget_requirements

    path = tiny_dir("qwen3_moe")
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        minimum, _ = budget_requirements(engine.emap, engine.top_k)
    refused = pytest.raises(ggml.GgmlUnavailableError, match="give the expert cache room for all of them")
    with moestream.load(str(path), cache=minimum, trunk="ggml") as engine, refused:
        engine.generate([5, 6, 7], max_tokens=2)


def test_a_trace_on_a_backend_says_it_needs_the_host_routing(tiny_dir, monkeypatch, tmp_path):
    """A trace records each layer's routing on the host, which the device's one-graph step does not give:
    one sentence, and the same engine generates again once the trace is gone."""
    import moestream

    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="64MiB", trunk="ggml") as engine:
        want = engine.generate([5, 6, 7], max_tokens=4, ignore_eos=True).tokens
        engine.start_trace(tmp_path / "t.parquet")
        with pytest.raises(ggml.GgmlUnavailableError, match="need each layer's routing on the host"):
            engine.generate([5, 6, 7], max_tokens=4, ignore_eos=True)
        engine.stop_trace()
        assert engine.generate([5, 6, 7], max_tokens=4, ignore_eos=True).tokens == want


def test_cuda_graphs_are_on_unless_asked_off(monkeypatch):
    """ggml's CUDA graphs: on by default (linear attention too, since 12-07); off (ggml's own variable set
    before it first computes) with MOESTREAM_CUDA_GRAPHS=0; a variable set already is kept; a value
    other than 0 or 1 refused."""
    from moestream.ggml.backend import cuda_graphs

    monkeypatch.delenv("GGML_CUDA_DISABLE_GRAPHS", raising=False)
    monkeypatch.delenv("MOESTREAM_CUDA_GRAPHS", raising=False)
    assert cuda_graphs() == (True, "")
    assert "GGML_CUDA_DISABLE_GRAPHS" not in os.environ
    monkeypatch.setenv("MOESTREAM_CUDA_GRAPHS", "1")
    assert cuda_graphs() == (True, "")
    assert "GGML_CUDA_DISABLE_GRAPHS" not in os.environ
    monkeypatch.setenv("MOESTREAM_CUDA_GRAPHS", "0")
    assert cuda_graphs() == (False, "MOESTREAM_CUDA_GRAPHS=0")
    assert os.environ["GGML_CUDA_DISABLE_GRAPHS"] == "1"
    monkeypatch.setenv("MOESTREAM_CUDA_GRAPHS", "1")
    assert cuda_graphs() == (False, "GGML_CUDA_DISABLE_GRAPHS is set")
    monkeypatch.delenv("GGML_CUDA_DISABLE_GRAPHS")
    monkeypatch.setenv("MOESTREAM_CUDA_GRAPHS", "yes")
    with pytest.raises(ggml.GgmlUnavailableError, match="say 0 or 1"):
        cuda_graphs()


def test_copies_around_a_backend_graph_are_coalesced_per_region():
    """Overlapping or touching ranges of one region become one copy; a gap or another region keeps
    them apart (the gap's bytes are not the graph's to copy)."""
    from moestream.ggml.net import _coalesce

    a, b = object(), object()
    copies = [(a, 64, 64), (a, 0, 64), (a, 0, 64), (a, 96, 64), (a, 256, 16), (b, 0, 8)]
    merged = _coalesce(copies)
    assert sorted((id(r), o, n) for r, o, n in merged) == sorted(
        [(id(a), 0, 160), (id(a), 256, 16), (id(b), 0, 8)]
    )


@pytest.mark.parametrize("window", [None, 4, 100])
def test_a_steps_inputs_are_its_tokens_rows_and_masks(window):
    """`StepBuffers.set_inputs` writes the tokens, positions, KV-cache rows (slot's first row + position)
    and masks that torch's formulas give (causal: -inf past a token's position; sliding: also -inf
    `window` or more positions back): one token at the span's edges, a prefill chunk, a batch of
    sequences in their own slots."""
    from moestream.graphs.layers import StepBuffers

    span = 256

    def buffers(T: int) -> StepBuffers:
        b = StepBuffers.__new__(StepBuffers)
        b.tokens, b.positions = torch.zeros(T, dtype=torch.int32), torch.zeros(T, dtype=torch.int32)
        b.rows = torch.zeros(T, dtype=torch.int64)
        b.mask = torch.zeros(T, span, dtype=torch.float16)
        b.window = torch.zeros(T if window else 0, span, dtype=torch.float16)
        return b

    one = [([7], [p], [512]) for p in (0, 1, 3, 4, 5, 99, 100, 101, 254, 255)]
    chunk = [(list(range(10, 30)), list(range(90, 110)), [0] * 20)]
    batch = [([3, 4, 5], [0, 100, 255], [1024, 0, 512])]
    # the same buffers step after step (only the columns that change are written): decoding on, a new
    # request from 0, jumps back and forth, a batch's rows each moving its own way
    again = {1: buffers(1), 3: buffers(3)}
    walk = [([7], [p], [0]) for p in (0, 1, 2, 3, 50, 51, 4, 5, 0, 255, 254, 120, 121)]
    rows = [([3, 4, 5], p, [1024, 0, 512]) for p in ([0, 100, 255], [1, 101, 0], [200, 2, 1], [5, 5, 5])]
    cases = [(case, None) for case in one + chunk + batch]
    cases += [(case, again[len(case[0])]) for case in walk + rows]
    for (ids, positions, firsts), reused in cases:
        b = reused or buffers(len(ids))
        b.set_inputs(ids, positions, firsts, window)
        pos = torch.tensor(positions)
        later = torch.arange(span)[None, :] > pos[:, None]
        mask = torch.zeros(len(ids), span, dtype=torch.float16).masked_fill_(later, float("-inf"))
        assert torch.equal(b.tokens, torch.tensor(ids, dtype=torch.int32))
        assert torch.equal(b.positions, pos.to(torch.int32))
        assert torch.equal(b.rows, torch.tensor(firsts) + pos)
        assert torch.equal(b.mask, mask), positions
        if window:
            far = torch.arange(span)[None, :] <= pos[:, None] - window
            assert torch.equal(b.window, mask.clone().masked_fill_(far, float("-inf"))), positions


def test_a_registry_device_type_as_ggml_gives_it():
    """ggml's registry says what each of its devices is (the CPU backend's one device: "cpu"); a device
    it does not have is None; without a CUDA library or GPU, ggml's CUDA backend types no device."""
    from moestream.ggml.backend import cuda_device_type, cuda_unavailable, device_type
    from moestream.ggml.lib import library

    reg = library().cpu.ggml_backend_cpu_reg()
    assert device_type(reg, 0) == "cpu"
    assert device_type(reg, 1) is None
    if cuda_unavailable(0) is not None:
        assert cuda_device_type(0) is None
    else:  # a GPU machine: a discrete GPU or an integrated one (Jetson)
        assert cuda_device_type(0) in ("gpu", "igpu")
