"""Quantized GGUF files end to end against a reference that dequantizes with the gguf package and runs
stock transformers in fp32.

Tolerances, and why: ggml (llama.cpp's kernels) quantizes the activations of every product to 8 bits
(Q8_0 blocks of 32 for Q8_0/Q4_0/MXFP4 weights, Q8_K blocks of 256 for the K-quants; ~5e-3 and ~7e-3
relative per matmul, tests/test_ggml_kernels.py), which compounds over the chained matmuls of a
forward; and at a position whose router logits nearly tie, a perturbed input can pick another expert
there, a jump of order 1 in that position's logits. So: Q8_0 must give the same greedy tokens; for
every type the logits' relative error per position must be <= 3% at the median and <= 8% at the 90th
percentile, and <= 10% over all positions (measured on these models: medians 1.7-1.9%, 90th
percentiles 2.2-5.3%, overall 1.9-7.2%, the worst single positions 3-36%). 4-bit files need not give
the same greedy tokens: a 2% perturbation flips near-tied first tokens of a random model. Streamed ==
resident stays bit for bit (same kernels, same batches: tests/test_quantized_experts.py).
"""

from __future__ import annotations

import math

import gguf
import pytest
import torch
import transformers as T
from gguf import GGMLQuantizationType as Q
from tiny_gguf import perturb_vectors, round_weights, write_gguf
from tiny_models import CORPUS, write_tiny

import moestream
from moestream.bench.perplexity import model_logits, perplexity
from moestream.cache.size_classes import budget_requirements

PROMPT = [5, 17, 33, 2, 99, 41, 7, 250]
TOKENS = 32


def _reference_from_gguf(hf_dir, gguf_path):
    """Stock transformers on the HF checkpoint, its experts replaced by the GGUF's experts as the gguf
    package reads and dequantizes them (qwen3_moe: gate_up_proj [E, 2I, H] = gate rows then up rows)."""
    model = T.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    with torch.no_grad():
        for layer, block in enumerate(model.model.layers):
            experts = block.mlp.experts

            def value(kind, layer=layer):
                t = tensors[f"blk.{layer}.ffn_{kind}_exps.weight"]
                return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())

            experts.gate_up_proj.copy_(torch.cat([value("gate"), value("up")], dim=1))
            experts.down_proj.copy_(value("down"))
    return model


def _compare(path, reference, same_tokens: bool, **load):
    full = reference.generate(
        torch.tensor([PROMPT]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False
    )
    with torch.inference_mode():
        ref_logits = reference(full).logits[0]
    with moestream.load(str(path), cache="1MiB", **load) as engine:
        engine.restream(cache=budget_requirements(engine.emap, engine.top_k)[0])  # the smallest budget
        gen = engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True)
        with torch.inference_mode():
            logits = engine.model(full).logits[0]
        assert engine.cache.stats.misses > len(engine.emap.units)  # streamed through a small cache
    if same_tokens:
        assert gen.tokens == full[0, len(PROMPT) :].tolist()
    per_position = (logits - ref_logits).norm(dim=-1) / ref_logits.norm(dim=-1)
    assert per_position.median().item() <= 0.03, per_position
    assert per_position.quantile(0.9).item() <= 0.08, per_position
    assert ((logits - ref_logits).norm() / ref_logits.norm()).item() <= 0.1
    return gen


def test_q8_0_file_gives_the_greedy_tokens_of_its_dequantized_weights(tmp_path):
    hf = write_tiny("qwen3_moe", tmp_path / "hf")
    perturb_vectors(hf)
    round_weights(hf, Q.Q8_0, lambda key: ".mlp.gate." not in key)  # routers stay F32 in every GGUF
    path = write_gguf(hf, tmp_path / "model-Q8_0.gguf", ftype=Q.Q8_0, expert_type=lambda layer, kind: Q.Q8_0)
    reference = T.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    _compare(path, reference, same_tokens=True)


def _q4_k_m(layer: int, kind: str) -> Q:
    return Q.Q6_K if kind == "down" and layer == 0 else Q.Q4_K


