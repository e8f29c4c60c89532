"""A transformers config from GGUF metadata, for every MoE architecture llama.cpp writes that moestream runs.

One builder per `general.architecture`, written from llama.cpp's converter (`convert_hf_to_gguf.py`:
which config field becomes which key) and its loader (`src/models/*.cpp`: the defaults a key's absence
means). transformers' own GGUF config mapping covers few MoE fields, so this table is moestream's.
What a GGUF does not carry (a value llama.cpp hard-codes for the architecture) is set to that value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moestream.errors import CheckpointError, UnsupportedModelError
from moestream.store.gguf_file import GgufFile

_REQUIRED = object()


class Meta:
    """The metadata of one GGUF, read as `{arch}.{key}`."""

    def __init__(self, gfile: GgufFile) -> None:
        self.values, self.arch, self.path = gfile.metadata, gfile.arch, gfile.path
        self.tensor_names = set(gfile.tensors)

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.values:
            return self.values[full]
        if default is _REQUIRED:
            raise CheckpointError(f"{self.path} lacks the GGUF metadata key {full}")
        return default

    def scalar(self, key: str, default: Any = _REQUIRED) -> Any:
        """A value llama.cpp allows per layer (an array): every layer's must be the same."""
        value = self.get(key, default)
        if not isinstance(value, list):
            return value
        distinct = sorted({v for v in value if v})
        if len(distinct) > 1:
            raise UnsupportedModelError(
                f"{self.arch}.{key} in {self.path} differs between layers ({distinct}), "
                "which a transformers config cannot express"
            )
        return distinct[0] if distinct else default

    def layers_with(self, leaf: str) -> list[int]:
        """Block indices that hold tensor `blk.N.{leaf}`."""
        names = (n for n in self.tensor_names if n.startswith("blk.") and n.endswith(leaf))
        return sorted(int(n.split(".")[1]) for n in names)

    def has(self, tensor: str) -> bool:
        return tensor in self.tensor_names


@dataclass(frozen=True)
class GgufArch:
    """One `general.architecture`: the transformers model_type it becomes and how its config is built."""

    name: str
    tensor_arch: str  # the gguf.MODEL_ARCH member whose tensor names the file uses
    build: Callable[[Meta], tuple[str, dict[str, Any]]]  # -> (model_type, config kwargs)


def _layers(meta: Meta) -> int:
    """Decoder layers: llama.cpp counts the multi-token-prediction blocks as layers too."""
    return int(meta.get("block_count")) - int(meta.get("nextn_predict_layers", 0))


def _rope(meta: Meta, head_dim: int | None = None) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", 10000.0))}
    rotary = meta.get("rope.dimension_count", None)
    if head_dim and rotary and rotary != head_dim:
        rope["partial_rotary_factor"] = rotary / head_dim
    kind = meta.get("rope.scaling.type", "none")
    if kind == "linear":
        rope.update(rope_type="linear", factor=float(meta.get("rope.scaling.factor")))
    elif kind == "yarn":
        rope.update(rope_type="yarn", factor=float(meta.get("rope.scaling.factor")))
        extra = {
            "original_max_position_embeddings": "rope.scaling.original_context_length",
            "beta_fast": "rope.scaling.yarn_beta_fast",
            "beta_slow": "rope.scaling.yarn_beta_slow",
            "attention_factor": "rope.scaling.yarn_attn_factor",
        }
        rope.update({k: meta.get(key) for k, key in extra.items() if meta.get(key, None) is not None})
    elif kind not in ("none", None):
        raise UnsupportedModelError(f"{meta.path} uses rope scaling {kind!r}, which moestream does not map")
    return rope


