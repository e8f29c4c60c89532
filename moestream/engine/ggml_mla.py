"""DeepSeek's pieces of the decoder-layer graphs: Multi-head Latent Attention and group-limited routing.

MLA as llama.cpp computes it (src/models/deepseek2.cpp, "absorption"): the KV cache keeps one row a
token, the normed latent and the rotated key part [latent + rope] (F16), shared by every head; kv_b_proj
is never applied to the cache. Each head's K_nope half is folded into its query instead
(q_nope -> k_b^T q_nope, [latent]) and its V half into the attention's output (a [latent] mix of the
cached latents -> v_b, [v]), so attention is MQA over the cached rows: keys [latent + rope], values
their first `latent` values. Same sums as transformers' (which expands the latent into each head's
K and V), in another order.

Shapes (ggml order, ne[0] first): T tokens, N heads, L latent, R rope, Dn nope, Dv value head, S span.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moestream.ggml.lib import GgmlTensor
from moestream.ggml.net import F16, FLOAT_TYPES, I32, I64, SORT_DESC, Net
from moestream.model.mla_spec import Mla

if TYPE_CHECKING:
    from moestream.model.graph_spec import Router

_DROPPED = -1e30  # added to the choice of an expert outside the kept groups: never among the top k


def mla_attention(g: Any, net: Net, h: int, a: Mla, index: int) -> tuple[list[int], int]:
    """Layer `index`'s attention on the normed stream h [H, T], built by `g` (the engine's LayerGraphs,
    untyped here: its module imports this one): (the KV-cache write, which must run first; the
    attention output [H, T])."""
    spec, T, S = g.spec, g.tokens, g.span
    N, L, R, Dn, Dv = a.heads, a.latent, a.rope, a.nope, a.v_dim
    Dk = Dn + R
    if a.q is not None:  # V2-Lite: one projection
        q = g._linear(net, h, a.q)
    else:  # q_b(RMSNorm(q_a x))
        q = g._linear(net, g._norm(net, g._linear(net, h, a.q_a, a.biases.get("q_a")), a.q_a_norm), a.q_b)
    q = net.reshape_3d(q, Dk, N, T)
    kv = g._linear(net, h, a.kv_a, a.biases.get("kv_a"))  # [L + R, T]
    latent = g._norm(net, net.view_2d(kv, L, T, 4 * (L + R), 0), a.kv_norm)  # [L, T]
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
    keys = net.view_3d(every, L + R, S, 1, (L + R) * size, (L + R) * size * S, 0)  # [L + R, S, 1]
    values = net.view_3d(every, L, S, 1, (L + R) * size, (L + R) * size * S, 0)  # [L, S, 1]
    mask = net.tensor(F16, [S, T], g.buf.mask.data_ptr())
    out = net.flash_attn_ext(net.permute(query, 0, 2, 1, 3), keys, values, mask, a.scale, 0.0, 0.0)
    # out [L, N, T]: each head's mix of latents -> its values through kv_b's V rows [L, Dv, N]
    size = a.kv_b.element_size()
    v_b = net.tensor(FLOAT_TYPES[a.kv_b.dtype], [L, Dv, N], a.kv_b.data_ptr() + Dn * L * size)
    GgmlTensor.from_address(v_b).nb[2] = (Dn + Dv) * L * size  # head h's V rows: after its K rows
    GgmlTensor.from_address(v_b).nb[3] = (Dn + Dv) * L * size * N
    out = net.mul_mat(v_b, net.permute(out, 0, 2, 1, 3))  # [Dv, T, N]
    out = net.reshape_2d(net.cont(net.permute(out, 0, 2, 1, 3)), Dv * N, T)
    return writes, g._linear(net, out, a.o, a.biases.get("o"))


def group_limit(net: Net, choice: int, r: Router, tokens: int) -> int:
    """The router's choice [E, T] with every expert outside each token's `kept` best groups pushed below
    all others (a group's score: the sum of its best `summed` choices). A group that ties the last kept
    one is kept too (transformers' topk would take one of them; exact ties of float scores are not
    expected)."""
    groups, kept, summed = r.groups
    E, T = r.weight.rows, tokens
    per = E // groups
    flat = net.reshape_2d(choice, per, groups * T)  # each group a row
    best = net.view_2d(net.argsort(flat, SORT_DESC), summed, groups * T, 4 * per, 0)  # [summed, G * T]
    top = net.get_rows(net.reshape_3d(flat, 1, per, groups * T), best)  # [1, summed, G * T]
    score = net.reshape_2d(net.sum_rows(net.reshape_2d(top, summed, groups * T)), groups, T)  # [G, T]
    order = net.argsort(score, SORT_DESC)  # groups by descending score
    last = net.view_2d(order, 1, T, 4 * groups, 4 * (kept - 1))  # [1, T]: the last kept group
    bar = net.reshape_2d(net.get_rows(net.reshape_3d(score, 1, groups, T), last), 1, T)  # its score
    below = net.step(net.neg(net.sub(score, bar)))  # [G, T]: 1 where score < bar, else 0
    penalty = net.reshape_3d(net.scale(below, _DROPPED), 1, groups, T)
    limited = net.add(net.reshape_3d(choice, per, groups, T), penalty)  # [per, G, T]
    return net.reshape_2d(limited, E, T)
