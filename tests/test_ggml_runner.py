"""The ggml runner (`--trunk ggml`, auto on the CPU): each decoder layer a ggml graph built by moestream.

Oracles: stock transformers in fp32, its logits at every step (prefill and decode) within 4% of the
largest logit, and its greedy tokens exactly. Not closer: the graphs keep keys and values in F16 and
accumulate attention's values in F16 (llama.cpp's CPU flash attention), measured 0.2-2.1% here
(0.0005% with an F32 cache, which ggml's CPU flash attention gets wrong on the trained fixture).
Within the ggml path, streamed == resident bit for bit at every budget and io mode.

gpt_oss: attention sinks, a sliding window on alternate layers, YaRN, a router with a bias and a softmax
over the chosen k; its experts go into the graphs (ggml_add_id, ggml_swiglu_oai), the runtime computing
a streamed one with the same ops: GGUF's as stored, safetensors' [in, out] floats transposed once read
and its MXFP4 safetensors experts repacked as ggml's blocks (test_mxfp4_graphs.py: 8-bit activations,
so their greedy tokens follow stock only up to a near tie of a router).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers as T
from gguf import GGMLQuantizationType as Q

import moestream
from moestream.cache.size_classes import budget_requirements
from moestream.cli import main
from moestream.engine import ggml_runner
from moestream.engine.ggml_runner import GgmlRunner
from moestream.engine.runners import EagerRunner
from moestream.errors import MoestreamError
from moestream.ggml.net import Net
from moestream.graphs import GRAPH_FAMILIES, ModelSpec, layers, moe

PROMPT = [5, 17, 33, 2, 99, 41, 7, 250, 3, 12, 80, 64]
FORCED = [9, 150, 77, 31, 200, 6, 18, 42]  # teacher-forced decode steps
TOLERANCE = 0.04  # of the largest |logit|


def _stock_logits(path, prompt: list[int] = PROMPT) -> torch.Tensor:
    """Stock transformers' logits at the last prompt position and after each forced token [1+n, V]."""
    model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + FORCED])).logits[0]
    return logits[len(prompt) - 1 :]


def _runner_logits(engine, prompt: list[int] = PROMPT) -> torch.Tensor:
    """The runner's logits for the same positions: one prefill step, then one step per forced token."""
    step = engine.runner
    logits, kv = step(prompt, None)
    out = [logits]
    for token in FORCED:
        logits, kv = step([token], kv)
        out.append(logits)
    return torch.stack(out)


@pytest.mark.parametrize("arch", GRAPH_FAMILIES)  # gpt_oss_mxfp4: test_mxfp4_graphs.py
def test_graphs_match_stock_transformers(arch, tiny_dir):
    path = tiny_dir(arch)
    ref = _stock_logits(path)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        assert isinstance(engine.runner, GgmlRunner)
        assert f"trunk ggml graphs ({arch}" in engine.mode_line()
        got = _runner_logits(engine)
        diff = (got - ref).abs().max().item()
        assert diff <= TOLERANCE * ref.abs().max().item(), (arch, diff)
        gen = engine.generate(PROMPT, max_tokens=16, ignore_eos=True)
        assert gen.tokens == _stock_greedy(path, PROMPT, 16)


