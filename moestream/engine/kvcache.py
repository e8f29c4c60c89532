"""How much memory transformers' KV cache takes for a context of N tokens, from the model config.

Per decoder layer, as transformers' DynamicCache stores it (a test checks these against real caches of
every supported architecture):
- full attention: keys and values, num_key_value_heads x head_dim each, per token;
- multi-head latent attention (DeepSeek): the compressed latent (kv_lora_rank) and the rope key
  (qk_rope_head_dim), one head, per token;
- sliding-window attention: as full attention, but at most sliding_window - 1 tokens;
- linear attention (Qwen3-Next, Qwen3.5): a convolution state [conv_dim, kernel] and a recurrent state
  [value heads, key head dim, value head dim] (kept in float32 whatever the model's dtype), whatever the
  context.
"""

from __future__ import annotations

from typing import Any

from moestream.model.arch import text_config


def _per_token(cfg: Any) -> int:
    """Elements one token adds to one attention layer."""
    if getattr(cfg, "kv_lora_rank", None):
        return int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim)
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * heads * int(head_dim)


def _linear_state(cfg: Any, element_bytes: int) -> int:
    """Bytes of one linear-attention layer's conv state (model dtype) and recurrent state (float32)."""
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    conv = (2 * key_dim + value_dim) * cfg.linear_conv_kernel_dim
    return (
        conv * element_bytes
        + 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    )


def kv_cache_bytes(config: Any, tokens: int, element_bytes: int) -> int:
    """Bytes of the KV cache holding `tokens` tokens, with `element_bytes` per stored element."""
    cfg = text_config(config)
    layers = int(cfg.num_hidden_layers)
    kinds = list(getattr(cfg, "layer_types", None) or ["full_attention"] * layers)[:layers]
    window = getattr(cfg, "sliding_window", None)
    total = 0
    for kind in kinds:
        if kind == "linear_attention":
            total += _linear_state(cfg, element_bytes)
        elif kind == "sliding_attention" and window:
            total += min(tokens, int(window) - 1) * _per_token(cfg) * element_bytes
        else:
            total += tokens * _per_token(cfg) * element_bytes
    return total
