"""DeepSeek V2 / V3's graphs (one module, as llama.cpp's deepseek2.cpp serves both): Multi-head Latent
Attention, its spec read from the modules transformers built and its graph, and their routers.

MLA keeps one latent row a token: kv_a_proj_with_mqa gives the latent (kv_lora_rank) and one rotary key
part shared by every head (qk_rope_head_dim); kv_b_proj expands the normed latent into each head's
K_nope and V. The spec keeps kv_b_proj's V half as it lies (each head's rows, a stride apart) and its
K half copied transposed (`k_b`), each laid out for a batched ggml_mul_mat over the heads.

The graph is MLA as llama.cpp computes it (src/models/deepseek2.cpp, "absorption"): the KV cache keeps
one row a token, the normed latent and the rotated key part [latent + rope] (F16), shared by every
head; kv_b_proj is never applied to the cache. Each head's K_nope half is folded into its query instead
(q_nope -> k_b^T q_nope, [latent]) and its V half into the attention's output (a [latent] mix of the
cached latents -> v_b, [v]), so attention is MQA over the cached rows: keys [latent + rope], values
their first `latent` values. Same sums as transformers' (which expands the latent into each head's
K and V), in another order.

Shapes (ggml order, ne[0] first): T tokens, N heads, L latent, R rope, Dn nope, Dv value head, S span.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moestream.ggml.lib import GgmlTensor
from moestream.ggml.net import F16, FLOAT_TYPES, I32, I64, Net
from moestream.graphs.attention import kv_rows
from moestream.graphs.family import GraphFamily, register
from moestream.graphs.parts import Matrix, NoGraph, Router, f32, matrix, read_mlp, router_matrix
from moestream.model.quantized import QuantLinear

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
    recurrent = False  # its cache holds rows per position (it can be cropped back)

    @property
    def cache_widths(self) -> tuple[int, int]:
        """Values a token keeps in the KV cache: (the latent and the rotated key part, no separate V)."""
        return self.latent + self.rope, 0

    def cache(self, ctx: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Its KV cache of `ctx` positions: f16 [ctx, L + R], and no values ([ctx, 0])."""
        return kv_rows(self.cache_widths, ctx, device)

    def graph(self, g: Any, net: Net, h: int, index: int) -> tuple[list[int], int]:
        """Layer `index`'s attention on the normed stream h [H, T], built by `g` (a `LayerGraphs`):
        (the KV-cache write, which must run first; the attention output [H, T])."""
        return mla_graph(g, net, h, self, index)


def _dense(module: nn.Module) -> torch.Tensor:
    """A linear's weight as a float tensor (a GGUF's blocks dequantized: ggml's to_float)."""
    if isinstance(module, QuantLinear):
        from moestream import ggml

        return ggml.dequantize(module.raw, module.stored.name, module.rows, module.cols)
    return module.weight.detach()