def _common(meta: Meta, head_dim: int | None = None) -> dict[str, Any]:
    heads = int(meta.scalar("attention.head_count"))
    vocab = meta.get("vocab_size", None) or meta.values.get("tokenizer.ggml.tokens")
    if not vocab:
        raise CheckpointError(f"{meta.path} states no vocabulary size (no vocab_size, no token list)")
    tokens = {
        "bos_token_id": "tokenizer.ggml.bos_token_id",
        "eos_token_id": "tokenizer.ggml.eos_token_id",
        "pad_token_id": "tokenizer.ggml.padding_token_id",
    }
    return {
        "vocab_size": int(vocab),
        "hidden_size": int(meta.get("embedding_length")),
        "num_hidden_layers": _layers(meta),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.scalar("attention.head_count_kv", heads) or heads),
        "max_position_embeddings": int(meta.get("context_length")),
        "rms_norm_eps": float(meta.get("attention.layer_norm_rms_epsilon")),
        "rope_parameters": _rope(meta, head_dim),
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": not meta.has("output.weight"),
        **{field: meta.values.get(key) for field, key in tokens.items()},
    }


def _routed(meta: Meta) -> dict[str, Any]:
    return {"num_experts_per_tok": int(meta.get("expert_used_count"))}


def _dense_layers(meta: Meta) -> list[int]:
    """Decoder layers with a dense MLP where the others route (`ffn_down` but no `ffn_gate_inp`)."""
    routed = set(meta.layers_with(".ffn_gate_inp.weight"))
    return [i for i in meta.layers_with(".ffn_down.weight") if i not in routed and i < _layers(meta)]


def _qwen_moe(meta: Meta) -> dict[str, Any]:
    """Fields qwen2moe, qwen3moe, qwen3next and qwen35moe share."""
    cfg = {**_routed(meta), "num_experts": int(meta.get("expert_count"))}
    cfg["moe_intermediate_size"] = int(meta.scalar("expert_feed_forward_length"))
    if meta.get("feed_forward_length", None):
        cfg["intermediate_size"] = int(meta.scalar("feed_forward_length"))
    if meta.get("expert_shared_feed_forward_length", None) is not None:
        cfg["shared_expert_intermediate_size"] = int(meta.get("expert_shared_feed_forward_length"))
    return cfg


def _qwen3moe(meta: Meta) -> tuple[str, dict[str, Any]]:
    head_dim = int(meta.get("attention.key_length"))
    cfg = {**_common(meta), **_qwen_moe(meta), "head_dim": head_dim}
    # llama.cpp's qwen3moe graph always renormalises the top-k weights
    cfg.update(norm_topk_prob=True, attention_bias=meta.has("blk.0.attn_q.bias"))
    cfg.update(decoder_sparse_step=1, mlp_only_layers=_dense_layers(meta))
    return "qwen3_moe", cfg


def _qwen2moe(meta: Meta) -> tuple[str, dict[str, Any]]:
    cfg = {**_common(meta), **_qwen_moe(meta)}
    # llama.cpp's qwen2moe graph does not renormalise the top-k weights
    cfg.update(norm_topk_prob=False, qkv_bias=meta.has("blk.0.attn_q.bias"))
    cfg.update(decoder_sparse_step=1, mlp_only_layers=_dense_layers(meta))
    return "qwen2_moe", cfg


def _olmoe(meta: Meta) -> tuple[str, dict[str, Any]]:
    cfg = {**_common(meta), **_routed(meta), "num_experts": int(meta.get("expert_count"))}
    cfg.update(intermediate_size=int(meta.scalar("feed_forward_length")), norm_topk_prob=False)
    cfg["attention_bias"] = meta.has("blk.0.attn_q.bias")
    return "olmoe", cfg


def _mixtral(meta: Meta) -> tuple[str, dict[str, Any]]:
    """`llama` with experts is Mixtral (Q and K are stored permuted for llama.cpp's rope; see gguf_trunk)."""
    heads = int(meta.scalar("attention.head_count"))
    head_dim = int(meta.get("attention.key_length", 0) or meta.get("rope.dimension_count", 0))
    cfg = {**_common(meta), **_routed(meta), "num_local_experts": int(meta.get("expert_count"))}
    cfg["intermediate_size"] = int(meta.scalar("feed_forward_length"))
    if head_dim and head_dim != cfg["hidden_size"] // heads:
        cfg["head_dim"] = head_dim
    return "mixtral", cfg


