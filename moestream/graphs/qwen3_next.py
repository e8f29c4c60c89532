"""Qwen3-Next's graphs (Qwen3.5 builds on them, `graphs/qwen3_5_moe.py`): the family, and its Gated
DeltaNet layers: their spec, read from transformers' modules, and their graph. (Its full-attention
layers are `graphs/attention.py`'s, gated: `Attention.gated`.)

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

Shapes as in graphs/layers.py (ne[0] first): T tokens, C = 2 Hk Dk + Hv Dv conv channels, D = Dk = Dv.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moestream.ggml.net import F32, Net
from moestream.graphs.attention import Attention, read_attention
from moestream.graphs.family import GraphFamily, register
from moestream.graphs.parts import Matrix, NoGraph, Router, f32, matrix
from moestream.graphs.qwen2_moe import with_gated_shared_expert

L2_EPS = 1e-6  # transformers' l2norm of q and k (FLA's): x / sqrt(sum x^2 + eps); ggml: x / max(|x|, eps)


class Qwen3Next(GraphFamily):
    """Qwen3-Next: Gated DeltaNet layers between gated full-attention ones, zero-centred RMSNorms (1 + w;
    the DeltaNet's gated norm by w), a softmax router and a gated shared expert (Qwen2-MoE's)."""

    name = "qwen3_next"
    layer_types = frozenset({"linear_attention", "full_attention"})
    zero_centred = True

    def attention(self, module: nn.Module, cfg: Any) -> Attention:
        return read_attention(module, cfg, self.norm, gated=True)

    def router(self, mlp: nn.Module, cfg: Any) -> Router:
        return with_gated_shared_expert(super().router(mlp, cfg), mlp)

    def linear(self, module: nn.Module, cfg: Any) -> DeltaNet:
        return read_delta_net(module, cfg)


@dataclass
class DeltaNet:
    """A Gated DeltaNet layer (Qwen3-Next, Qwen3.5): projections, a causal depthwise conv over
    [q; k; v] (C = 2 Hk Dk + Hv Dv channels), L2-normalised q and k, the gated delta rule over a
    recurrent state [Hv, Dk, Dv], a gated RMSNorm, out_proj. Qwen3.5 projects qkv, z, b, a apart;
    Qwen3-Next projects qkvz and ba with rows grouped per key head ([q, k, v (r heads), z (r heads)]
    and [b (r), a (r)], r = Hv / Hk), which the graph takes apart by views."""

    qkv: Matrix | None  # [C, hidden] (Qwen3.5)
    z: Matrix | None  # [Hv Dv, hidden]
    b: Matrix | None  # [Hv, hidden]
    a: Matrix | None
    qkvz: Matrix | None  # [C + Hv Dv, hidden] (Qwen3-Next)
    ba: Matrix | None  # [2 Hv, hidden]
    conv: torch.Tensor  # f32 [C, kernel]
    decay: torch.Tensor  # f32 [Hv]: -exp(A_log), g = decay * softplus(a + dt_bias)
    dt_bias: torch.Tensor  # f32 [Hv]
    norm: torch.Tensor  # f32 [Dv]: the gated RMSNorm's weight (w, not 1 + w)
    out: Matrix  # [hidden, Hv Dv]
    k_heads: int
    v_heads: int
    head_dim: int  # Dk = Dv (ggml_gated_delta_net's state is square)
    kernel: int
    # out's columns hold the value heads tiled [r, Hk] (a GGUF's out_proj kept as its blocks, unmoved),
    # so the graph reorders the heads of its input from transformers' grouped [Hk, r] (r = Hv / Hk)
    out_tiled: bool = False

    recurrent = True  # its states fold in every token: they cannot be cropped back

    @property
    def channels(self) -> int:
        return (2 * self.k_heads + self.v_heads) * self.head_dim

    def cache(self, ctx: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Its two states, whatever `ctx`: the conv state f32 [C, kernel - 1], the recurrent state f32
        [Hv, D, D]."""
        conv = torch.zeros(self.channels, self.kernel - 1, device=device)
        return conv, torch.zeros(self.v_heads, self.head_dim, self.head_dim, device=device)

    def graph(self, g: Any, net: Net, h: int, index: int) -> tuple[list[int], int]:
        """Layer `index` on the attention norm's output h [H, T], built by `g` (a `LayerGraphs`): (the
        state writes, the output [H, T])."""
        return delta_net(net, h, self, g.kv[index], g.tokens, g.spec.eps)


def read_delta_net(module: nn.Module, cfg: Any) -> DeltaNet:
    """A Gated DeltaNet module's spec (Qwen3-Next's qkvz and ba, or Qwen3.5's four projections).

    Raises:
        NoGraph: this ggml lacks the op, or the heads are not square / do not group evenly.
    """
    from moestream import ggml

    if not ggml.library().gated_delta_net:
        raise NoGraph(f"this ggml ({ggml.library().version}) lacks ggml_gated_delta_net")
    k_heads, v_heads = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
    dk, dv = int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim)
    if dk != dv or v_heads % k_heads:
        raise NoGraph(f"a Gated DeltaNet of key head dim {dk}, value head dim {dv} is not in the graphs")
    split = getattr(module, "in_proj_qkv", None) is not None
    parts = {n: matrix(getattr(module, f"in_proj_{n}")) if split else None for n in ("qkv", "z", "b", "a")}
    conv = module.conv1d.weight.detach()
    out_tiled = _tiled_inputs(module.out_proj, k_heads, v_heads, dv)
    return DeltaNet(
        **parts,
        qkvz=None if split else matrix(module.in_proj_qkvz),
        ba=None if split else matrix(module.in_proj_ba),
        conv=f32(conv.reshape(conv.shape[0], conv.shape[-1])),
        decay=(-f32(module.A_log).exp()).contiguous(),
        dt_bias=f32(module.dt_bias),
        norm=f32(module.norm.weight),
        out=matrix(module.out_proj, permuted_inputs=out_tiled),
        out_tiled=out_tiled,
        k_heads=k_heads,
        v_heads=v_heads,
        head_dim=dk,
        kernel=int(cfg.linear_conv_kernel_dim),
    )


def _tiled_inputs(out_proj: nn.Module, k_heads: int, v_heads: int, head_dim: int) -> bool:
    """Whether out_proj multiplies its input's value heads reordered from grouped [Hk, r] to tiled [r, Hk]
    (a QuantLinear of a GGUF's out_proj as stored); NoGraph for another permutation."""
    inputs = getattr(out_proj, "inputs", None)
    if inputs is None:
        return False
    r = v_heads // k_heads
    tiled = torch.arange(v_heads * head_dim).reshape(k_heads, r, head_dim).transpose(0, 1).reshape(-1)
    if not torch.equal(inputs.cpu(), tiled):
        raise NoGraph("out_proj permutes its input otherwise than value heads grouped -> tiled")
    return True


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


register(Qwen3Next())