@pytest.mark.parametrize(
    "expert_type",
    [_q4_k_m, lambda layer, kind: Q.MXFP4, lambda layer, kind: Q.Q4_0],
    ids=["Q4_K_M", "MXFP4", "Q4_0"],
)
def test_4_bit_experts_follow_the_dequantized_reference(tmp_path, expert_type):
    hf = write_tiny("qwen3_moe", tmp_path / "hf", hidden_size=256, moe_intermediate_size=256)
    perturb_vectors(hf)
    path = write_gguf(hf, tmp_path / "model.gguf", expert_type=expert_type)  # trunk F32
    _compare(path, _reference_from_gguf(hf, path), same_tokens=False)


def test_perplexity_is_identical_across_budgets_and_io_modes(tmp_path):
    hf = write_tiny("qwen3_moe", tmp_path / "hf", hidden_size=256, moe_intermediate_size=256)
    perturb_vectors(hf)
    round_weights(hf, Q.Q8_0, lambda key: ".experts." not in key and ".mlp.gate." not in key)
    path = write_gguf(hf, tmp_path / "model.gguf", ftype=Q.Q8_0, expert_type=_q4_k_m)
    seen = []
    with moestream.load(str(path), cache="64MiB", threads=1) as engine:
        ids = engine.encode(" ".join(CORPUS * 4))
        minimum, _ = budget_requirements(engine.emap, engine.top_k)
        everything = engine.cache.slot_bytes * len(engine.emap.units)
        for budget in (minimum, everything):
            for io_mode in ("direct", "pagecache", "mmap"):
                engine.restream(cache=budget, io_mode=io_mode)
                seen.append(perplexity(model_logits(engine.model), ids, 32, 4).perplexity)
    assert math.isfinite(seen[0]) and seen[0] > 1.0
    assert seen == [seen[0]] * len(seen)  # bit for bit: the same kernels on the same bytes


def test_mode_line_names_the_formats_and_the_ggml_build(tmp_path):
    hf = write_tiny("qwen3_moe", tmp_path / "hf", hidden_size=256, moe_intermediate_size=256)
    path = write_gguf(hf, tmp_path / "model.gguf", ftype=Q.Q8_0, expert_type=_q4_k_m)
    with moestream.load(str(path), cache="1MiB") as engine:
        line = engine.mode_line()
    assert "Q6_K (down)" in line and "Q4_K (gate, up, down)" in line  # down: Q6_K in layer 0, Q4_K in 1
    assert "by ggml 0." in line


@pytest.mark.parametrize(
    "arch, sizes, expert_type",
    [
        ("qwen3_moe", {"hidden_size": 256, "moe_intermediate_size": 256}, _q4_k_m),
        ("gpt_oss", {}, lambda layer, kind: Q.Q8_0),  # biases and the clamped SwiGLU, per expert
    ],
)
def test_a_cached_layer_is_one_batch_with_the_bits_of_the_stages(arch, sizes, expert_type, tmp_path):
    """One token whose experts are all cached: each layer's experts are computed as one batch (one ggml
    compute per matrix kind, `linear_experts`), bit for bit what the per-expert stages give (and what
    streaming gives)."""
    hf = write_tiny(arch, tmp_path / "hf", **sizes)
    perturb_vectors(hf)
    path = write_gguf(hf, tmp_path / "model.gguf", ftype=Q.Q8_0, expert_type=expert_type)
    # the transformers path's batches (the ggml graphs compute cached experts in their own graph)
    with moestream.load(str(path), cache="64MiB", threads=1, trunk="eager") as engine:
        runtime = engine.runtime
        with torch.inference_mode():
            engine.model(torch.arange(64).view(1, -1) % 300)  # prefill: reads every expert
            ids = torch.tensor([[17]])
            before = runtime.layer_calls
            one_call = engine.model(ids).logits
            assert runtime.layer_calls - before == len(engine.emap.layers)  # every layer one batch
            for plan in runtime.plans.values():
                plan.batched = False  # every expert through its stages, one by one
            stages = engine.model(ids).logits
            assert runtime.layer_calls - before == len(engine.emap.layers)
        assert engine.cache.stats.misses == len(engine.emap.units)  # nothing read twice
    assert torch.equal(one_call, stages)
