"""DeepSeek V2/V3's layers as the ggml graphs need them: Multi-head Latent Attention and their routers.

Read from the modules transformers built, as `graph_spec` reads every other family (this module is its
part for deepseek_v2 and deepseek_v3). MLA keeps one latent row a token: kv_a_proj_with_mqa gives the
latent (kv_lora_rank) and one rotary key part shared by every head (qk_rope_head_dim); kv_b_proj
expands the normed latent into each head's K_nope and V. The graphs fold kv_b_proj into the query
and the attention's output instead (`engine/ggml_mla.py`): its V half as it lies (each head's rows, a
stride apart), its K half copied transposed (`k_b`), each laid out for a batched ggml_mul_mat over the
heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moestream.model.graph_parts import Matrix, Mlp, NoGraph, Router, _f32, matrix, router_matrix
from moestream.model.quantized import QuantLinear

MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
ROPE_NORM, ROPE_NEOX = 0, 2  # GGML_ROPE_TYPE_*: pairs (x0, x1), (x2, x3), ... / rotate-half pairs


@dataclass
class Mla:
    """One layer's Multi-head Latent Attention. N heads; query and key heads are nope + rope wide, the
    value heads v wide; the KV cache holds the normed latent and the rotated key part: latent + rope."""

    q: Matrix | None  # [N * (nope + rope), H] (V2-Lite), or None: q_b(norm(q_a x))
    q_a: Matrix | None  # [q_lora_rank, H]
    q_a_norm: torch.Tensor | None  # f32 [q_lora_rank]
    q_b: Matrix | None  # [N * (nope + rope), q_lora_rank]
    kv_a: Matrix  # [latent + rope, H]
    kv_norm: torch.Tensor  # f32 [latent]
    k_b: torch.Tensor  # [N, latent, nope]: kv_b_proj's K rows of each head, transposed
    kv_b: torch.Tensor  # [N * (nope + v), latent]: kv_b_proj's weight, per head its K rows then V rows
    o: Matrix  # [H, N * v]
    biases: dict[str, torch.Tensor]  # "q_a", "kv_a", "o" -> f32 [rows] (attention_bias)
    heads: int
    nope: int
    rope: int
    latent: int
    v_dim: int
    scale: float  # the softmax scale (transformers' own: YaRN's mscale squared in it)
    rope_mode: int  # ROPE_NORM (DeepSeek's interleaved pairs) or ROPE_NEOX
    window: int | None = None  # no sliding window

    @property
    def cache_widths(self) -> tuple[int, int]:
        """Values a token keeps in the KV cache: (the latent and the rotated key part, no separate V)."""
        return self.latent + self.rope, 0


def _dense(module: nn.Module) -> torch.Tensor:
    """A linear's weight as a float tensor (a GGUF's blocks dequantized: ggml's to_float)."""
    if isinstance(module, QuantLinear):
        from moestream import ggml

        return ggml.dequantize(module.raw, module.stored.name, module.rows, module.cols)
    return module.weight.detach()


def mla_attention(module: nn.Module, cfg: Any) -> Mla:
    heads, latent = int(cfg.num_attention_heads), int(cfg.kv_lora_rank)
    nope, rope, v_dim = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim), int(cfg.v_head_dim)
    kv_b = _dense(module.kv_b_proj)  # [N * (nope + v), latent], per head: nope rows then v rows
    if kv_b.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        kv_b = kv_b.float()
    per_head = kv_b.reshape(heads, nope + v_dim, latent)
    names = {"q_a": "q_a_proj", "kv_a": "kv_a_proj_with_mqa", "o": "o_proj"}
    biases = {}
    for name, attr in names.items():
        bias = getattr(getattr(module, attr, None), "bias", None)
        if bias is not None:
            biases[name] = _f32(bias)
    q_lora = module.q_a_proj is not None
    interleave = cfg.model_type == "deepseek_v2" or bool(getattr(cfg, "rope_interleave", True))
    return Mla(
        q=None if q_lora else matrix(module.q_proj),
        q_a=matrix(module.q_a_proj) if q_lora else None,
        q_a_norm=_f32(module.q_a_layernorm.weight) if q_lora else None,
        q_b=matrix(module.q_b_proj) if q_lora else None,
        kv_a=matrix(module.kv_a_proj_with_mqa),
        kv_norm=_f32(module.kv_a_layernorm.weight),
        k_b=per_head[:, :nope, :].transpose(1, 2).contiguous(),
        kv_b=kv_b.contiguous(),
        o=matrix(module.o_proj),
        biases=biases,
        heads=heads,
        nope=nope,
        rope=rope,
        latent=latent,
        v_dim=v_dim,
        scale=float(module.scaling),
        # V2 turns interleaved pairs (complex numbers); V3 too with rope_interleave (its output lays the
        # pairs' halves apart, but the same for queries and keys, so their dot products are the same)
        rope_mode=ROPE_NORM if interleave else ROPE_NEOX,
    )


def deepseek_router(mlp: nn.Module, cfg: Any, family: str) -> Router:
    """V2: softmax scores, top-k (greedy, or within the topk_group groups of highest best score); the
    chosen scores times routed_scaling_factor (transformers' V2 router never normalises them). V3: sigmoid
    scores, plus the correction bias for the choice only, top-k within the topk_group groups of highest
    top-2 sum; the chosen scores normalised (norm_topk_prob), times routed_scaling_factor."""
    gate = mlp.gate
    experts, top_k = int(gate.weight.shape[0]), int(cfg.num_experts_per_tok)
    router = Router(router_matrix(gate), top_k, normalize=False)
    router.scale = float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)
    router.shared = _shared(mlp.shared_experts)
    groups, kept = int(getattr(cfg, "n_group", 1) or 1), int(getattr(cfg, "topk_group", 1) or 1)
    if family == "deepseek_v2":
        method = getattr(cfg, "topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise NoGraph(f"DeepSeek-V2's topk_method {method!r} is not in the graphs")
        grouped = method == "group_limited_greedy"
        summed = 1  # a group's score: its best expert's
    else:
        router.sigmoid, router.normalize = True, bool(getattr(cfg, "norm_topk_prob", False))
        router.bias = _f32(gate.e_score_correction_bias)
        grouped, summed = True, 2  # a group's score: the sum of its best two
    if grouped and kept < groups:
        if experts % groups or kept * (experts // groups) < top_k:
            raise NoGraph(f"{experts} experts in {groups} groups, {kept} kept, do not hold top-{top_k}")
        router.groups = (groups, kept, summed)
    return router


def _shared(module: nn.Module):

    return Mlp(matrix(module.gate_proj), matrix(module.up_proj), matrix(module.down_proj))
