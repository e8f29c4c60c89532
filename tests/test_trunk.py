"""`--trunk`: the decode step's trunk over transformers' dynamic cache (eager), over one static KV cache
(static), or replayed as CUDA graphs between the MoE layers' experts over that cache (graphs).

Oracles:
- static against eager (itself checked against stock transformers in tests/test_exactness.py): the same
  greedy tokens, the same prompt-cache reuse, logits within 1e-4 (fp32: attention over the static cache
  sums the same terms plus exact zeros from masked positions, in another order);
- graphs against static (GPU machine): bit for bit, logits of every step, from the minimum expert budget
  (misses read while the graphs replay) to every expert in the GPU tier; tokens against eager;
- one graphs step syncs the host only at each layer's routing readback and at the logits (CUDA's sync
  debug mode), where the eager step also runs every trunk op from Python.
Models a static cache cannot serve are refused with the reason, and auto falls back to eager.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import moestream
from moestream.cli import main
from moestream.engine.ggml_runner import GgmlRunner
from moestream.engine.runners import EagerRunner, StaticRunner
from moestream.errors import MoestreamError
from moestream.graphs import GRAPH_FAMILIES

PROMPT = [5, 17, 33, 2, 99, 41, 7, 25]
FEED = [3, 19, 44, 101, 6, 8, 12, 60]  # fed after the prompt, one token a step
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
# --device cuda here is the torch CUDA path, even where ggml's CUDA library is built (engine/gpu_path.py)
pytestmark = pytest.mark.usefixtures("torch_cuda_path")
STATIC_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe"]
REFUSED = {
    "gpt_oss": "StaticSlidingWindowLayer",
    "qwen3_next": "LinearAttentionLayer",
    "deepseek_v3": "fails over a static KV cache",
}


def _steps(engine: moestream.Engine) -> list[torch.Tensor]:
    """Logits of the prompt's forward and of each FEED token after it, through the engine's step."""
    logits, cache = engine.runner(PROMPT, None)
    out = [logits]
    for token in FEED:
        logits, cache = engine.runner([token], cache)
        out.append(logits)
    return out


@pytest.mark.parametrize("arch", STATIC_ARCHS)
def test_static_trunk_gives_the_eager_tokens_and_logits(tiny_dir, arch):
    path = str(tiny_dir(arch, experts=16))
    runs = {}
    for trunk in ("eager", "static"):
        with moestream.load(path, cache="1MiB", trunk=trunk, ctx_size=64) as engine:
            first = engine.generate(PROMPT, max_tokens=8, ignore_eos=True, cache_prompt=True)
            turn = PROMPT + first.tokens + FEED
            warm = engine.generate(turn, max_tokens=8, ignore_eos=True, cache_prompt=True)
            cold = engine.generate(turn, max_tokens=8, ignore_eos=True)
            runs[trunk] = (first.tokens, warm.tokens, warm.cached_tokens, cold.tokens, _steps(engine))
            line = engine.mode_line()
            assert type(engine.runner) is {"eager": EagerRunner, "static": StaticRunner}[trunk]
        assert ("trunk static KV cache of 64 tokens" in line) == (trunk == "static"), line
    eager, static = runs["eager"], runs["static"]
    assert static[:4] == eager[:4]
    assert static[2] == len(PROMPT) + 8 - 1 and static[1] == static[3]  # reused, and as a cold run
    for a, b in zip(eager[4], static[4]):
        assert (a - b).abs().max().item() <= 1e-4


def test_static_trunk_fills_the_whole_context(tiny_dir):
    """A request of exactly --ctx-size tokens: the static cache's last position is written and read."""
    path = str(tiny_dir("qwen3_moe"))
    tokens = {}
    for trunk in ("eager", "static"):
        with moestream.load(path, cache="1MiB", trunk=trunk, ctx_size=16) as engine:
            tokens[trunk] = engine.generate(PROMPT, max_tokens=8, ignore_eos=True).tokens
            with pytest.raises(MoestreamError, match="exceeds the context of 16 tokens"):
                engine.generate(PROMPT, max_tokens=9, ignore_eos=True)
    assert tokens["static"] == tokens["eager"] and len(tokens["static"]) == 8


