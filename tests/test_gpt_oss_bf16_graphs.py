"""gpt-oss's bf16 safetensors experts computed inside the ggml graphs.

HF stores them [in, out] (gate_up [E, H, 2I] with gate and up interleaved by column, down [E, I, H]),
which ggml's products cannot take as they are (they contract each row's contiguous elements): the cache
rewrites each matrix once read as its transpose [out, in], gate_up's rows gate first (`GgmlTransposed`),
so the graphs compute them with ggml_mul_mat_id over the slots and the expert runtime a streamed one
with the same ops. ggml's BF16 product rounds the activations to bf16 (its vec_dot_type).

Oracles: the slots' bytes against the checkpoint's tensors, transposed by torch; stock transformers
fp32 (the bf16 weights upcast): logits within 4% of the largest logit (test_ggml_runner's tolerance:
the F16 KV cache, and here the bf16 activations; measured 0.33%, 0.13% with tiny gpt_oss's f32
experts), the same argmax and greedy tokens; streamed == resident bit for bit at every budget and io
mode.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_ggml_runner import (
    PROMPT,
    TOLERANCE,
    _count_runs,
    _stock_greedy,
    _stock_logits,
    _streamed_equals_resident,
)
from test_mxfp4_graphs import _count_runtime, _one_graph_a_step

import moestream
from moestream.runtime.formats.ggml import GgmlTransposed

EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


@pytest.fixture(scope="module")
def bf16_dir(tiny_dir, tmp_path_factory):
    """tiny gpt_oss with its expert matrices in bf16, as gpt-oss's bf16 checkpoints store them."""
    out = tmp_path_factory.mktemp("gpt_oss_bf16")
    shutil.copytree(tiny_dir("gpt_oss"), out, dirs_exist_ok=True)
    sd = load_file(out / "model.safetensors")
    for key in [k for k in sd if k.endswith(EXPERTS)]:
        sd[key] = sd[key].to(torch.bfloat16)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_slots_hold_the_transposed_matrices(bf16_dir):
    sd = load_file(bf16_dir / "model.safetensors")
    with moestream.load(str(bf16_dir), cache="64MiB", trunk="ggml") as engine:  # every expert read at load
        emap, cache = engine.emap, engine.cache
        assert {type(f) for f in engine.runtime.formats.values()} == {GgmlTransposed}
        for (layer, e), parts in emap.units.items():
            for kind, name in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
                stored = sd[f"model.layers.{layer}.mlp.experts.{name}"][e].T  # [out, in]
                if kind == "gate_up":  # gate (even columns), then up (odd)
                    stored = torch.cat((stored[0::2], stored[1::2]))
                ((buffer, offset, part),) = cache.tensor_parts((layer, e), kind)
                raw = bytearray(buffer.view[offset : offset + part.ref.nbytes])
                got = torch.frombuffer(raw, dtype=torch.bfloat16).view(stored.shape)
                assert torch.equal(got, stored), (layer, e, kind)


def test_bf16_experts_in_the_graphs_follow_stock(bf16_dir, monkeypatch):
    ref = _stock_logits(bf16_dir)
    greedy = _stock_greedy(bf16_dir, PROMPT, 16)
    runs = _count_runs(monkeypatch)
    calls, _ = _count_runtime(monkeypatch)
    with moestream.load(str(bf16_dir), cache="64MiB", trunk="ggml") as engine:
        assert "BF16 by ggml" in engine.mode_line()
        got = _one_graph_a_step(engine, runs, calls)
        assert engine.generate(PROMPT, max_tokens=16, ignore_eos=True).tokens == greedy
    largest = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= TOLERANCE * largest
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_bf16_experts_streamed_equal_resident(bf16_dir):
    _streamed_equals_resident(bf16_dir, fused=True)