def _stock_greedy(path, prompt: list[int], n: int) -> list[int]:
    """Stock transformers' greedy tokens with the EOS id an ordinary token, as `ignore_eos` treats it
    (generate's min_new_tokens would instead forbid it: tiny qwen3_next's third argmax is id 0)."""
    model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _budgets(engine) -> list[int]:
    minimum, _ = budget_requirements(engine.emap, engine.top_k)
    everything = engine.cache.slot_bytes * len(engine.emap.units)
    return [minimum, (minimum + everything) // 2, everything]


def _streamed_equals_resident(path, fused: bool) -> None:
    """Every expert read at load (one graph a token where their slots allow), against every budget and
    io mode read on first use: the same bits."""
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        resident = _runner_logits(engine)
        tokens = engine.generate(PROMPT, max_tokens=12, ignore_eos=True).tokens
        for budget in _budgets(engine):
            for io_mode in ("direct", "pagecache", "mmap"):
                engine.restream(cache=budget, io_mode=io_mode, preload=False)
                assert torch.equal(_runner_logits(engine), resident), (budget, io_mode)
                assert engine.generate(PROMPT, max_tokens=12, ignore_eos=True).tokens == tokens
                if budget < engine.cache.slot_bytes * len(engine.emap.units):
                    assert engine.cache.stats.misses > len(engine.emap.units), "small budgets re-read"
                elif fused:  # one token's cached experts were computed inside the next layer's graph
                    assert engine.runtime.layer_calls > 0


def _small_steps(monkeypatch) -> None:
    """Prefill chunks of 5 tokens and attention spans of 8 positions: a short prompt crosses chunks and
    its decoding crosses spans (graph sets built and dropped)."""
    monkeypatch.setattr(ggml_runner, "CHUNK", 5)
    monkeypatch.setattr(ggml_runner, "SPAN_STEP", 8)
    monkeypatch.setattr(layers, "SPAN_STEP", 8)


def _count_runs(monkeypatch) -> list[int]:
    runs = [0]
    run = Net.run

    def counted(self):
        runs[0] += 1
        run(self)

    monkeypatch.setattr(Net, "run", counted)
    return runs


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_every_expert_cached_makes_a_token_one_graph(arch, tiny_dir, monkeypatch, tmp_path):
    """A cache that holds every expert reads them all at load; a decode step is then one graph (the
    routers' ids pick the slots inside it), with the bits of the per-layer graphs and of streaming."""
    path = tiny_dir(arch)
    runs = _count_runs(monkeypatch)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        units = len(engine.emap.units)
        assert "every expert cached, read at load" in engine.mode_line()
        assert "one graph a step while every expert is cached" in engine.mode_line()
        assert engine.cache.stats.misses == units  # all of them, at load
        runs[0] = 0
        whole = _runner_logits(engine)
        graphs = len(engine.runner.spec.layers) + 1
        assert runs[0] == 1 + len(FORCED)  # the prefill, then each token: one graph each
        assert engine.cache.stats.misses == units
        hits = engine.cache.stats.hits
        tokens = engine.generate(PROMPT, max_tokens=12, ignore_eos=True).tokens
        engine.restream(cache="64MiB", preload=False)  # read on first use: per-layer graphs
        assert "read at load" not in engine.mode_line()
        runs[0] = 0
        assert torch.equal(_runner_logits(engine), whole)
        assert runs[0] == graphs * (1 + len(FORCED))
        s = engine.cache.stats
        assert s.hits + s.misses == hits  # each layer's distinct experts, counted alike
        assert engine.generate(PROMPT, max_tokens=12, ignore_eos=True).tokens == tokens
        minimum, _ = budget_requirements(engine.emap, engine.top_k)
        engine.restream(cache=minimum, preload=True)  # too small to hold them all: nothing read at load
        assert engine.cache.stats.misses == 0 and "read at load" not in engine.mode_line()
        assert torch.equal(_runner_logits(engine), whole)
    # a routing trace needs each layer's routing on the host: per-layer graphs, the same tokens
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        engine.start_trace(tmp_path / "t.parquet")
        runs[0] = 0
        assert engine.generate(PROMPT, max_tokens=12, ignore_eos=True).tokens == tokens
        assert runs[0] > graphs + 12


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_streamed_equals_resident_bit_for_bit(arch, tiny_dir):
    # f32 experts: 8 KiB, slots a page apart (gpt_oss's [in, out] ones transposed once read)
    _streamed_equals_resident(tiny_dir(arch), fused=True)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_gguf_blocks_streamed_equal_resident_and_match_the_transformers_path(arch, tiny_gguf):
    """Q8_0 trunk and Q4_0/Q8_0 experts (gpt_oss: MXFP4, as its released GGUFs): the graphs read the
    blocks as stored; the transformers path on the same file computes the same matrices with the same ggml
    kernels (activations quantized to 8 bits inside both), but its attention in f32 from an F32 cache and
    its sums in another order."""
    types = {"gate": Q.Q4_0, "up": Q.Q8_0, "down": Q.Q4_0}
    if arch == "gpt_oss":
        types = dict.fromkeys(types, Q.MXFP4)
    _, path = tiny_gguf(arch, ftype=Q.Q8_0, expert_type=lambda layer, kind: types[kind])
    _streamed_equals_resident(path, fused=False)  # Q4_0/Q8_0 experts of 1-2 KiB: no common slot layout
    with moestream.load(str(path), cache="64MiB", trunk="eager") as engine:
        eager = _runner_logits(engine)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        assert f"trunk ggml graphs ({arch}" in engine.mode_line()
        got = _runner_logits(engine)
    diff = (got - eager).abs().max().item()
    assert diff <= 0.05 * eager.abs().max().item(), diff  # 8-bit activations, F16/F32 attention
    assert torch.equal(got.argmax(-1), eager.argmax(-1))


def test_chunked_prefill_and_spans_across_graph_sets(tiny_dir, monkeypatch):
    """A prompt longer than a prefill chunk, and decoding across attention spans, give stock's logits."""
    _small_steps(monkeypatch)
    path = tiny_dir("qwen3_moe")
    ref = _stock_logits(path)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        got = _runner_logits(engine)
        sets = engine.runner._sets  # sets built and dropped: one prefill shape, two decode ones
        assert [t > 1 for t, _, _ in sets].count(True) == ggml_runner.KEEP_PREFILL_SETS
        assert [t == 1 for t, _, _ in sets].count(True) == ggml_runner.KEEP_DECODE_SETS
    assert (got - ref).abs().max().item() <= TOLERANCE * ref.abs().max().item()


def test_prompt_cache_continues_the_graphs_kv_cache(tiny_dir):
    path = tiny_dir("qwen2_moe")
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        first = engine.generate(PROMPT, max_tokens=6, ignore_eos=True, cache_prompt=True)
        longer = PROMPT + first.tokens + [11, 12, 13]
        warm = engine.generate(longer, max_tokens=8, ignore_eos=True, cache_prompt=True)
        assert warm.cached_tokens == len(PROMPT) + len(first.tokens) - 1
        cold = engine.generate(longer, max_tokens=8, ignore_eos=True)
        assert cold.cached_tokens == 0
        assert warm.tokens == cold.tokens


def test_one_pool_and_the_mode_line(tiny_dir):
    with moestream.load(str(tiny_dir("mixtral")), cache="64MiB", threads=2) as engine:
        assert isinstance(engine.runner, GgmlRunner)  # auto picks the graphs on the CPU
        assert torch.get_num_threads() == 1
        from moestream import ggml

        assert ggml.kernels().n_threads == 2
        assert "threads 2 (one ggml pool; torch 1)" in engine.mode_line()
    torch.set_num_threads(1)


def test_what_the_graphs_lack_runs_transformers_and_says_why(tmp_path):
    # what the graphs refuse (here an activation they do not compute) runs transformers' forward
    from tiny_models import write_tiny

    path = write_tiny("qwen3_moe", tmp_path / "gelu", hidden_act="gelu")
    with moestream.load(str(path), cache="64MiB") as engine:
        assert isinstance(engine.runner, EagerRunner)
        assert "trunk eager (transformers: activation 'gelu' is not in the graphs yet)" in engine.mode_line()
    with pytest.raises(
        MoestreamError, match="--trunk ggml is not possible for this model: activation 'gelu'"
    ):
        moestream.load(str(path), cache="64MiB", trunk="ggml")


@pytest.mark.parametrize("arch", ["glm4_moe", "qwen2_moe", "gpt_oss"])
def test_graphs_with_the_families_vectors_random(arch, tiny_gguf):
    """Random norms, biases and GLM's score-correction bias (zeros and ones in a fresh model), and a
    routed scaling factor; gpt_oss's attention biases, sinks, router bias and experts' biases: the
    routers' extra terms change the routing, and the graphs follow stock."""
    hf, _ = tiny_gguf(arch)
    ref = _stock_logits(hf)
    with moestream.load(str(hf), cache="64MiB", trunk="ggml") as engine:
        got = _runner_logits(engine)
    assert (got - ref).abs().max().item() <= TOLERANCE * ref.abs().max().item()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_cli_runs_the_graphs(tiny_dir, capsys):
    path = tiny_dir("olmoe")
    assert main(["generate", str(path), "-p", "Hello", "-n", "4", "--trunk", "ggml", "-t", "1"]) == 0
    err = capsys.readouterr().err
    assert "trunk ggml graphs (olmoe" in err and "threads 1 (one ggml pool; torch 1)" in err


def _spec(engine) -> ModelSpec:
    return engine.runner.spec


def _without(engine, change, prompt: list[int] = PROMPT) -> torch.Tensor:
    """The runner's logits with `change` made to its spec (graphs built again), then the spec restored."""
    runner = engine.runner
    saved = {id(x): dict(vars(x)) for x in [runner.spec, *(layer.attention for layer in runner.spec.layers)]}
    change(runner.spec)
    runner.close_sets()
    try:
        return _runner_logits(engine, prompt)
    finally:
        for x in [runner.spec, *(layer.attention for layer in runner.spec.layers)]:
            vars(x).update(saved[id(x)])
        runner.close_sets()


def test_gpt_oss_sliding_window_across_chunks_and_spans(tiny_dir, monkeypatch):
    """tiny gpt_oss attends over a 16-token window on its even layers: a 36-token prompt in chunks of 7
    and decoding past it, over spans of 8 positions, give stock's logits; the same graphs without the
    window (every layer seeing every position) do not, so the window is what makes them match."""
    monkeypatch.setattr(ggml_runner, "CHUNK", 7)
    monkeypatch.setattr(ggml_runner, "SPAN_STEP", 8)
    monkeypatch.setattr(layers, "SPAN_STEP", 8)
    prompt = PROMPT * 3
    path = tiny_dir("gpt_oss")
    ref = _stock_logits(path, prompt)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        assert [layer.attention.window for layer in _spec(engine).layers] == [16, None]
        got = _runner_logits(engine, prompt)

        def no_window(spec: ModelSpec) -> None:
            for layer in spec.layers:
                layer.attention.window = None

        unwindowed = _without(engine, no_window, prompt)
        assert torch.equal(_runner_logits(engine, prompt), got)  # the window back
    largest = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= TOLERANCE * largest
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (unwindowed - ref).abs().max().item() > 3 * TOLERANCE * largest


YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 4096,
}