@pytest.mark.parametrize("arch", list(REFUSED))
def test_models_a_static_cache_cannot_serve_are_refused_or_run_eager(tiny_dir, arch):
    path = str(tiny_dir(arch))
    with pytest.raises(
        MoestreamError, match=f"--trunk static is not possible for this model: .*{REFUSED[arch]}"
    ):
        moestream.load(path, cache="1MiB", trunk="static")
    with moestream.load(path, cache="1MiB") as engine:  # auto on the CPU: no static cache tried
        if arch in GRAPH_FAMILIES:  # gpt_oss, qwen3_next: the ggml graphs, their own KV cache and states
            assert f"trunk ggml graphs ({arch}" in engine.mode_line()
            assert isinstance(engine.runner, GgmlRunner)
        else:  # eager
            assert f"trunk eager (transformers: {arch} has no ggml graph yet" in engine.mode_line()
            assert isinstance(engine.runner, EagerRunner)  # no static cache, no graphs


def test_graphs_need_a_cuda_device(capsys, tiny_dir):
    code = main(["generate", str(tiny_dir("qwen3_moe")), "--trunk", "graphs", "--prompt", "Hi"])
    err = capsys.readouterr().err
    assert code == 2 and "--trunk graphs needs a CUDA device" in err and "Traceback" not in err
    with pytest.raises(MoestreamError, match="--trunk layer-graphs needs a CUDA device"):
        moestream.load(str(tiny_dir("qwen3_moe")), trunk="layer-graphs")
    modes = "auto, ggml, graphs, layer-graphs, static, eager"
    with pytest.raises(MoestreamError, match=f"trunk mode 'jit' is not one of {modes}"):
        moestream.load(str(tiny_dir("qwen3_moe")), trunk="jit")


def test_cli_trunk_option_reaches_the_mode_line(capsys, tiny_dir):
    path = str(tiny_dir("qwen3_moe"))
    argv = ["generate", path, "--trunk", "static", "--ctx-size", "32", "--prompt", "Hi", "--max-tokens", "3"]
    assert main(argv) == 0
    assert "trunk static KV cache of 32 tokens, eager ops" in capsys.readouterr().err


# --- CUDA graphs (GPU machine) ---------------------------------------------------------------------


def _budgets(engine: moestream.Engine) -> list[tuple[int, int | str]]:
    tier = engine.runtime.tier
    everything = tier.slot_bytes * len(engine.emap.units)
    return [(tier.slot_bytes * engine.top_k, 0), (everything // 2, "64MiB"), (everything, 0)]


def _runs(path: str, trunk: str, **options) -> tuple[list[list[torch.Tensor]], list[list[int]], str]:
    with moestream.load(path, device="cuda", cache="64MiB", trunk=trunk, ctx_size=64, **options) as engine:
        logits, tokens = [], []
        for gpu_cache, host_cache in _budgets(engine):
            engine.restream(gpu_cache=gpu_cache, host_cache=host_cache)
            logits.append(_steps(engine))
            tokens.append(engine.generate(PROMPT, max_tokens=16, ignore_eos=True).tokens)
        return logits, tokens, engine.mode_line()


@CUDA
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "glm4_moe"])
def test_graphs_equal_the_static_trunk_bit_for_bit(tiny_dir, arch):
    path = str(tiny_dir(arch, experts=16))
    static = _runs(path, "static", dtype="bfloat16")
    graphs = _runs(path, "graphs", dtype="bfloat16")
    eager = _runs(path, "eager", dtype="bfloat16")
    assert "trunk CUDA graphs" in graphs[2] and "trunk static KV cache" in static[2], graphs[2]
    for budget, (want, got) in enumerate(zip(static[0], graphs[0])):
        for step, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), (arch, budget, step, (a - b).abs().max().item())
    assert graphs[1] == static[1] == eager[1]


@CUDA
def test_graphs_on_gguf_blocks_equal_the_static_trunk(tmp_path):
    """Q4_K_M experts and a Q8_0 trunk, both computed on their blocks by the Triton kernels. At the last
    budget every expert fits the GPU tier: they are read at load and the whole step is one graph, with
    the experts gathered from device tables (runtime/resident.py)."""
    from test_gguf_cuda import _file

    _, path = _file(tmp_path, "Q4_K_M")
    static = _runs(str(path), "static", dtype="float32")
    graphs = _runs(str(path), "graphs", dtype="float32")
    layers = _runs(str(path), "layer-graphs", dtype="float32")
    assert "trunk CUDA graphs" in graphs[2] and "one graph a token" in graphs[2], graphs[2]
    assert "one graph a token" not in static[2] + layers[2] and "trunk CUDA graphs" in layers[2]
    for run in (graphs, layers):
        for budget, (want, got) in enumerate(zip(static[0], run[0])):
            for step, (a, b) in enumerate(zip(want, got)):
                assert torch.equal(a, b), (budget, step, (a - b).abs().max().item())
        assert run[1] == static[1]


