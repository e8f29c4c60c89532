"""The GGUF quant mixes against an independent table of what llama.cpp's llama-quantize decides.

The expected types below are written out by hand from src/llama-quant.cpp (llama_tensor_get_type_impl,
tensor_type_fallback, tensor_allows_quantization) and convert_hf_to_gguf.py (F32 norms and router),
not computed with moestream's rules.
"""

from __future__ import annotations

import pytest

from moestream.errors import MoestreamError
from moestream.synth.gguf_quant import loader_order, normalize_quant, tensor_types

# layers use_more_bits picks, listed by hand: i < n/8, i >= 7n/8, (i - n/8) % 3 == 2
MORE_BITS = {
    1: {0},
    2: {1},
    4: {2, 3},
    8: {0, 3, 6, 7},
    24: {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23},
    48: {0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47},
}


def qwen3moe_tensors(
    n_layer: int, n_expert: int, hidden: int = 2048, inter: int = 768, vocab: int = 1024
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, ne) of a qwen3moe GGUF: 32 heads of 128, 4 kv heads."""
    out = [
        ("token_embd.weight", (hidden, vocab)),
        ("output_norm.weight", (hidden,)),
        ("output.weight", (hidden, vocab)),
    ]
    for i in range(n_layer):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", (hidden,)),
            (p + "attn_q.weight", (hidden, 4096)),
            (p + "attn_k.weight", (hidden, 512)),
            (p + "attn_v.weight", (hidden, 512)),
            (p + "attn_output.weight", (4096, hidden)),
            (p + "attn_q_norm.weight", (128,)),
            (p + "attn_k_norm.weight", (128,)),
            (p + "ffn_norm.weight", (hidden,)),
            (p + "ffn_gate_inp.weight", (hidden, n_expert)),
            (p + "ffn_gate_exps.weight", (hidden, inter, n_expert)),
            (p + "ffn_up_exps.weight", (hidden, inter, n_expert)),
            (p + "ffn_down_exps.weight", (inter, hidden, n_expert)),
        ]
    return out


F32 = ("output_norm", "attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate_inp")


def expected(quant: str, n_layer: int, n_expert: int, name: str) -> str:
    """The hand-written table: tensor name -> type for a qwen3moe at the default shapes."""
    short = name.split(".")[-2]
    if short in F32 or name.endswith(".bias") or short == "ffn_gate_inp_shexp":
        return "F32"
    if short.endswith("_shexp"):  # a shared expert: 2-D, so MXFP4_MOE leaves it Q8_0
        base = name.replace("_shexp", "_exps")
        return "Q8_0" if quant == "MXFP4_MOE" else expected(quant, n_layer, n_expert, base)
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    more = layer in MORE_BITS[n_layer]
    eight = n_expert == 8
    table = {
        "Q4_K_M": {
            "output": "Q6_K",
            "token_embd": "Q4_K",
            "attn_q": "Q4_K",
            "attn_k": "Q8_0" if eight else "Q4_K",
            "attn_v": "Q8_0" if eight else ("Q6_K" if more else "Q4_K"),
            "attn_output": "Q5_K" if eight else "Q4_K",
            "ffn_gate_exps": "Q4_K",
            "ffn_up_exps": "Q4_K",
            "ffn_down_exps": "Q6_K" if more else "Q4_K",
        },
        "Q5_K_M": {
            "output": "Q6_K",
            "token_embd": "Q5_K",
            "attn_q": "Q5_K",
            "attn_k": "Q8_0" if eight else "Q5_K",
            "attn_v": "Q8_0" if eight else ("Q6_K" if more else "Q5_K"),
            "attn_output": "Q5_K",
            "ffn_gate_exps": "Q5_K",
            "ffn_up_exps": "Q5_K",
            "ffn_down_exps": "Q6_K" if more else "Q5_K",
        },
        "Q8_0": dict.fromkeys(
            ("output", "token_embd", "attn_q", "attn_k", "attn_v", "attn_output")
            + ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
            "Q8_0",
        ),
        "MXFP4_MOE": {
            **dict.fromkeys(("output", "token_embd", "attn_q", "attn_k", "attn_v", "attn_output"), "Q8_0"),
            **dict.fromkeys(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), "MXFP4"),
        },
        "BF16": dict.fromkeys(
            ("output", "token_embd", "attn_q", "attn_k", "attn_v", "attn_output")
            + ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
            "BF16",
        ),
    }
    return table[quant][short]


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q5_K_M", "Q8_0", "MXFP4_MOE", "BF16"])
@pytest.mark.parametrize("n_layer,n_expert", [(24, 128), (48, 128), (8, 8), (8, 16), (4, 8), (2, 8)])
def test_every_tensor_gets_llama_quantizes_type(quant, n_layer, n_expert):
    tensors = qwen3moe_tensors(n_layer, n_expert)
    got = tensor_types(tensors, quant, n_layer, n_expert)
    assert set(got) == {n for n, _ in tensors}
    wrong = {n: (t, expected(quant, n_layer, n_expert, n)) for n, t in got.items()}
    wrong = {n: v for n, v in wrong.items() if v[0] != v[1]}
    assert not wrong


def qwen2moe_tensors(n_layer: int, n_expert: int, hidden: int = 2048) -> list[tuple[str, tuple[int, ...]]]:
    """(name, ne) of a qwen2moe GGUF: attention biases, a gated shared expert, no q/k norms."""
    no_qk_norm = ("attn_q_norm.weight", "attn_k_norm.weight")
    out = [(n, ne) for n, ne in qwen3moe_tensors(n_layer, n_expert, hidden) if not n.endswith(no_qk_norm)]
    for i in range(n_layer):
        p = f"blk.{i}."
        out += [(p + f"attn_{x}.bias", (w,)) for x, w in (("q", 4096), ("k", 512), ("v", 512))]
        out += [
            (p + "ffn_gate_inp_shexp.weight", (hidden, 1)),  # [1, hidden] on disk: a 1-D tensor to ggml
            (p + "ffn_gate_shexp.weight", (hidden, 5632)),
            (p + "ffn_up_shexp.weight", (hidden, 5632)),
            (p + "ffn_down_shexp.weight", (5632, hidden)),
        ]
    return out


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q5_K_M", "Q8_0", "MXFP4_MOE"])
def test_shared_experts_follow_the_same_rules(quant):
    # Qwen1.5-MoE-A2.7B's shape: 24 layers x 60 experts, shared expert 5632 wide (22 x 256)
    tensors = qwen2moe_tensors(24, 60)
    got = tensor_types(tensors, quant, 24, 60)
    assert {n: t for n, t in got.items() if t != expected(quant, 24, 60, n)} == {}


def test_qwen3_30b_q4_k_m_has_half_its_down_projections_in_q6_k():
    got = tensor_types(qwen3moe_tensors(48, 128), "Q4_K_M", 48, 128)
    down = [n for n, t in got.items() if n.endswith("ffn_down_exps.weight") and t == "Q6_K"]
    assert len(down) == 24  # the mix the Qwen3-30B-A3B Q4_K_M files on the Hub have


def test_rows_that_do_not_fit_the_block_fall_back_like_llama_quantize():
    # gpt-oss-like row lengths: 2880 = 11.25 x 256 but 90 x 32
    tensors = qwen3moe_tensors(2, 16, hidden=2880, inter=2880)
    got = tensor_types(tensors, "Q4_K_M", 2, 16)
    assert got["output.weight"] == "Q8_0"  # output: ne[0] % 256 != 0 -> Q8_0 before the fallback
    assert got["token_embd.weight"] == "Q5_0"  # Q4_K -> Q5_0
    assert got["blk.0.ffn_down_exps.weight"] == "Q5_0"
    assert got["blk.1.ffn_down_exps.weight"] == "Q8_0"  # Q6_K -> Q8_0
    assert got["blk.1.attn_v.weight"] == "Q8_0"
    got5 = tensor_types(tensors, "Q5_K_M", 2, 16)
    assert got5["blk.0.ffn_gate_exps.weight"] == "Q5_1"  # Q5_K -> Q5_1
    odd = [("token_embd.weight", (100, 64)), ("output.weight", (100, 64))]
    assert tensor_types(odd, "Q8_0", 1, 16) == {"token_embd.weight": "F16", "output.weight": "F16"}


def test_tied_embeddings_take_the_output_type():
    tensors = [t for t in qwen3moe_tensors(2, 16) if t[0] != "output.weight"]
    assert tensor_types(tensors, "Q4_K_M", 2, 16)["token_embd.weight"] == "Q6_K"


def test_loader_order_sorts_blocks_numerically():
    names = ["blk.10.a", "blk.2.b", "output.weight", "blk.2.a", "token_embd.weight"]
    assert loader_order(names) == ["output.weight", "token_embd.weight", "blk.2.a", "blk.2.b", "blk.10.a"]


def test_unknown_quant_is_one_sentence():
    assert normalize_quant("q4_k_m") == "Q4_K_M"
    with pytest.raises(MoestreamError, match="unknown GGUF quantization 'Q3_K_S'"):
        normalize_quant("Q3_K_S")
