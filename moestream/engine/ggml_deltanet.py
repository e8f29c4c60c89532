"""Qwen3-Next / Qwen3.5's layers as ggml graph pieces: the Gated DeltaNet and the gated attention's split.

A Gated DeltaNet layer keeps no keys and values but two states that fold in every token so far, and that
live with the request as the KV cache does (the runner zeroes them when a request starts at position 0;
they cannot be cropped back, so the prompt cache only continues them exactly):

- the conv state f32 [C, kernel - 1] (ggml [kernel - 1, C]): the last kernel - 1 inputs of the causal
  depthwise conv over [q; k; v];
- the recurrent state f32 [Hv, Dv, Dk] (ggml [Dk, Dv, Hv]; transformers' [Hv, Dk, Dv] transposed per
  head, as ggml_gated_delta_net keeps it).

One step of T tokens (a decoded token, a prefill chunk) is one pass: the conv over [state; the step's
inputs] (ggml_ssm_conv), its last kernel - 1 columns written back as the conv state; silu; q and k
L2-normalised (q scaled by 1 / sqrt(Dk) inside the op); g = -exp(A_log) * softplus(a + dt_bias),
beta = sigmoid(b); ggml_gated_delta_net over the T tokens from the recurrent state, whose final state is
written back; RMSNorm(o) * w * silu(z) per value head; out_proj (a GGUF's as stored, its columns' value
heads tiled: the heads reordered to match first, one permuted copy of [D Hv, T]). Each key head serves
Hv / Hk consecutive value heads (transformers' repeat_interleave), so q and k are repeated that way
before the op (which would otherwise tile them).

Shapes as in ggml_layers (ne[0] first): T tokens, C = 2 Hk Dk + Hv Dv conv channels, D = Dk = Dv.
"""

from __future__ import annotations

import torch

from moestream.ggml.net import F32, Net
from moestream.model.graph_spec import DeltaNet, ModelSpec

L2_EPS = 1e-6  # transformers' l2norm of q and k (FLA's): x / sqrt(sum x^2 + eps); ggml: x / max(|x|, eps)


def layer_caches(spec: ModelSpec, ctx: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's cache: (keys, values) f16 [ctx, Nkv * D] of an attention layer (MLA: the latent and
    rotated key rows [ctx, L + R], no values); (conv state f32 [C, kernel - 1], recurrent state f32
    [Hv, D, D]) of a Gated DeltaNet layer."""
    out = []
    for layer in spec.layers:
        d = layer.linear
        if d is not None:
            conv = torch.zeros(d.channels, d.kernel - 1, device=device)
            out.append((conv, torch.zeros(d.v_heads, d.head_dim, d.head_dim, device=device)))
        else:
            widths = layer.attention.cache_widths  # MLA: the latent rows, no values
            out.append(tuple(torch.zeros(ctx, w, dtype=torch.float16, device=device) for w in widths))
    return out


def recurrent_bytes(spec: ModelSpec, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Bytes of the Gated DeltaNet layers' states (held whatever the number of tokens)."""
    return sum(c.nbytes + s.nbytes for layer, (c, s) in zip(spec.layers, caches) if layer.linear)


def output_gate(net: Net, q: int, heads: int, head_dim: int, tokens: int) -> tuple[int, int]:
    """q_proj's output [2 D N, T], per head [q (D), gate (D)] -> (q [D N, T], gate [D N, T])."""
    D, N, T = head_dim, heads, tokens
    both = net.reshape_3d(q, 2 * D, N, T)
    row, step = 4 * 2 * D, 4 * 2 * D * N

    def half(offset: int) -> int:
        return net.reshape_2d(net.cont(net.view_3d(both, D, N, T, row, step, offset)), D * N, T)

    return half(0), half(4 * D)


def _linear(net: Net, x: int, m) -> int:
    return net.mul_mat(net.weight(m.ggml, [m.cols, m.rows]), x)


