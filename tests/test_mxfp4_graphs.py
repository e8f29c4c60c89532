"""gpt-oss's MXFP4 safetensors experts computed inside the ggml graphs.

HF stores each matrix as blocks [R, K/32, 16] (byte j: elements 2j, 2j+1) and E8M0 scales [R, K/32]; the
cache rewrites each kind once read into ggml's block_mxfp4 rows ({e, qs[16]}: byte j holds elements j and
16 + j), gate_up's interleaved gate/up rows laid out gate rows first, so the graphs compute them with
ggml_mul_mat_id over the slots (gate and up as two matrices, I rows apart) and the expert runtime a
streamed one with the same ops.

Oracles: the repacked bytes dequantized by the gguf package equal transformers' own dequantization of
HF's bytes (exactly: the same values); an expert's output equals transformers' GptOssExperts math on
the same rows with its inputs rounded to Q8_0 blocks (ggml's MXFP4 product multiplies by 8-bit
activations with fp16 block scales: measured equal to the last bit, ~1% off with fp32 inputs); stock
transformers fp32 end to end: logits within 4% of the largest logit (as test_ggml_runner: the graphs'
F16 KV cache, and here the 8-bit activations; measured 0.6-1.4%), the same argmax, and its greedy
tokens up to where stock's own routing nearly ties: the 8-bit activations of layer 0's experts move
layer 1's router logits by up to 0.03 (0.003 with fp32 torch experts), and stock's 16 greedy tokens
reach a margin of 0.0044 between a router's 2nd and 3rd expert before the 15th, where another expert
may be picked. Streamed == resident bit for bit at every budget and io mode.
"""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F
import transformers as T
from gguf import GGMLQuantizationType as Q
from test_ggml_runner import FORCED, PROMPT, TOLERANCE, _count_runs, _runner_logits, _streamed_equals_resident
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import moestream
from moestream.cache.size_classes import budget_requirements
from moestream.errors import ExpertReadError
from moestream.runtime import prefetch as prefetch_module
from moestream.runtime.experts import ExpertRuntime
from moestream.runtime.formats import ggml as ggml_graphs_format
from moestream.runtime.formats.ggml import GgmlMxfp4, ggml_mxfp4

# the graphs' router logits differ from stock fp32 by up to this much at layer 1 (its input went through
# layer 0's experts on 8-bit activations; measured 0.007-0.031, 0.003 with fp32 torch experts)
ROUTER_ERROR = 0.03


