"""Build the genuine transformers config of a SynthSpec, with the config class of its architecture.

Each architecture gets the keyword arguments of its config class; sizes that the issue does not name
(dense MLP width, MLA ranks, linear-attention heads) follow the ratios of the real checkpoints of the
family. Only the routed experts must match the spec exactly: they are what moestream streams.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moestream.synth.shapes import SynthSpec, with_attention_shape

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# shared experts per MoE layer for the DeepSeek/GLM families (DeepSeek-V2: 2, V3 and GLM-4.5: 1)
_N_SHARED = {"deepseek_v2": 2, "deepseek_v3": 1, "glm4_moe": 1}
# config.json "architectures": what the real checkpoints declare
_VLM_ARCHITECTURE = {"qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def build_config(spec: SynthSpec, vocab_size: int, eos_id: int, pad_id: int) -> PretrainedConfig:
    """The transformers config object for `spec` (dtype set), ready for `save_pretrained`."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    spec = with_attention_shape(spec)
    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": 4096,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": spec.torch_dtype_name,
    }
    kwargs.update(_ARCH_KWARGS[spec.arch](spec))
    kwargs.update(spec.extra)
    if spec.arch == "qwen3_5_moe":
        return _qwen3_5_composite(transformers, kwargs, spec)
    cfg = CONFIG_MAPPING[spec.arch](**kwargs)
    cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[spec.arch]]
    if spec.mxfp4:
        cfg.quantization_config = mxfp4_quantization_config()
    return cfg


def mxfp4_quantization_config() -> dict[str, Any]:
    """config.json `quantization_config` of gpt-oss: MXFP4 experts, everything else unquantized."""
    from transformers import Mxfp4Config

    keep = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    return Mxfp4Config(modules_to_not_convert=keep).to_dict()


def _qwen3_5_composite(transformers: Any, text_kwargs: dict[str, Any], spec: SynthSpec) -> PretrainedConfig:
    """Qwen3.5-MoE ships a composite (vision + text) config; its text model loads as a CausalLM."""
    text = transformers.Qwen3_5MoeTextConfig(**text_kwargs)
    cfg = transformers.Qwen3_5MoeConfig(text_config=text.to_dict(), dtype=spec.torch_dtype_name)
    cfg.architectures = [_VLM_ARCHITECTURE["qwen3_5_moe"]]
    return cfg


def _qwen3_moe(s: SynthSpec) -> dict[str, Any]:
    return {
        "head_dim": s.head_dim,
        "intermediate_size": 4 * s.moe_intermediate,
        "moe_intermediate_size": s.moe_intermediate,
        "num_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "norm_topk_prob": True,
    }


def _qwen2_moe(s: SynthSpec) -> dict[str, Any]:
    # Qwen1.5-MoE-A2.7B: shared expert 4x the routed expert width, no top-k renormalisation
    return {
        "intermediate_size": 4 * s.moe_intermediate,
        "moe_intermediate_size": s.moe_intermediate,
        "shared_expert_intermediate_size": 4 * s.moe_intermediate,
        "num_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "norm_topk_prob": False,
    }


def _mixtral(s: SynthSpec) -> dict[str, Any]:
    return {
        "head_dim": s.head_dim,
        "intermediate_size": s.moe_intermediate,
        "num_local_experts": s.experts,
        "num_experts_per_tok": s.top_k,
    }


def _olmoe(s: SynthSpec) -> dict[str, Any]:
    return {
        "intermediate_size": s.moe_intermediate,
        "num_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "norm_topk_prob": False,
    }


def _deepseek(s: SynthSpec) -> dict[str, Any]:
    """DeepSeek-V2/V3 with MLA ranks in V3's proportions to the head size (128 -> 512/1536)."""
    hd = s.head_dim or 64
    kwargs = {
        "intermediate_size": 4 * s.moe_intermediate,
        "moe_intermediate_size": s.moe_intermediate,
        "n_routed_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "n_shared_experts": _N_SHARED[s.arch],
        "first_k_dense_replace": 1 if s.layers > 1 else 0,
        "num_key_value_heads": s.heads,
        "kv_lora_rank": 4 * hd,
        "q_lora_rank": 12 * hd,
        "qk_rope_head_dim": hd // 2,
        "qk_nope_head_dim": hd,
        "v_head_dim": hd,
    }
    if s.arch == "deepseek_v2":
        kwargs.update(head_dim=hd // 2, n_group=1, topk_group=1, topk_method="greedy")
    else:
        kwargs.update(_expert_groups(s))
    return kwargs


def _expert_groups(s: SynthSpec) -> dict[str, int]:
    """DeepSeek-V3 routes within the best 4 of 8 expert groups when the expert count allows it."""
    if s.experts % 8 == 0 and s.experts >= 64 and 4 * (s.experts // 8) >= s.top_k:
        return {"n_group": 8, "topk_group": 4}
    return {"n_group": 1, "topk_group": 1}


def _glm4_moe(s: SynthSpec) -> dict[str, Any]:
    return {
        "head_dim": s.head_dim,
        "intermediate_size": 4 * s.moe_intermediate,
        "moe_intermediate_size": s.moe_intermediate,
        "n_routed_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "n_shared_experts": _N_SHARED["glm4_moe"],
        "first_k_dense_replace": 1 if s.layers > 1 else 0,
        "n_group": 1,
        "topk_group": 1,
        "use_qk_norm": True,
    }


def _qwen3_linear(s: SynthSpec) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5: gated-delta-net layers (3 of every 4) plus a shared expert."""
    hd = s.head_dim or 64
    key_heads = max(1, (s.heads or 2) // 2)
    kwargs = {
        "head_dim": hd,
        "moe_intermediate_size": s.moe_intermediate,
        "shared_expert_intermediate_size": s.moe_intermediate,
        "num_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "linear_key_head_dim": hd,
        "linear_value_head_dim": hd,
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": 2 * key_heads,
    }
    if s.arch == "qwen3_next":
        kwargs.update(intermediate_size=4 * s.moe_intermediate, norm_topk_prob=True)
    return kwargs


def _gpt_oss(s: SynthSpec) -> dict[str, Any]:
    return {
        "head_dim": s.head_dim,
        "intermediate_size": s.moe_intermediate,
        "num_local_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s.layers)],
    }


_ARCH_KWARGS: dict[str, Callable[[SynthSpec], dict[str, Any]]] = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "glm4_moe": _glm4_moe,
    "qwen3_next": _qwen3_linear,
    "qwen3_5_moe": _qwen3_linear,
    "gpt_oss": _gpt_oss,
}