def _projections(net: Net, h: int, d: DeltaNet, T: int) -> tuple[int, int, int, int]:
    """(qkv [C, T] in [q; k; v] order, z [D, Hv, T], b [Hv, T], a [Hv, T])."""
    D, Hk, Hv = d.head_dim, d.k_heads, d.v_heads
    if d.qkvz is None:  # Qwen3.5: projected apart
        z = net.reshape_3d(_linear(net, h, d.z), D, Hv, T)
        return _linear(net, h, d.qkv), z, _linear(net, h, d.b), _linear(net, h, d.a)
    # Qwen3-Next: per key head [q (D), k (D), v (r D), z (r D)] and [b (r), a (r)]
    r = Hv // Hk
    group = 2 * D + 2 * r * D
    qkvz = net.reshape_3d(_linear(net, h, d.qkvz), group, Hk, T)

    def part(t: int, width: int, stride: int, offset: int) -> int:  # [width, Hk, T] -> [width * Hk, T]
        view = net.view_3d(t, width, Hk, T, 4 * stride, 4 * stride * Hk, 4 * offset)
        return net.reshape_2d(net.cont(view), width * Hk, T)

    q, k = part(qkvz, D, group, 0), part(qkvz, D, group, D)
    v, z = part(qkvz, r * D, group, 2 * D), part(qkvz, r * D, group, 2 * D + r * D)
    ba = net.reshape_3d(_linear(net, h, d.ba), 2 * r, Hk, T)
    qkv = net.concat(net.concat(q, k, 0), v, 0)
    return qkv, net.reshape_3d(z, D, Hv, T), part(ba, r, 2 * r, 0), part(ba, r, 2 * r, r)


def delta_net(
    net: Net, h: int, d: DeltaNet, states: tuple[torch.Tensor, torch.Tensor], T: int, eps: float
) -> tuple[list[int], int]:
    """The layer on the attention norm's output h [H, T]: (the state writes, the output [H, T])."""
    D, Hk, Hv, C, K = d.head_dim, d.k_heads, d.v_heads, d.channels, d.kernel
    conv_state, state = states
    qkv, z, b, a = _projections(net, h, d, T)
    # the causal conv over the last K - 1 inputs and this step's: [K - 1 + T, C] (time first)
    conv_in = net.tensor(F32, [K - 1, C], conv_state.data_ptr())
    window = net.concat(conv_in, net.transpose(qkv), 0)
    row = 4 * (K - 1 + T)
    kept = net.view_2d(window, K - 1, C, row, 4 * T)  # its last K - 1 columns: the next conv state
    conv_write = net.cpy(kept, conv_in)
    conv = net.ssm_conv(net.reshape_3d(window, K - 1 + T, C, 1), net.weight(d.conv, [K, C]))
    mixed = net.reshape_2d(net.silu(conv), C, T)  # [C, T]

    def heads(offset: int, n: int) -> int:  # [D, n, T] of the conv's output from channel `offset`
        return net.view_3d(mixed, D, n, T, 4 * D, 4 * C, 4 * offset)

    q = net.l2_norm(heads(0, Hk), L2_EPS)
    k = net.l2_norm(heads(D * Hk, Hk), L2_EPS)
    v = heads(2 * D * Hk, Hv)
    if Hv != Hk:  # value head j reads key head j // r: each key head repeated r times in place
        r = Hv // Hk

        def repeated(x: int) -> int:
            return net.reshape_3d(net.repeat_4d(net.reshape_4d(x, D, 1, Hk, T), D, r, Hk, T), D, Hv, T)

        q, k = repeated(q), repeated(k)
    g = net.mul(net.softplus(net.add(a, net.weight(d.dt_bias, [Hv]))), net.weight(d.decay, [Hv]))
    beta = net.sigmoid(b)
    s0 = net.tensor(F32, [D, D, Hv, 1], state.data_ptr())
    g, beta = net.reshape_3d(g, 1, Hv, T), net.reshape_3d(beta, 1, Hv, T)
    out = net.gated_delta_net(q, k, v, g, beta, s0, 1)  # [D Hv, T + D]: the outputs, then the final state
    o = net.view_3d(out, D, Hv, T, 4 * D, 4 * D * Hv, 0)
    final = net.view_1d(out, D * D * Hv, 4 * D * Hv * T)
    state_write = net.cpy(final, net.tensor(F32, [D * D * Hv], state.data_ptr()))
    # the gated RMSNorm per value head: norm(o) * w * silu(z)
    normed = net.mul(net.rms_norm(net.cont(o), eps), net.weight(d.norm, [D]))
    return [conv_write, state_write], out_projection(net, net.mul(normed, net.silu(z)), d, T)


def out_projection(net: Net, y: int, d: DeltaNet, T: int) -> int:
    """out_proj of the gated norm's output y [D, Hv, T] (heads grouped by key head) -> [H, T]. A GGUF's
    out_proj kept as stored has its columns' value heads tiled (`DeltaNet.out_tiled`): y's heads are
    reordered to match first, [D, r, Hk] -> [D, Hk, r], one copy of D Hv T floats."""
    D, Hk, Hv = d.head_dim, d.k_heads, d.v_heads
    if d.out_tiled:
        y = net.cont(net.permute(net.reshape_4d(y, D, Hv // Hk, Hk, T), 0, 2, 1, 3))
    return _linear(net, net.reshape_2d(y, D * Hv, T), d.out)
