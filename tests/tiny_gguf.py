"""Tiny GGUFs written from the tiny HF checkpoints of `tiny_models`, the way llama.cpp's converter writes
them (`convert_hf_to_gguf.py`): its metadata keys per architecture, its tensor names (gguf's
TensorNameMap, HF -> GGUF), experts stacked into `ffn_*_exps` [E, rows, cols], and the value changes it
makes (Mixtral Q/K rope permutation, DeepSeek kv_b split, Qwen3-Next/3.5 norm + 1, -exp(A_log),
qkvz split and value-head reorder, gpt-oss gate/up de-interleaving). Independent of moestream's reader:
this is the other side of the round trip.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file
from tiny_models import ARCHS
from transformers import AutoConfig, AutoTokenizer

from moestream.store.gguf_tokenizer import NEEDS, transformers_builds_gguf_tokenizers

ARCH = {
    "qwen3_moe": "QWEN3MOE",
    "qwen2_moe": "QWEN2MOE",
    "olmoe": "OLMOE",
    "mixtral": "LLAMA",
    "deepseek_v2": "DEEPSEEK2",
    "deepseek_v3": "DEEPSEEK2",
    "glm4_moe": "GLM4_MOE",
    "gpt_oss": "GPT_OSS",
    "qwen3_next": "QWEN3NEXT",
    "qwen3_5_moe_text": "QWEN35MOE",
}
_F32_ALWAYS = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".ssm_conv1d.weight")
ExpertType = Callable[[int, str], Q]  # (layer, "gate" | "up" | "down") -> stored type
# Architectures the tests write as GGUF (gpt_oss_mxfp4 is the HF MXFP4 layout of gpt_oss)
GGUF_ARCHS = [arch for arch in ARCHS if arch != "gpt_oss_mxfp4"]
# Tiny configs changed to what the real checkpoints of a family have and llama.cpp relies on:
# DeepSeek's MLA has a K/V per head (the converter splits kv_b per head); Qwen3.5 files state their
# mrope sections (llama.cpp writes [11, 11, 10] when absent, which the tiny head size cannot take).
OVERRIDES = {
    "deepseek_v2": {"num_key_value_heads": 4},
    "deepseek_v3": {"num_key_value_heads": 4},
    "qwen3_5_moe": {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        }
    },
}
# f16 scale fields of ggml blocks gguf.quants cannot quantize: byte offsets inside one block
_BLOCK_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,)}


def perturb_vectors(hf_dir: Path, seed: int = 0) -> None:
    """Give every 1-D tensor of a tiny checkpoint random values (norms, biases, A_log, dt_bias, sinks):
    transformers initialises many of them to 0 or 1, where a transform not undone could hide."""
    path = hf_dir / "model.safetensors"
    sd, g = load_file(path), torch.Generator().manual_seed(seed)
    for key, value in sd.items():
        if value.dim() == 1 and value.is_floating_point():
            sd[key] = value + 0.1 * torch.randn(value.shape, generator=g, dtype=value.dtype)
    save_file(sd, path, metadata={"format": "pt"})


def round_weights(hf_dir: Path, qtype: Q, select: Callable[[str], bool] = lambda key: True) -> None:
    """Round the selected matrices of a checkpoint through `qtype` (gguf.quants, stored back in float32):
    the weights a GGUF of that type holds exactly."""
    path = hf_dir / "model.safetensors"
    sd = load_file(path)
    for key, value in sd.items():
        if value.dim() >= 2 and select(key):
            array = value.float().numpy()
            sd[key] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype))
    save_file(sd, path, metadata={"format": "pt"})


def synthetic_blocks(shape: tuple[int, ...], qtype: Q, seed: int) -> np.ndarray:
    """Random but valid ggml blocks of a type gguf.quants cannot quantize (finite f16 scales), as the
    byte array a GGUF stores: [..., cols / block * block_bytes] uint8."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    n_blocks = int(np.prod(shape)) // block
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for offset in _BLOCK_SCALES[qtype]:
        scale = rng.uniform(1e-3, 1e-2, size=n_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block * block_bytes)