def _deepseek2(meta: Meta) -> tuple[str, dict[str, Any]]:
    """DeepSeek V2/V3 (MLA). llama.cpp writes MLA as MQA (head_count_kv 1): every head has its own K/V."""
    rope_dim = int(meta.get("rope.dimension_count"))
    qk_head = int(meta.get("attention.key_length_mla", 0) or meta.get("attention.key_length"))
    v_head = int(meta.get("attention.value_length_mla", 0) or meta.get("attention.value_length"))
    cfg = {**_common(meta), **_routed(meta)}
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    q_lora = meta.get("attention.q_lora_rank", None)
    cfg["kv_lora_rank"] = int(meta.get("attention.kv_lora_rank"))
    cfg["q_lora_rank"] = int(q_lora) if q_lora else None  # V2-Lite projects q directly
    cfg.update(qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk_head - rope_dim, v_head_dim=v_head)
    cfg.update(_shared_moe(meta))
    yarn_log_mul = meta.get("rope.scaling.yarn_log_multiplier", None)
    if yarn_log_mul is not None:  # the converter writes 0.1 * mscale_all_dim
        mscale = round(yarn_log_mul / 0.1, 6)
        cfg["rope_parameters"].update(mscale=mscale, mscale_all_dim=mscale)
    sigmoid = meta.get("expert_gating_func", 1) == 2 or any(".exp_probs_b." in n for n in meta.tensor_names)
    if sigmoid:  # V3: sigmoid scores with a correction bias, grouped top-k
        return "deepseek_v3", cfg
    grouped = (cfg["n_group"] or 1) > 1
    cfg["topk_method"] = "group_limited_greedy" if grouped else "greedy"
    return "deepseek_v2", cfg