@pytest.mark.parametrize("arch,truncate", [("gpt_oss", False), ("qwen3_moe", True)])
def test_yarn_rope_matches_stock(arch, truncate, tmp_path):
    """YaRN as gpt-oss configures it (its correction range not truncated) and as Qwen3 does (truncated):
    the graphs turn each pair by transformers' own frequencies and scale cos/sin by its attention factor;
    with plain rope (the same base) instead, the logits are far off."""
    from tiny_gguf import perturb_vectors
    from tiny_models import write_tiny

    rope = dict(YARN, truncate=truncate)
    path = write_tiny(arch, tmp_path / arch, rope_parameters=rope, max_position_embeddings=131072)
    perturb_vectors(path)
    ref = _stock_logits(path)
    with moestream.load(str(path), cache="64MiB", trunk="ggml", ctx_size=256) as engine:
        spec = _spec(engine)
        assert spec.rope_freqs is not None and spec.rope_attn == pytest.approx(1 + 0.1 * math.log(32))
        got = _runner_logits(engine)

        def plain_rope(spec: ModelSpec) -> None:
            spec.rope_freqs, spec.rope_attn = None, 1.0

        plain = _without(engine, plain_rope)
    largest = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= TOLERANCE * largest
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (plain - ref).abs().max().item() > 3 * TOLERANCE * largest