def write_gguf(
    hf_dir: Path,
    out: Path,
    ftype: Q = Q.F32,
    expert_type: ExpertType | None = None,
    split_max_tensors: int = 0,
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write `hf_dir` as a GGUF at `out`: 2-D weights in `ftype` (1-D, norms, routers in F32, as the
    converter does), experts in `expert_type(layer, kind)` when given, `extra` tensors (GGUF names)
    added as they are. Returns the first file. Skips the test where moestream refuses GGUF files
    (transformers 5.17: test_gguf_files.py::test_transformers_5_17_is_told_to_upgrade)."""
    if not transformers_builds_gguf_tokenizers():
        pytest.skip(NEEDS)
    cfg = AutoConfig.from_pretrained(hf_dir)
    arch = getattr(gguf.MODEL_ARCH, ARCH[cfg.model_type])
    blocks = cfg.num_hidden_layers + _mtp_layers(cfg)
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch], split_max_tensors=split_max_tensors)
    _metadata(writer, cfg, blocks)
    _vocab(writer, hf_dir, cfg.vocab_size)
    names = gguf.get_tensor_name_map(arch, blocks)
    for name, data in _tensors(cfg, load_file(hf_dir / "model.safetensors")):
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new_name is not None, name
        _add(writer, new_name, data, ftype, expert_type)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(out)[0]


def _mtp_layers(cfg) -> int:
    if cfg.model_type in ("glm4_moe",):
        return getattr(cfg, "num_nextn_predict_layers", 0)
    return 0


# --- metadata --------------------------------------------------------------------------------------


def _metadata(w: gguf.GGUFWriter, cfg, blocks: int) -> None:
    """TextModel.set_gguf_parameters, then the architecture's own keys."""
    w.add_block_count(blocks)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if getattr(cfg, "intermediate_size", None) is not None:
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1 if cfg.model_type.startswith("deepseek") else cfg.num_key_value_heads)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    if "mrope_section" in rope:
        w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0, 0, 0, 0])[:4])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    counts = ("num_local_experts", "num_experts", "n_routed_experts")
    experts = next(getattr(cfg, k) for k in counts if hasattr(cfg, k))
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "n_group", None) is not None:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    if getattr(cfg, "head_dim", None) is not None and not cfg.model_type.startswith("deepseek"):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _ARCH_METADATA[cfg.model_type](w, cfg, blocks)


def _meta_qwen2moe(w, cfg, blocks):
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None) is not None:
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _meta_llama(w, cfg, blocks):
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads)


def _meta_deepseek2(w, cfg, blocks):
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)


def _meta_glm4moe(w, cfg, blocks):
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.5)))
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_nextn_predict_layers(cfg.num_nextn_predict_layers)


def _meta_gpt_oss(w, cfg, blocks):
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)


def _meta_qwen3next(w, cfg, blocks):
    _meta_qwen2moe(w, cfg, blocks)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_array(f"{w.arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg.layer_types])
    w.add_full_attention_interval(getattr(cfg, "full_attention_interval", 4))
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.25)))


_ARCH_METADATA = {
    "qwen3_moe": _meta_qwen2moe,
    "qwen2_moe": _meta_qwen2moe,
    "olmoe": lambda w, cfg, blocks: None,
    "mixtral": _meta_llama,
    "deepseek_v2": _meta_deepseek2,
    "deepseek_v3": _meta_deepseek2,
    "glm4_moe": _meta_glm4moe,
    "gpt_oss": _meta_gpt_oss,
    "qwen3_next": _meta_qwen3next,
    "qwen3_5_moe_text": _meta_qwen3next,
}