def _shared_moe(meta: Meta) -> dict[str, Any]:
    """Fields deepseek2 and glm4moe share: routed and shared experts, leading dense layers, groups."""
    return {
        "n_routed_experts": int(meta.get("expert_count")),
        "n_shared_experts": int(meta.get("expert_shared_count", 0)),
        "moe_intermediate_size": int(meta.scalar("expert_feed_forward_length")),
        "intermediate_size": int(meta.scalar("feed_forward_length")),
        "first_k_dense_replace": int(meta.get("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(meta.get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(meta.get("expert_weights_norm", False)),
        "n_group": int(meta.get("expert_group_count", 1)),
        "topk_group": int(meta.get("expert_group_used_count", 1)),
    }


def _glm4moe(meta: Meta) -> tuple[str, dict[str, Any]]:
    head_dim = int(meta.get("attention.key_length"))
    cfg = {**_common(meta, head_dim), **_routed(meta), **_shared_moe(meta), "head_dim": head_dim}
    cfg.update(attention_bias=meta.has("blk.0.attn_q.bias"), use_qk_norm=meta.has("blk.0.attn_q_norm.weight"))
    cfg["num_nextn_predict_layers"] = int(meta.get("nextn_predict_layers", 0))
    return "glm4_moe", cfg


def _gpt_oss(meta: Meta) -> tuple[str, dict[str, Any]]:
    cfg = {**_common(meta), **_routed(meta), "num_local_experts": int(meta.get("expert_count"))}
    cfg.update(head_dim=int(meta.get("attention.key_length")), attention_bias=True)
    cfg["intermediate_size"] = int(meta.scalar("expert_feed_forward_length"))
    cfg["sliding_window"] = int(meta.get("attention.sliding_window"))
    cfg["layer_types"] = _sliding_layers(meta, cfg["num_hidden_layers"])
    if cfg["rope_parameters"]["rope_type"] == "yarn":  # gpt-oss's yarn does not round its ramp ends
        cfg["rope_parameters"]["truncate"] = False
    return "gpt_oss", cfg


def _sliding_layers(meta: Meta, n_layers: int) -> list[str]:
    """llama.cpp's swa pattern: an int n (layer i slides when i % n < n - 1; gpt-oss: 2) or a bool array."""
    pattern = meta.get("attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        slides = [bool(v) for v in pattern[:n_layers]]
    else:
        slides = [i % int(pattern) < int(pattern) - 1 for i in range(n_layers)]
    return ["sliding_attention" if s else "full_attention" for s in slides]


def _linear_attention(meta: Meta) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5 gated delta-net fields and which layers are linear-attention layers."""
    n_layers, value_heads = _layers(meta), int(meta.get("ssm.time_step_rank"))
    recurrent = meta.get("attention.recurrent_layers", None)
    if recurrent is None:
        interval = int(meta.get("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
    return {
        "linear_conv_kernel_dim": int(meta.get("ssm.conv_kernel")),
        "linear_key_head_dim": int(meta.get("ssm.state_size")),
        "linear_num_key_heads": int(meta.get("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(meta.get("ssm.inner_size")) // value_heads,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:n_layers]],
    }


def _qwen3next(meta: Meta) -> tuple[str, dict[str, Any]]:
    head_dim = int(meta.get("attention.key_length"))
    cfg = {**_common(meta, head_dim), **_qwen_moe(meta), **_linear_attention(meta), "head_dim": head_dim}
    cfg.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=_dense_layers(meta))
    return "qwen3_next", cfg


def _qwen35moe(meta: Meta) -> tuple[str, dict[str, Any]]:
    head_dim = int(meta.get("attention.key_length"))
    cfg = {**_common(meta, head_dim), **_qwen_moe(meta), **_linear_attention(meta), "head_dim": head_dim}
    sections = list(meta.get("rope.dimension_sections", []))[:3]  # t, h, w; llama.cpp pads to four
    if any(sections):  # text positions are the same on every axis, where interleaved mrope is plain rope
        cfg["rope_parameters"].update(mrope_section=sections, mrope_interleaved=True)
    return "qwen3_5_moe_text", cfg


ARCHS: dict[str, GgufArch] = {
    a.name: a
    for a in (
        GgufArch("qwen3moe", "QWEN3MOE", _qwen3moe),
        GgufArch("qwen2moe", "QWEN2MOE", _qwen2moe),
        GgufArch("olmoe", "OLMOE", _olmoe),
        GgufArch("llama", "LLAMA", _mixtral),
        GgufArch("deepseek2", "DEEPSEEK2", _deepseek2),
        GgufArch("glm4moe", "GLM4_MOE", _glm4moe),
        GgufArch("gpt-oss", "GPT_OSS", _gpt_oss),
        GgufArch("qwen3next", "QWEN3NEXT", _qwen3next),
        GgufArch("qwen35moe", "QWEN35MOE", _qwen35moe),
    )
}


def gguf_arch(gfile: GgufFile) -> GgufArch:
    """The table entry for a GGUF.

    Raises:
        UnsupportedModelError: a dense model (no experts) or an architecture not in the table.
    """
    meta = Meta(gfile)
    if not meta.get("expert_count", 0):
        raise UnsupportedModelError(
            f"{gfile.path} is a dense {gfile.arch or 'unknown'} model (no {gfile.arch}.expert_count); "
            "moestream streams Mixture-of-Experts models only"
        )
    if gfile.arch not in ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {gfile.arch!r} of {gfile.path} is not supported "
            f"(supported: {', '.join(sorted(ARCHS))})"
        )
    return ARCHS[gfile.arch]


def decoder_layers(gfile: GgufFile) -> int:
    """The decoder layers of a GGUF (its blocks less the multi-token-prediction ones)."""
    return _layers(Meta(gfile))


def config_kwargs(gfile: GgufFile) -> tuple[str, dict[str, Any]]:
    """(model_type, transformers config kwargs) of a GGUF."""
    return gguf_arch(gfile).build(Meta(gfile))
