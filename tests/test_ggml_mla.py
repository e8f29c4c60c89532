"""DeepSeek V2/V3 under the ggml graphs: Multi-head Latent Attention (the latent cached, kv_b_proj folded
into the query and the output), DeepSeek's interleaved rope on the rotary parts, YaRN's mscale in the
softmax scale, V2's softmax and V3's sigmoid routers with group-limited choice, shared experts and the
leading dense layers.

Oracles as in test_ggml_runner: stock transformers in fp32, the logits at every step within 4% of the
largest (the graphs keep the latent in an F16 cache and accumulate attention in F16; measured 0.12-0.18%
on these tiny models, 0.4% over a 150-token prompt), its greedy tokens exactly; streamed == resident bit
for bit. A GGUF in blocks is held against the transformers path on the same file (8-bit activations in
both; 2.7% measured). Each DeepSeek-specific piece is shown to matter: the graphs without it are far off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import test_ggml_runner as base
import torch
import transformers as T
from gguf import GGMLQuantizationType as Q
from test_ggml_runner import FORCED, PROMPT, TOLERANCE, _runner_logits, _small_steps, _stock_logits
from tiny_gguf import perturb_vectors, write_gguf
from tiny_models import write_tiny

import moestream
from moestream.graphs.deepseek import ROPE_NEOX, ROPE_NORM

# DeepSeek-V2-Lite's shape: q projected directly (no q_lora_rank), a K/V per head; V2's group-limited
# greedy routing with one group of two kept (top-2 of 8: the groups decide) and a scaling factor
V2_LITE = dict(
    q_lora_rank=None,
    num_key_value_heads=4,
    topk_method="group_limited_greedy",
    n_group=4,
    topk_group=1,
    routed_scaling_factor=2.5,
)
# V3's shape (q_lora_rank, sigmoid router, 2 groups, 1 kept) with more groups, unnormalised weights,
# and the rotate-half rope layout (rope_interleave False)
V3_VARIANT = dict(
    n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=2.5, rope_interleave=False
)
YARN = {  # DeepSeek-V2-Lite's rope scaling
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
LONG = [(i * 37) % 300 + 5 for i in range(150)]  # positions far enough for YaRN's frequencies to show


def _within(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference as a share of the largest |logit|; the greedy choice must be the same."""
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    return (got - ref).abs().max().item() / ref.abs().max().item()


def _changed(engine, change, prompt: list[int]) -> torch.Tensor:
    """The runner's logits with `change` made to its layers' attention and routers (graphs built again),
    then everything restored."""
    runner = engine.runner
    parts = [runner.spec, *(x.attention for x in runner.spec.layers)]
    parts += [x.router for x in runner.spec.layers if x.router is not None]
    saved = [dict(vars(x)) for x in parts]
    change(runner.spec)
    runner.close_sets()
    try:
        return _runner_logits(engine, prompt)
    finally:
        for x, values in zip(parts, saved):
            vars(x).update(values)
        runner.close_sets()


@pytest.mark.parametrize(
    "arch,overrides,seed",
    # seed 1 for V3: seed 0's greedy path has a step whose top two stock logits lie 0.0026 apart, under
    # the 0.008 the graphs differ by there (the tokens part ways at that near tie; seed 1's closest: 0.087)
    [("deepseek_v2", V2_LITE, 0), ("deepseek_v3", V3_VARIANT, 1)],
    ids=["v2-lite", "v3-variant"],
)
def test_deepseek_shapes_match_stock_transformers(arch, overrides, seed, tmp_path):
    """The tiny models' own shapes are in test_ggml_runner's stock test (GRAPH_FAMILIES); here V2-Lite's
    and a V3 with other routing and rope layout, random vectors (norms, V3's correction bias)."""
    path = write_tiny(arch, tmp_path / arch, seed=seed, **overrides)
    perturb_vectors(path)
    ref = _stock_logits(path)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        assert f"trunk ggml graphs ({arch}: one graph a layer" in engine.mode_line()
        spec = engine.runner.spec
        assert spec.layers[0].router is None and spec.layers[1].router is not None  # first_k_dense_replace
        assert (spec.layers[1].attention.q is None) == (arch == "deepseek_v3")
        assert _within(_runner_logits(engine), ref) <= TOLERANCE
        model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        want = model.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert (
            engine.generate(PROMPT, max_tokens=16, ignore_eos=True).tokens == want[0, len(PROMPT) :].tolist()
        )


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_streamed_equals_resident_bit_for_bit(arch, tiny_dir):
    # f32 experts of 8 KiB: slots a page apart, so a token's cached experts run inside the next graph
    base._streamed_equals_resident(tiny_dir(arch), fused=True)


def test_every_deepseek_expert_cached_makes_a_token_one_graph(tiny_dir, monkeypatch, tmp_path):
    base.test_every_expert_cached_makes_a_token_one_graph("deepseek_v3", tiny_dir, monkeypatch, tmp_path)