def _vocab(w: gguf.GGUFWriter, hf_dir: Path, vocab_size: int) -> None:
    """TextModel._set_vocab_gpt2: every id up to the model's vocabulary, specials marked CONTROL."""
    tok = AutoTokenizer.from_pretrained(hf_dir)
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added, decoder = tok.get_added_vocab(), tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(reverse[i])
        special = reverse[i] in added and (decoder[i].special or reverse[i].startswith("<|"))
        types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    # the converter names the split regex the HF tokenizer (as transformers loads it) uses: Qwen3.5's
    # own class for a Qwen3.5 checkpoint, GPT-2's byte-level one otherwise
    w.add_tokenizer_pre("qwen35" if type(tok).__name__ == "Qwen3_5Tokenizer" else "gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=True).add_to_gguf(w)


# --- tensors ---------------------------------------------------------------------------------------


def _tensors(cfg, sd: dict[str, torch.Tensor]):
    """(HF-side name, tensor) pairs as the converter hands them to its name table."""
    sd = {k.replace("language_model.", ""): v.float() for k, v in sd.items()}
    sd = {k.replace("e_score_correction_bias", "e_score_correction.bias"): v for k, v in sd.items()}
    if cfg.model_type == "gpt_oss":
        yield from _gpt_oss(sd)
        return
    if cfg.model_type == "mixtral":
        sd = _mixtral(cfg, sd)
    if cfg.model_type in ("qwen3_next", "qwen3_5_moe_text"):
        sd = _qwen3next(cfg, sd)
    if cfg.model_type.startswith("deepseek"):
        sd = _deepseek(cfg, sd)
    yield from _stack_experts(cfg, sd).items()


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """LlamaModel.permute: rotate-half pairs -> interleaved pairs, per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _mixtral(cfg, sd):
    out = {}
    for k, v in sd.items():
        if k.endswith(("q_proj.weight", "q_proj.bias")):
            v = _permute(v, cfg.num_attention_heads)
        elif k.endswith(("k_proj.weight", "k_proj.bias")):
            v = _permute(v, cfg.num_key_value_heads)
        k = k.replace("block_sparse_moe.experts.", "mlp.experts.")
        for old, new in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
            k = k.replace(f".{old}.weight", f".{new}.weight") if ".mlp.experts." in k else k
        out[k] = v
    return out


def _deepseek(cfg, sd):
    out = {}
    for k, v in sd.items():
        if not k.endswith("kv_b_proj.weight"):
            out[k] = v
            continue
        heads, nope, vd = cfg.num_key_value_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        kv_b = v.view(heads, vd + nope, v.shape[-1])
        k_b, v_b = torch.split(kv_b, [nope, vd], dim=1)
        out[k.replace("kv_b_proj", "k_b_proj")] = k_b.transpose(1, 2).contiguous()
        out[k.replace("kv_b_proj", "v_b_proj")] = v_b.contiguous()
    return out


def _reorder_v(t: torch.Tensor, dim: int, nk: int, r: int, hd: int) -> torch.Tensor:
    """_LinearAttentionVReorderBase._reorder_v_heads: grouped [nk, r, hd] -> tiled [r, nk, hd]."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], nk, r, hd, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def _qwen3next(cfg, sd):
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    qwen35, out = cfg.model_type == "qwen3_5_moe_text", {}
    for k, v in sd.items():
        if qwen35 and "linear_attn." in k and nk != nv:
            if ".in_proj_qkv." in k:
                v = torch.cat([v[: 2 * nk * dk], _reorder_v(v[2 * nk * dk :], 0, nk, r, dv)])
            elif ".in_proj_z." in k:
                v = _reorder_v(v, 0, nk, r, dv)
            elif ".in_proj_a." in k or ".in_proj_b." in k or k.endswith((".A_log", ".dt_bias")):
                v = _reorder_v(v, 0, nk, r, 1)
            elif ".conv1d." in k:
                v = v.squeeze()
                v = torch.cat([v[: 2 * nk * dk], _reorder_v(v[2 * nk * dk :], 0, nk, r, dv)])
            elif ".out_proj." in k:
                v = _reorder_v(v, 1, nk, r, dv)
        if k.endswith(".A_log"):
            v = -torch.exp(v)
        elif k.endswith(".dt_bias"):
            k = k.replace(".dt_bias", ".dt_proj.bias")
        elif "conv1d" in k:
            v = v.squeeze()
        elif k.endswith("norm.weight") and not k.endswith("linear_attn.norm.weight"):
            v = v + 1
        if "in_proj_qkvz.weight" in k:  # [q, k, v, z] per key head -> [q all, k all, v all] and [z all]
            parts = torch.split(v.reshape(nk, -1, v.shape[-1]), [dk, dk, r * dv, r * dv], dim=1)
            q, kk, vv, z = (p.reshape(-1, v.shape[-1]) for p in parts)
            out[k.replace("in_proj_qkvz", "in_proj_qkv")] = torch.cat([q, kk, vv])
            out[k.replace("in_proj_qkvz", "in_proj_z")] = z
            continue
        out[k] = v
    return out


def _stack_experts(cfg, sd):
    """Per-expert tensors -> one [E, rows, cols] tensor per (layer, kind); fused gate_up split in two."""
    out, stacks = {}, {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H], gate rows first
            half = v.shape[1] // 2
            out[k.replace("gate_up_proj", "gate_proj.weight")] = v[:, :half]
            out[k.replace("gate_up_proj", "up_proj.weight")] = v[:, half:]
        elif k.endswith("mlp.experts.down_proj"):
            out[k + ".weight"] = v
        elif ".mlp.experts." in k:
            pre, rest = k.split(".mlp.experts.")
            e, kind = rest.split(".", 1)
            stacks.setdefault(f"{pre}.mlp.experts.{kind}", {})[int(e)] = v
        else:
            out[k] = v
    for name, per_expert in stacks.items():
        out[name] = torch.stack([per_expert[e] for e in sorted(per_expert)])
    return out


def _gpt_oss(sd):
    """GptOssModel.modify_tensors for bf16/f32 experts: gate/up de-interleaved, both transposed."""
    for k, v in sd.items():
        if "sinks" in k:
            yield k + ".weight", v
        elif k.endswith("gate_up_proj_bias"):
            yield k.replace("gate_up_proj_bias", "gate_proj.bias"), v[..., ::2]
            yield k.replace("gate_up_proj_bias", "up_proj.bias"), v[..., 1::2]
        elif k.endswith("down_proj_bias"):
            yield k.replace("down_proj_bias", "down_proj.bias"), v
        elif k.endswith("gate_up_proj"):
            v = v.transpose(-1, -2)
            yield k.replace("gate_up_proj", "gate_proj.weight"), v[:, ::2, :]
            yield k.replace("gate_up_proj", "up_proj.weight"), v[:, 1::2, :]
        elif k.endswith("experts.down_proj"):
            yield k.replace("down_proj", "down_proj.weight"), v.transpose(-1, -2)
        else:
            yield k, v


def _add(w: gguf.GGUFWriter, name: str, data: torch.Tensor, ftype: Q, expert_type: ExpertType | None) -> None:
    """prepare_tensors' type rules, then the tensor quantized with gguf.quants."""
    array = data.contiguous().numpy().astype(np.float32)
    qtype = ftype
    if array.ndim <= 1 or name.endswith(("_norm.weight", *_F32_ALWAYS)) or not name.endswith(".weight"):
        qtype = Q.F32
    if expert_type is not None and "_exps.weight" in name:
        layer, kind = int(name.split(".")[1]), name.split(".")[2].removeprefix("ffn_").removesuffix("_exps")
        qtype = expert_type(layer, kind)
    if qtype in (Q.F32, Q.F16, Q.I32):
        w.add_tensor(name, array.astype({Q.F32: np.float32, Q.F16: np.float16, Q.I32: np.int32}[qtype]))
    elif qtype in _BLOCK_SCALES:
        w.add_tensor(name, synthetic_blocks(array.shape, qtype, seed=len(w.tensors[-1])), raw_dtype=qtype)
    elif array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:  # the converter falls back to F16 then
        w.add_tensor(name, array.astype(np.float16))  # (DeepSeek's attn_k_b, rows of qk_nope_head_dim)
    else:
        w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def hf_config_json(hf_dir: Path) -> dict:
    return json.loads((hf_dir / "config.json").read_text())


def q4k_all_routed(root: Path) -> Path:
    """A tiny qwen2_moe GGUF under `root`, every matrix Q4_K (256-wide rows: hidden, heads x head_dim, the
    experts' and the shared expert's intermediate), 4 experts all routed (top-k = experts), 2 layers: a
    step of T rows hands each expert T rows."""
    from tiny_models import write_tiny

    hf = write_tiny(
        "qwen2_moe",
        root / "hf",
        experts=4,
        top_k=4,
        hidden_size=256,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        head_dim=64,
        num_hidden_layers=2,
    )
    perturb_vectors(hf)
    return write_gguf(hf, root / "model.gguf", ftype=Q.Q4_K, expert_type=lambda layer, kind: Q.Q4_K)