def test_gpt_oss_gguf_experts_in_the_graphs(tiny_gguf, monkeypatch):
    """gpt-oss's F32 GGUF experts (slots a page apart) are computed inside the graphs: ggml_add_id for
    their biases, ggml_swiglu_oai, and a decoded token is one graph while every expert is cached. The
    expert runtime computes a streamed one with the same ops (its clamped SwiGLU by ggml's op, its
    biases by f32 adds), so streamed == resident bit for bit; the logits follow stock transformers."""
    hf, path = tiny_gguf("gpt_oss")
    ref = _stock_logits(hf)
    runs = _count_runs(monkeypatch)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        assert "(gpt_oss: one graph a layer, the routed experts between them; one graph a step" in (
            engine.mode_line()
        )
        runs[0] = 0
        got = _runner_logits(engine)
        assert runs[0] == 1 + len(FORCED)  # the prefill, then each token: one graph each
    assert (got - ref).abs().max().item() <= TOLERANCE * ref.abs().max().item()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    _streamed_equals_resident(path, fused=True)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_a_long_prefill_streamed_equals_resident(arch, tiny_gguf):
    """A 200-token prompt routes 16-64+ rows to an expert, where a Q8_0 expert outside the graphs would be
    dequantized and multiplied by torch (faster there): under the graphs a streamed expert is ggml's
    mul_mat_id whatever its rows, as a cached one computed in the graph is, so the bits are the same."""
    _, path = tiny_gguf(arch, ftype=Q.Q8_0, expert_type=lambda layer, kind: Q.Q8_0)
    prompt = [(i * 37) % 300 + 5 for i in range(200)]
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        resident = _runner_logits(engine, prompt)
        threshold = engine.runtime.formats[(0, "gate")].threshold
        assert threshold <= 2 * len(prompt) // engine.emap.num_experts  # the dequantizing route exists
        minimum, _ = budget_requirements(engine.emap, engine.top_k)
        engine.restream(cache=minimum, preload=False)
        assert torch.equal(_runner_logits(engine, prompt), resident)


