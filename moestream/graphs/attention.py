"""Standard attention as the graphs compute it: its spec, read from a transformers attention module, and
its graph (llama.cpp's build_attn).

Projections with their biases, QK-norm (per head, or over the whole projection), RoPE (a scaled rope's
frequencies as freq_factors), the new keys and values written into the F16 KV cache, flash attention
over the cache with the causal mask (a sliding window's own mask; gpt-oss's sinks), and where the family
gates it (Qwen3-Next, Qwen3.5) the output times sigmoid(the gate q_proj also yields).

Shapes (ggml order, ne[0] first): H hidden, T tokens of the step, D head dim, N / Nkv query / key-value
heads, S positions the step's attention spans.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moestream.ggml.net import F16, I32, I64, ROPE_NEOX, Net
from moestream.graphs.parts import Matrix, NoGraph, f32, matrix


@dataclass
class Attention:
    q: Matrix
    k: Matrix
    v: Matrix
    o: Matrix
    biases: dict[str, torch.Tensor]  # "q", "k", "v", "o" -> f32 [rows], where the family has them
    q_norm: torch.Tensor | None  # f32 [head_dim] ("head") or [heads * head_dim] ("full")
    k_norm: torch.Tensor | None
    qk_norm: str | None  # "head" (Qwen3: per head), "full" (OLMoE: the whole projection), None
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    sinks: torch.Tensor | None = None  # f32 [heads]: gpt-oss's learned logit per head (a value of 0)
    window: int | None = None  # a sliding window: a token sees itself and the window - 1 before it
    gated: bool = False  # q_proj yields [q, gate] per head; the output is sigmoid(gate) * attention
    recurrent = False  # its cache holds rows per position (it can be cropped back)

    @property
    def cache_widths(self) -> tuple[int, int]:
        """Values a token keeps in the KV cache: (keys, values)."""
        return self.kv_heads * self.head_dim, self.kv_heads * self.head_dim

    def cache(self, ctx: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Its KV cache of `ctx` positions: keys and values f16 [ctx, Nkv * D]."""
        return kv_rows(self.cache_widths, ctx, device)

    def graph(self, g: Any, net: Net, h: int, index: int) -> tuple[list[int], int]:
        """Layer `index`'s attention on the normed stream h [H, T], built by `g` (a `LayerGraphs`):
        (the KV-cache writes, which must run first; the attention output [H, T])."""
        return attention_graph(g, net, h, self, index)