@CUDA
def test_the_one_graph_step_follows_the_tier(tmp_path, tiny_dir):
    """Every expert resident: the one-graph step is used (no experts call from the host), gives the
    static trunk's bits, counts its experts as hits; with an observer (a trace) or after an expert left
    the tier it steps aside for the per-layer graphs, and comes back with the tables rebuilt."""
    from test_gguf_cuda import _file

    _, path = _file(tmp_path, "Q4_K_M")
    with moestream.load(str(path), device="cuda", cache="64MiB", trunk="static", ctx_size=64) as engine:
        want = _steps(engine)
    with moestream.load(str(path), device="cuda", cache="64MiB", trunk="graphs", ctx_size=64) as engine:
        graphs, runtime, tier = engine.runner.graphs, engine.runtime, engine.runtime.tier
        assert graphs.whole is not None and tier.holds_all()
        calls, before = [0], engine.counters().hits
        original = runtime.forward

        def counted(*args, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)

        runtime.forward = counted
        try:
            got = _steps(engine)
            assert calls[0] == len(engine.emap.layers)  # the prompt's forward only: decode never asked
            layers = len(engine.emap.layers)
            assert engine.counters().hits - before >= len(FEED) * layers * engine.top_k
            engine.start_trace(tmp_path / "trace.parquet")
            traced = _steps(engine)
            engine.stop_trace()
            assert calls[0] == 2 * layers + len(FEED) * layers  # an observer: the per-layer graphs
            victim = next(iter(tier.slots))
            tier.slots[victim].pins += 1
            tier.release(*victim, None, failed=True)  # as a failed copy leaves it: out of the tier
            assert not tier.holds_all()
            after = _steps(engine)
        finally:
            del runtime.forward
    for steps in (got, traced, after):
        assert all(torch.equal(a, b) for a, b in zip(want, steps))


@CUDA
def test_auto_falls_back_to_eager_where_graphs_are_not_possible(tiny_dir):
    with moestream.load(str(tiny_dir("gpt_oss")), device="cuda", cache="64MiB", dtype="bfloat16") as engine:
        assert "trunk eager (CUDA graphs not possible: layer 0's KV cache is a Static" in engine.mode_line()
        assert isinstance(engine.runner, EagerRunner)  # no graphs
    with pytest.raises(MoestreamError, match="--trunk graphs is not possible for this model"):
        moestream.load(str(tiny_dir("gpt_oss")), device="cuda", cache="64MiB", trunk="graphs")


@CUDA
def test_a_graphs_step_syncs_only_at_the_routing_and_the_logits(tiny_dir):
    path = str(tiny_dir("qwen3_moe"))
    options = dict(device="cuda", cache="64MiB", gpu_cache="100KiB", host_cache="64MiB", dtype="bfloat16")
    with moestream.load(path, trunk="graphs", **options) as engine:
        engine.generate(PROMPT, max_tokens=4, ignore_eos=True)  # warm up
        _, cache = engine.runner(PROMPT, None)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.runner([5], cache)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    where = [(w.filename.rsplit("/", 2)[-2:], w.lineno) for w in caught]
    experts = [w for w in caught if w.filename.endswith("runtime/experts.py")]
    assert len(experts) == len(engine.emap.layers), where  # the routing readback of each MoE layer
    assert len(caught) == len(experts) + 1 and caught[-1].filename.endswith("trunk_graphs.py"), where


@CUDA
def test_a_failed_graphs_step_leaves_the_engine_usable(tiny_dir):
    """An experts call that raises between two graphs: the next request gives a fresh engine's tokens."""
    path = str(tiny_dir("qwen3_moe"))
    with moestream.load(path, device="cuda", cache="64MiB", dtype="bfloat16", trunk="graphs") as engine:
        fresh = engine.generate(PROMPT, max_tokens=8, ignore_eos=True).tokens
        runtime, calls = engine.runtime, [0]
        original = runtime.forward
        decode_call = len(engine.emap.layers) * 3 + 1  # the prompt, two decode steps, then a layer in

        def failing(*args, **kwargs):
            calls[0] += 1
            if calls[0] == decode_call:
                raise RuntimeError("injected")
            return original(*args, **kwargs)

        runtime.forward = failing
        try:
            with pytest.raises(RuntimeError, match="injected"):
                engine.generate(PROMPT, max_tokens=8, ignore_eos=True, cache_prompt=True)
        finally:
            del runtime.forward
        assert engine.prompt_cache.tokens == 0  # the half-updated cache was not kept
        assert engine.generate(PROMPT, max_tokens=8, ignore_eos=True, cache_prompt=True).tokens == fresh