def read_mla(module: nn.Module, cfg: Any, interleave: bool) -> Mla:
    """A DeepSeek attention module's spec; `interleave`: its rope turns interleaved pairs."""
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
            biases[name] = f32(bias)
    q_lora = module.q_a_proj is not None
    return Mla(
        q=None if q_lora else matrix(module.q_proj),
        q_a=matrix(module.q_a_proj) if q_lora else None,
        q_a_norm=f32(module.q_a_layernorm.weight) if q_lora else None,
        q_b=matrix(module.q_b_proj) if q_lora else None,
        kv_a=matrix(module.kv_a_proj_with_mqa),
        kv_norm=f32(module.kv_a_layernorm.weight),
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


def mla_graph(g: Any, net: Net, h: int, a: Mla, index: int) -> tuple[list[int], int]:
    """`Mla.graph`: `g` is the `LayerGraphs` building the step (its spec, buffers, KV cache)."""
    spec, T, S = g.spec, g.tokens, g.span
    N, L, R, Dn, Dv = a.heads, a.latent, a.rope, a.nope, a.v_dim
    Dk = Dn + R
    if a.q is not None:  # V2-Lite: one projection
        q = g.linear(net, h, a.q)
    else:  # q_b(RMSNorm(q_a x))
        q = g.linear(net, g.norm(net, g.linear(net, h, a.q_a, a.biases.get("q_a")), a.q_a_norm), a.q_b)
    q = net.reshape_3d(q, Dk, N, T)
    kv = g.linear(net, h, a.kv_a, a.biases.get("kv_a"))  # [L + R, T]
    latent = g.norm(net, net.view_2d(kv, L, T, 4 * (L + R), 0), a.kv_norm)  # [L, T]
    k_pe = net.view_3d(kv, R, 1, T, 4 * (L + R), 4 * (L + R), 4 * L)
    q_nope = net.view_3d(q, Dn, N, T, 4 * Dk, 4 * Dk * N, 0)
    q_pe = net.view_3d(q, R, N, T, 4 * Dk, 4 * Dk * N, 4 * Dn)
    pos = net.tensor(I32, [T], g.buf.positions.data_ptr())
    freqs = None if spec.rope_freqs is None else net.weight(spec.rope_freqs, [spec.rope_dims // 2])
    rope = (a.rope_mode, spec.context, spec.rope_base, 1.0, 0.0, spec.rope_attn, 0.0, 0.0)
    q_pe = net.rope_ext(q_pe, pos, freqs, R, *rope)  # [R, N, T]
    k_pe = net.rope_ext(k_pe, pos, freqs, R, *rope)  # [R, 1, T]
    # each head's K_nope folded into its query: k_b [Dn, L, N] x q_nope [Dn, T, N] -> [L, T, N]
    k_b = net.weight(a.k_b, [Dn, L, N])
    absorbed = net.mul_mat(k_b, net.permute(q_nope, 0, 2, 1, 3))
    query = net.concat(net.permute(absorbed, 0, 2, 1, 3), q_pe, 0)  # [L + R, N, T]
    cache = g.kv[index][0]  # f16 [ctx, L + R]
    rows = net.tensor(I64, [T], g.buf.rows.data_ptr())
    ctx, size = cache.shape[0], cache.element_size()
    every = net.tensor(F16, [L + R, ctx], cache.data_ptr())
    row = net.concat(latent, net.reshape_2d(k_pe, R, T), 0)  # [L + R, T]
    writes = [net.set_rows(every, row, rows)]
    width = (L + R) * size

    def slot_rows(first: int) -> tuple[int, int]:  # keys [L + R, S, 1] and values [L, S, 1], from row `first`
        keys = net.view_3d(every, L + R, S, 1, width, width * S, first * width)
        return keys, net.view_3d(every, L, S, 1, width, width * S, first * width)

    out = g.attend(net, query, slot_rows, g.buf.mask, a.scale)
    # out [L, N, T]: each head's mix of latents -> its values through kv_b's V rows [L, Dv, N]
    size = a.kv_b.element_size()
    v_b = net.tensor(FLOAT_TYPES[a.kv_b.dtype], [L, Dv, N], a.kv_b.data_ptr() + Dn * L * size)
    GgmlTensor.from_address(v_b).nb[2] = (Dn + Dv) * L * size  # head h's V rows: after its K rows
    GgmlTensor.from_address(v_b).nb[3] = (Dn + Dv) * L * size * N
    out = net.mul_mat(v_b, net.permute(out, 0, 2, 1, 3))  # [Dv, T, N]
    out = net.reshape_2d(net.cont(net.permute(out, 0, 2, 1, 3)), Dv * N, T)
    return writes, g.linear(net, out, a.o, a.biases.get("o"))


class DeepseekV2(GraphFamily):
    """DeepSeek-V2 (and V2-Lite): MLA, softmax scores, top-k (greedy, or within the topk_group groups of
    highest best score); the chosen scores times routed_scaling_factor (transformers' V2 router never
    normalises them); an ungated shared expert. Its first layers are dense (first_k_dense_replace)."""

    name = "deepseek_v2"

    def attention(self, module: nn.Module, cfg: Any) -> Mla:
        return read_mla(module, cfg, interleave=True)

    def router(self, mlp: nn.Module, cfg: Any) -> Router:
        method = getattr(cfg, "topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise NoGraph(f"DeepSeek-V2's topk_method {method!r} is not in the graphs")
        router = _router(mlp, cfg)
        return _grouped(router, cfg, summed=1) if method == "group_limited_greedy" else router


class DeepseekV3(DeepseekV2):
    """DeepSeek-V3 (and R1): as V2, but its rope's pairs interleaved where `rope_interleave` says so
    (the default), and sigmoid scores, plus the correction bias for the
    choice only, top-k within the topk_group groups of highest top-2 sum; the chosen scores normalised
    (norm_topk_prob), times routed_scaling_factor."""

    name = "deepseek_v3"

    def attention(self, module: nn.Module, cfg: Any) -> Mla:
        return read_mla(module, cfg, interleave=bool(getattr(cfg, "rope_interleave", True)))

    def router(self, mlp: nn.Module, cfg: Any) -> Router:
        router = _router(mlp, cfg)
        router.sigmoid, router.normalize = True, bool(getattr(cfg, "norm_topk_prob", False))
        router.bias = f32(mlp.gate.e_score_correction_bias)
        return _grouped(router, cfg, summed=2)  # a group's score: the sum of its best two


def _router(mlp: nn.Module, cfg: Any) -> Router:
    """The scores' top-k, not normalised, times routed_scaling_factor; the shared experts."""
    router = Router(router_matrix(mlp.gate), int(cfg.num_experts_per_tok), normalize=False)
    router.scale = float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)
    router.shared = read_mlp(mlp.shared_experts)
    return router


def _grouped(router: Router, cfg: Any, summed: int) -> Router:
    """`router` limited to the topk_group groups (of n_group) of highest score (the sum of a group's best
    `summed` scores), where fewer than every group are kept.

    Raises:
        NoGraph: the kept groups cannot hold top-k experts.
    """
    experts, top_k = router.weight.rows, router.top_k
    groups, kept = int(getattr(cfg, "n_group", 1) or 1), int(getattr(cfg, "topk_group", 1) or 1)
    if kept < groups:
        if experts % groups or kept * (experts // groups) < top_k:
            raise NoGraph(f"{experts} experts in {groups} groups, {kept} kept, do not hold top-{top_k}")
        router.groups = (groups, kept, summed)
    return router


register(DeepseekV2())
register(DeepseekV3())