def _hf_values(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' dequantization of HF's layout: blocks [R, G, 16], scales [R, G] -> [R, 32G] f32."""
    return convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].T


def test_repacked_blocks_hold_transformers_values():
    """Every code and a range of scales (E8M0 0 and 1 are ggml's subnormal halves): ggml's layout, read by
    the gguf package, has transformers' values, row for row in the order asked."""
    g = torch.Generator().manual_seed(0)
    rows, groups = 12, 5
    blocks = torch.randint(0, 256, (rows, groups, 16), dtype=torch.uint8, generator=g)
    blocks[0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # each code in both nibbles
    scales = torch.randint(100, 150, (rows, groups), dtype=torch.uint8, generator=g)
    scales[1, :2] = torch.tensor([0, 1])
    order = torch.cat((torch.arange(0, rows, 2), torch.arange(1, rows, 2)))
    packed = ggml_mxfp4(blocks, scales, order)
    assert packed.shape == (rows, groups, 17)
    got = gguf.quants.dequantize(packed.numpy().reshape(rows, groups * 17), Q.MXFP4)
    want = _hf_values(blocks, scales)[order]
    assert torch.equal(torch.from_numpy(got.copy()), want)
    as_stored = torch.cat((scales.unsqueeze(-1), blocks), dim=-1)[order]  # the nibbles not moved
    naive = gguf.quants.dequantize(as_stored.numpy().reshape(rows, groups * 17), Q.MXFP4)
    assert not torch.equal(torch.from_numpy(naive.copy()), want)


def _q8(x: torch.Tensor) -> torch.Tensor:
    """x [t, K] rounded as ggml quantizes activations to Q8_0: blocks of 32, scale amax/127 kept in fp16."""
    b = x.reshape(*x.shape[:-1], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.round(b * torch.where(d > 0, 1 / d, 0))
    return (q * d.half().float()).reshape(x.shape)


def _stock(path):
    """Stock transformers fp32, the experts dequantized by transformers."""
    config = T.Mxfp4Config(dequantize=True)
    model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=config)
    return model.float().eval()


def _margins(model, ids: list[int]) -> torch.Tensor:
    """[positions] the smallest gap over the layers between a router's k-th and (k+1)-th logit."""
    margins = []

    def hook(module, args, out):
        top = F.linear(args[0].reshape(-1, args[0].shape[-1]), module.weight, module.bias)
        top = top.topk(module.top_k + 1, -1).values
        margins.append(top[:, -2] - top[:, -1])

    handles = [layer.mlp.router.register_forward_hook(hook) for layer in model.model.layers]
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack(margins).amin(0)


@pytest.fixture(scope="module")
def mxfp4_dir(tiny_dir):
    return tiny_dir("gpt_oss_mxfp4")


def _one_graph_a_step(engine, runs: list[int], calls: list[int]) -> torch.Tensor:
    """The runner's logits over PROMPT + FORCED (`_runner_logits`), asserting that gpt_oss ran them one
    graph a step with no expert computed by the expert runtime (`runs`, `calls`: the counters of
    `_count_runs` and `_count_runtime`)."""
    assert "(gpt_oss: one graph a layer, the routed experts between them; one graph a step" in (
        engine.mode_line()
    )
    runs[0] = 0
    got = _runner_logits(engine)
    assert runs[0] == 1 + len(FORCED) and calls[0] == 0
    return got


def _count_runtime(monkeypatch) -> tuple[list[int], list]:
    """Counts the expert runtime's layer forwards, and keeps what each computed."""
    calls, seen = [0], []
    experts = ExpertRuntime.experts

    def counted(self, layer, hidden, *args):
        calls[0] += 1
        routed = experts(self, layer, hidden, *args)
        seen.append((layer, hidden.clone(), routed))
        return routed

    monkeypatch.setattr(ExpertRuntime, "experts", counted)
    return calls, seen


def test_an_expert_is_transformers_math_on_8_bit_activations(mxfp4_dir, monkeypatch):
    """Each expert the runtime computes (a miss; the graphs compute a cached one with the same bits:
    `test_mxfp4_experts_streamed_equal_resident`) is transformers' GptOssExperts math on the same rows
    with its input and down's input rounded to Q8_0 blocks, as ggml's MXFP4 product rounds them:
    measured equal to the last bit; with fp32 activations they differ by ~1%."""
    model = _stock(mxfp4_dir)
    _, seen = _count_runtime(monkeypatch)
    with moestream.load(str(mxfp4_dir), cache="64MiB", trunk="ggml", preload=False) as engine:
        minimum, _ = budget_requirements(engine.emap, engine.top_k)
        engine.restream(cache=minimum, preload=False)
        engine.runner(PROMPT, None)
    assert {layer for layer, _, _ in seen} == {0, 1}
    with torch.no_grad():
        for layer, hidden, routed in seen:
            ex = model.model.layers[layer].mlp.experts
            for e, out in routed.outputs.items():
                x = routed.routing.by_expert[e].rows(hidden)
                for q8 in (True, False):
                    rnd = _q8 if q8 else (lambda v: v)
                    gate_up = rnd(x) @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
                    want = rnd(ex._apply_gate(gate_up)) @ ex.down_proj[e] + ex.down_proj_bias[e]
                    diff = (out - want).abs().max().item()
                    if q8:
                        assert diff <= 1e-5 * want.abs().max().item(), (layer, e, diff)
                    else:
                        assert diff > 1e-3 * want.abs().max().item()  # the rounding is what matches


def test_mxfp4_experts_in_the_graphs_follow_stock(mxfp4_dir, monkeypatch):
    model = _stock(mxfp4_dir)
    with torch.inference_mode():
        ref = model(torch.tensor([PROMPT + FORCED])).logits[0, len(PROMPT) - 1 :]
        model.generation_config.eos_token_id = None  # an ordinary token, as `ignore_eos` treats it
        greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False)
    greedy = greedy[0, len(PROMPT) :].tolist()
    margins = _margins(model, PROMPT + greedy)[len(PROMPT) - 1 :]  # at the position predicting each token
    runs = _count_runs(monkeypatch)
    calls, _ = _count_runtime(monkeypatch)
    with moestream.load(str(mxfp4_dir), cache="64MiB", trunk="ggml") as engine:
        assert {type(f) for f in engine.runtime.formats.values()} == {GgmlMxfp4}
        assert "MXFP4 by ggml" in engine.mode_line()
        got = _one_graph_a_step(engine, runs, calls)
        tokens = engine.generate(PROMPT, max_tokens=16, ignore_eos=True).tokens
        engine.restream(cache="64MiB", preload=False)  # per-layer graphs: each layer's hits in the next
        _runner_logits(engine)  # the first use reads them (the runtime computes those misses)
        calls[0] = 0
        assert torch.equal(_runner_logits(engine), got)
        assert calls[0] == 0 and engine.runtime.layer_calls > 0
    largest = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= TOLERANCE * largest
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # greedy: stock's tokens, up to where a router of stock's own run nearly ties
    same = next((i for i, (a, b) in enumerate(zip(tokens, greedy)) if a != b), len(greedy))
    assert same >= 12, (tokens, greedy)
    if same < len(greedy):
        assert margins[same].item() < ROUTER_ERROR, (same, margins.tolist())


def test_mxfp4_experts_streamed_equal_resident(mxfp4_dir, monkeypatch):
    _streamed_equals_resident(mxfp4_dir, fused=True)
    # every guess read ahead (the tiny model's few guesses seldom reach the measured precision)
    monkeypatch.setattr(prefetch_module, "PRECISION_MIN", 0.0)
    with moestream.load(str(mxfp4_dir), cache="64MiB", trunk="ggml") as engine:
        resident = _runner_logits(engine)
        slot = engine.cache.slot_bytes  # read ahead into 10 slots of 16: repacked as they land
        engine.restream(cache=10 * slot, prefetch="on", io_threads=4, preload=False)
        assert torch.equal(_runner_logits(engine), resident)
        assert engine.cache.stats.prefetches > 0


def test_a_failed_repack_fails_that_forward_only(mxfp4_dir, monkeypatch):
    """A kind whose bytes cannot be rewritten is that expert's read error: the forward raises, gives back
    what it held, and the next one (its bytes read again) has the bits of a clean run."""
    with moestream.load(str(mxfp4_dir), cache="64MiB", trunk="ggml", preload=False) as engine:
        clean = _runner_logits(engine)
        engine.restream(cache="64MiB", preload=False)
        calls = [0]
        repack = ggml_graphs_format.ggml_mxfp4

        def fails_once(*args):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("no")
            return repack(*args)

        monkeypatch.setattr(ggml_graphs_format, "ggml_mxfp4", fails_once)
        with pytest.raises(ExpertReadError, match="could not be repacked"):
            _runner_logits(engine)
        assert torch.equal(_runner_logits(engine), clean)