def test_an_interrupt_while_a_graph_set_builds_leaves_the_engine_usable(tiny_dir, monkeypatch):
    """Before: a Ctrl-C inside a graph set's build ran its cleanup before `whole` existed, and the user saw
    an AttributeError instead of the interrupt (CI, test_faults' SIGINT case)."""
    path = tiny_dir("qwen3_moe")
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        budget = _budgets(engine)[0]  # not every expert: a graph a layer (a one-graph step builds no other)
        engine.restream(cache=budget)
        want = engine.generate(PROMPT, max_tokens=6, ignore_eos=True).tokens
    finish = Net.finish
    calls = [0]

    def interrupted(self, *args):
        calls[0] += 1
        if calls[0] == 3:  # inside the first set: some graphs finished, the rest not yet built
            raise KeyboardInterrupt
        finish(self, *args)

    monkeypatch.setattr(Net, "finish", interrupted)
    with moestream.load(str(path), cache=budget, trunk="ggml") as engine:
        with pytest.raises(KeyboardInterrupt):
            engine.generate(PROMPT, max_tokens=6, ignore_eos=True)
        assert engine.generate(PROMPT, max_tokens=6, ignore_eos=True).tokens == want


def test_routers_are_computed_in_float32(tiny_dir):
    """As llama.cpp computes them (its converter stores routers F32): ggml's bf16 product rounds the
    activations to 16 bits first, which on the trained fixture's bf16 GGUF moved the first token's
    log-probabilities by up to 0.15 and changed the greedy token; in float32 they equal llama-server's to
    5 decimals (BENCHMARKS.md). The copies are counted for the auto budget."""
    from moestream import ggml
    from moestream.engine.auto_budget import _runner_parts

    f32 = ggml.ggml_type("F32").id
    with moestream.load(str(tiny_dir("qwen2_moe")), cache="64MiB", dtype="bfloat16") as engine:
        spec = _spec(engine)
        routers = [x.router for x in spec.layers if x.router is not None]
        gates = [m for r in routers for m in (r.weight, r.shared_gate) if m is not None]
        assert len(gates) == 2 * len(routers)  # qwen2_moe: the router and the shared expert's gate
        assert {m.type_id for m in gates} == {f32}
        assert spec.copied_bytes == sum(4 * m.rows * m.cols for m in gates) > 0
        parts = _runner_parts(engine.loaded.description, ("kv", 0))
        assert ("the routers in float32", spec.copied_bytes) in parts
        assert spec.layers[0].attention.q.type_id != f32  # the rest stays as the model holds it
    with moestream.load(str(tiny_dir("qwen2_moe")), cache="64MiB", dtype="float32") as engine:
        assert _spec(engine).copied_bytes == 0  # a float32 model's own routers: no copy


def _graph_moe_sum(y: torch.Tensor, w: torch.Tensor, threads: int) -> torch.Tensor:
    """graphs.moe.moe_sum alone: y [T, K, H], w [T, K] -> [T, H] by one graph."""
    from ggml_graph import run_once

    from moestream.ggml.net import F32

    T, K, H = y.shape

    def build(net):
        yt, wt = net.tensor(F32, [H, K, T], y.data_ptr()), net.tensor(F32, [1, K, T], w.data_ptr())
        return net.cont(moe.moe_sum(net, yt, wt, H, K, T))

    return run_once(build, torch.empty(T, H), threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_experts_sum_rounds_as_llama_cpp_does(threads):
    """llama.cpp's build_moe_ffn: each y_k * w_k rounded once, then added in the router's order. The
    graphs' sum must give those bits (independently: torch's float32 ops, each correctly rounded); the
    K-term ggml_out_prod it replaced (fused multiply-adds) does not, and parted from llama.cpp's greedy
    tokens on the trained fixture (BENCHMARKS.md)."""
    g = torch.Generator().manual_seed(11)
    T, K, H = 5, 8, 512
    y, w = torch.randn(T, K, H, generator=g), torch.rand(T, K, generator=g)
    want = y[:, 0] * w[:, :1]
    for k in range(1, K):
        want = want + y[:, k] * w[:, k : k + 1]
    got = _graph_moe_sum(y, w, threads)
    assert torch.equal(got, want)
    fused = torch.zeros(T, H, dtype=torch.float64)  # what a chain of exact fused multiply-adds gives
    for k in range(K):
        fused = (fused + y[:, k].double() * w[:, k : k + 1].double()).float().double()
    assert not torch.equal(fused.float(), want)  # the two orders of rounding differ on these numbers