def kv_rows(widths: tuple[int, int], ctx: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A KV cache of `ctx` positions, f16 [ctx, width] for each of (keys, values) (a width 0: none)."""
    return tuple(torch.zeros(ctx, w, dtype=torch.float16, device=device) for w in widths)


def read_attention(
    module: nn.Module,
    cfg: Any,
    norm: Callable[[nn.Module], torch.Tensor],
    window: bool = False,
    gated: bool = False,
) -> Attention:
    """A transformers attention module's spec; `norm` reads its QK-norms' factors (the family's rule),
    `window` keeps the module's sliding window (gpt-oss), `gated` says q_proj also yields a gate."""
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    if getattr(cfg, "clip_qkv", None):
        raise NoGraph("clip_qkv is not in the graphs yet")
    projections = {n: getattr(module, f"{n}_proj") for n in ("q", "k", "v", "o")}
    biases = {n: f32(p.bias) for n, p in projections.items() if getattr(p, "bias", None) is not None}
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    qk = None
    if q_norm is not None:
        qk = "head" if q_norm.weight.numel() == head_dim else "full"
    sinks = getattr(module, "sinks", None)
    size = getattr(module, "sliding_window", None) if window else None
    return Attention(
        *(matrix(projections[n]) for n in ("q", "k", "v", "o")),
        biases=biases,
        q_norm=norm(q_norm) if q_norm is not None else None,
        k_norm=norm(k_norm) if k_norm is not None else None,
        qk_norm=qk,
        heads=heads,
        kv_heads=int(cfg.num_key_value_heads),
        head_dim=head_dim,
        scale=float(getattr(module, "scaling", head_dim**-0.5)),
        sinks=f32(sinks) if sinks is not None else None,
        window=int(size) if size else None,
        gated=gated,
    )


def attention_graph(g: Any, net: Net, h: int, a: Attention, index: int) -> tuple[list[int], int]:
    """`Attention.graph`: `g` is the `LayerGraphs` building the step (its spec, buffers, KV cache)."""
    spec, T, S = g.spec, g.tokens, g.span
    D, N, Nkv = a.head_dim, a.heads, a.kv_heads
    q = g.linear(net, h, a.q, a.biases.get("q"))
    gate = None
    if a.gated:  # Qwen3-Next / Qwen3.5: q_proj also yields the output's gate
        q, gate = output_gate(net, q, N, D, T)
    k = g.linear(net, h, a.k, a.biases.get("k"))
    v = g.linear(net, h, a.v, a.biases.get("v"))
    if a.qk_norm == "full":  # OLMoE: over the whole projection
        q, k = g.norm(net, q, a.q_norm), g.norm(net, k, a.k_norm)
    q, k = net.reshape_3d(q, D, N, T), net.reshape_3d(k, D, Nkv, T)
    if a.qk_norm == "head":  # Qwen3: over each head
        q, k = g.norm(net, q, a.q_norm), g.norm(net, k, a.k_norm)
    pos = net.tensor(I32, [T], g.buf.positions.data_ptr())
    # a scaled rope: transformers' frequencies as freq_factors, its attention_scaling as attn_factor
    freqs = None if spec.rope_freqs is None else net.weight(spec.rope_freqs, [spec.rope_dims // 2])
    rope = (ROPE_NEOX, spec.context, spec.rope_base, 1.0, 0.0, spec.rope_attn, 0.0, 0.0)
    q = net.rope_ext(q, pos, freqs, spec.rope_dims, *rope)
    k = net.rope_ext(k, pos, freqs, spec.rope_dims, *rope)
    kc, vc = g.kv[index]  # f16 [ctx, Nkv * D] each
    rows = net.tensor(I64, [T], g.buf.rows.data_ptr())
    ctx, size = kc.shape[0], kc.element_size()
    k_all = net.tensor(F16, [Nkv * D, ctx], kc.data_ptr())
    v_all = net.tensor(F16, [Nkv * D, ctx], vc.data_ptr())
    writes = [
        # the roped keys as a view: ggml's CUDA backend fuses norm, rope, this view and set_rows into one
        # kernel (llama.cpp's KV write is a view too; a reshape ends the run of fusable nodes)
        net.set_rows(k_all, net.view_2d(k, Nkv * D, T, 4 * Nkv * D, 0), rows),
        net.set_rows(v_all, net.reshape_2d(v, Nkv * D, T), rows),
    ]
    row = Nkv * D * size

    def slot_rows(first: int) -> tuple[int, int]:  # [D, S, Nkv] each, from row `first`
        views = (net.view_3d(t, D, S, Nkv, row, D * size, first * row) for t in (k_all, v_all))
        return tuple(views)

    mask = g.buf.window if a.window else g.buf.mask  # a sliding window: its own mask
    sinks = net.weight(a.sinks, [N]) if a.sinks is not None else None  # gpt-oss: a logit of value 0
    out = g.attend(net, q, slot_rows, mask, a.scale, sinks)
    out = net.reshape_2d(out, D * N, T)  # [D, N, T] -> [D * N, T]
    if gate is not None:
        out = net.mul(out, net.sigmoid(gate))
    return writes, g.linear(net, out, a.o, a.biases.get("o"))


def output_gate(net: Net, q: int, heads: int, head_dim: int, tokens: int) -> tuple[int, int]:
    """q_proj's output [2 D N, T], per head [q (D), gate (D)] -> (q [D N, T], gate [D N, T])."""
    D, N, T = head_dim, heads, tokens
    both = net.reshape_3d(q, 2 * D, N, T)
    row, step = 4 * 2 * D, 4 * 2 * D * N

    def half(offset: int) -> int:
        return net.reshape_2d(net.cont(net.view_3d(both, D, N, T, row, step, offset)), D * N, T)

    return half(0), half(4 * D)