def test_each_deepseek_piece_matters(tmp_path):
    """The graphs follow stock with DeepSeek's rope layout, its group-limited choice, V3's correction bias
    and YaRN (frequencies and the mscale in the softmax scale); without any one of them they are far off
    (over 3x the tolerance), so each is computed, not merely present."""
    rope = dict(rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0), max_position_embeddings=163840)
    path = write_tiny("deepseek_v3", tmp_path / "v3", **rope)
    perturb_vectors(path)
    ref = _stock_logits(path, LONG)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        spec = engine.runner.spec
        mla = spec.layers[1].attention
        assert mla.rope_mode == ROPE_NORM and spec.rope_freqs is not None
        assert mla.scale == pytest.approx((1 + 0.1 * torch.log(torch.tensor(40.0)).item()) ** 2 / 16**0.5)
        assert spec.layers[1].router.groups == (2, 1, 2)
        assert _within(_runner_logits(engine, LONG), ref) <= TOLERANCE

        def each(attr: str, value) -> Callable[[Any], None]:
            def change(spec) -> None:
                for layer in spec.layers:
                    for part in (layer.attention, layer.router):
                        if part is not None and hasattr(part, attr):
                            setattr(part, attr, value)

            return change

        def plain_rope(spec) -> None:
            spec.rope_freqs, spec.rope_attn = None, 1.0

        changes = {
            "rotate-half rope": each("rope_mode", ROPE_NEOX),
            "every group": each("groups", None),
            "no correction bias": each("bias", None),
            "plain softmax scale": each("scale", 16**-0.5),
            "plain rope": plain_rope,
        }
        largest = ref.abs().max().item()
        for name, change in changes.items():
            off = (_changed(engine, change, LONG) - ref).abs().max().item()
            assert off > 3 * TOLERANCE * largest, name


def test_deepseek_v2_groups_and_mscale_matter(tmp_path):
    """V2's group-limited greedy routing (the best expert of each group decides) and V2-Lite's YaRN
    (mscale_all_dim 0.707): the graphs follow stock, and without the groups or the mscale they do not."""
    path = write_tiny(
        "deepseek_v2", tmp_path / "v2", **V2_LITE, rope_parameters=YARN, max_position_embeddings=163840
    )
    perturb_vectors(path)
    ref = _stock_logits(path)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        assert engine.runner.spec.layers[1].router.groups == (4, 1, 1)
        assert _within(_runner_logits(engine), ref) <= TOLERANCE
        largest = ref.abs().max().item()

        def every_group(spec) -> None:
            for layer in spec.layers[1:]:
                layer.router.groups = None

        def plain_scale(spec) -> None:
            for layer in spec.layers:
                layer.attention.scale = 16**-0.5

        for change in (every_group, plain_scale):
            assert (_changed(engine, change, PROMPT) - ref).abs().max().item() > 3 * TOLERANCE * largest


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_gguf_in_the_graphs(arch, tiny_gguf):
    """F32 GGUF (kv_b_proj rebuilt from attn_k_b and attn_v_b): the graphs follow stock transformers on the
    HF checkpoint it was written from, and streamed == resident bit for bit (experts in the graphs)."""
    hf, path = tiny_gguf(arch)
    ref = _stock_logits(hf)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        assert f"trunk ggml graphs ({arch}" in engine.mode_line()
        assert _within(_runner_logits(engine), ref) <= TOLERANCE
    base._streamed_equals_resident(path, fused=True)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_gguf_blocks_match_the_transformers_path(arch, tiny_gguf):
    """Q8_0 trunk (attn_k_b's 8-wide rows in F16, as the converter falls back) and Q4_0/Q8_0 experts: the
    graphs against the transformers path on the same file within 5% (8-bit activations in both, F16 and
    F32 attention; 2.7% measured); the greedy choice the same at every step but near ties (top two within
    1% of the largest logit: the tiny V2 has a step whose top two lie 0.002 apart, where the two paths'
    logits differ by 0.08)."""
    types = {"gate": Q.Q4_0, "up": Q.Q8_0, "down": Q.Q4_0}
    _, path = tiny_gguf(arch, ftype=Q.Q8_0, expert_type=lambda layer, kind: types[kind])
    base._streamed_equals_resident(path, fused=False)  # 1-2 KiB experts of two types: no common slot layout
    with moestream.load(str(path), cache="64MiB", trunk="eager") as engine:
        eager = _runner_logits(engine)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        got = _runner_logits(engine)
    largest = eager.abs().max().item()
    diff = (got - eager).abs().max().item()
    assert diff <= 0.05 * largest, diff
    top2 = eager.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.01 * largest
    assert clear.sum() >= len(FORCED) - 1  # at most two near ties among the 9 steps
    assert torch.equal(got.argmax(-1)[clear], eager.argmax(-1)[clear])


def test_deepseek_chunked_prefill_and_spans(tiny_dir, monkeypatch):
    """A prompt in chunks of 5 and decoding across attention spans of 8 positions: each step's query rows
    meet the cached latent rows of every earlier chunk and span, and the logits stay stock's."""
    _small_steps(monkeypatch)
    path = tiny_dir("deepseek_v3")
    ref = _stock_logits(path)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        assert _within(_runner_logits(engine), ref) <= TOLERANCE


def test_deepseek_v2_lite_gguf(tmp_path):
    """V2-Lite's shape written as llama.cpp's converter writes it (attn_q, no q_lora_rank; kv_b split into
    attn_k_b and attn_v_b): moestream's config reads it back as V2-Lite, and the graphs follow stock
    transformers on the checkpoint it came from."""
    hf = write_tiny("deepseek_v2", tmp_path / "hf", **V2_LITE)
    perturb_vectors(hf)
    path = write_gguf(hf, tmp_path / "v2-lite.gguf")
    ref = _stock_logits(hf)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        spec = engine.runner.spec
        assert spec.family == "deepseek_v2" and spec.layers[1].attention.q is not None
        assert spec.layers[1].router.groups == (4, 1, 1)
        assert _within(_runner_logits(engine), ref) <= TOLERANCE
