"""The decoder layer as a ggml graph: what a family computes, written once over `model.graph_spec`.

One graph per layer and step shape: the previous MoE layer's routed experts summed onto the residual
stream (their outputs are this graph's per-run inputs); attention (RMSNorm, projections with their
biases, QK-norm, RoPE, the new rows written into the F16 KV cache, flash
attention over the cache with a causal mask); the residual, the FFN norm, then either a dense MLP or
the router (softmax, top-k by argsort, the families' normalisation) and the shared expert. The routed
experts are not in the graph: the engine hands the router's choice to the expert cache between two
graphs (hits at once, each miss as its bytes land), then the next graph adds their outputs. A last
graph does the final norm and the LM head on the last position.

Shapes (ggml order, ne[0] first): H hidden, T tokens of the step, K experts per token, E experts,
D head dim, N / Nkv query / key-value heads, S positions the step's attention spans (a multiple of 256).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moestream.engine.ggml_deltanet import delta_net, output_gate
from moestream.engine.ggml_mla import group_limit, mla_attention
from moestream.ggml.lib import GgmlTensor
from moestream.ggml.net import F16, F32, I32, I64, ROPE_NEOX, SORT_DESC, Net
from moestream.model.graph_spec import Attention, Layer, Mlp, ModelSpec
from moestream.model.mla_spec import Mla

SPAN_STEP = 256  # attention spans the KV cache in multiples of this: one graph set serves 256 positions


@dataclass(frozen=True)
class SlotArena:
    """Where a layer's cached experts lie: in one size class of the expert cache, each kind at the same
    place in every slot, so one ggml_mul_mat_id over the whole class computes any of them by slot."""

    address: dict[str, int]  # kind -> its bytes in slot 0
    slot_bytes: int
    slots: int


@dataclass(frozen=True)
class ExpertTypes:
    """One MoE layer's routed experts as the graphs compute them (gate and up [I, H], down [H, I])."""

    gate: int  # ggml types
    up: int
    down: int
    inter: int
    arena: SlotArena | None  # None: the slots' layout differs between experts (no cached path)
    # gpt-oss: kind -> f32 [E, out] bias rows by expert id (ggml_add_id), and (alpha, limit) of
    # ggml_swiglu_oai; else none and ggml_swiglu_split
    biases: dict[str, torch.Tensor] | None = field(default=None, compare=False)
    oai: tuple[float, float] | None = None


@dataclass(frozen=True)
class Whole:
    """Every routed expert cached, for good: MoE layer -> the slot of its expert 0 in its size class
    (expert e in slot first + e), so the routers' ids address the slots inside one graph."""

    first: dict[int, int]


@dataclass
class Carry:
    """A layer's nodes that the rest of a graph reads (results, not yet placed)."""

    writes: list[int]  # the KV-cache writes
    resid: int  # [H, T] the residual stream after the layer (its routed experts not yet added)
    moe_in: int = 0  # [H, T] the routed experts' input
    order: int = 0  # [E, T] i32 experts by descending router choice
    top: int = 0  # [K, T] i32 a view of order's first K rows
    weights: int = 0  # [K, T] the routed experts' weights
    picked: int = 0  # [1, K, T] the routers' probabilities of `top`
    view: int = 0  # picked as [K, T] (weights is this view when nothing normalises or scales)


@dataclass
class StepBuffers:
    """Memory the graphs of one step shape (T tokens, span S) read and write between them (torch shapes)."""

    tokens: torch.Tensor  # i32 [T]
    positions: torch.Tensor  # i32 [T]
    rows: torch.Tensor  # i64 [T]: the KV-cache rows the step writes (= positions)
    mask: torch.Tensor  # f16 [T, S]: 0 where a token may attend, -inf elsewhere
    window: torch.Tensor  # f16 [T, S]: the sliding-window layers' mask ([0, S] when none has a window)
    resid: tuple[torch.Tensor, torch.Tensor]  # f32 [T, H] each: layer l writes resid[l % 2]
    moe_in: torch.Tensor  # f32 [T, H]: the routed experts' input (the FFN norm's output)
    order: torch.Tensor  # i32 [T, E]: experts by descending router probability (the first K are routed)
    weights: tuple[torch.Tensor, torch.Tensor]  # f32 [T, K] each: layer l writes weights[l % 2]
    logits: torch.Tensor  # f32 [V]
    slots: torch.Tensor  # i32 [T, K]: each token's cached experts, by slot, in the router's order
    outputs: torch.Tensor  # f32 [T, K, H]: each token's experts' outputs, from the expert runtime
    routed: torch.Tensor  # i32 [MoE layers, T, K]: the whole-step graph's routing, each MoE layer's

    @classmethod
    def make(cls, spec: ModelSpec, tokens: int, span: int, experts: int) -> StepBuffers:
        f32 = dict(dtype=torch.float32)
        k = spec.top_k
        return cls(
            tokens=torch.zeros(tokens, dtype=torch.int32),
            positions=torch.zeros(tokens, dtype=torch.int32),
            rows=torch.zeros(tokens, dtype=torch.int64),
            mask=torch.zeros(tokens, span, dtype=torch.float16),
            window=torch.zeros(tokens if spec.window else 0, span, dtype=torch.float16),
            resid=(torch.zeros(tokens, spec.hidden, **f32), torch.zeros(tokens, spec.hidden, **f32)),
            moe_in=torch.zeros(tokens, spec.hidden, **f32),
            order=torch.zeros(tokens, experts, dtype=torch.int32),
            weights=(torch.zeros(tokens, k, **f32), torch.zeros(tokens, k, **f32)),
            logits=torch.zeros(spec.vocab, **f32),
            slots=torch.zeros(tokens, k, dtype=torch.int32),
            outputs=torch.zeros(tokens, k, spec.hidden, **f32),
            routed=torch.zeros(sum(x.router is not None for x in spec.layers), tokens, k, dtype=torch.int32),
        )

    def fill_masks(self, window: int | None) -> None:
        """The step's masks for its rows (= positions): causal; and for the sliding layers, also what lies
        `window` or more positions back (transformers' sliding mask)."""
        span = torch.arange(self.mask.shape[1])
        later = span[None, :] > self.rows[:, None]
        self.mask.masked_fill_(later, float("-inf")).masked_fill_(~later, 0.0)
        if self.window.numel():
            far = span[None, :] <= self.rows[:, None] - window
            self.window.copy_(self.mask).masked_fill_(far, float("-inf"))


class LayerGraphs:
    """Builds the graphs of one step shape; the caller plans and places them (`Net.finish`, `Arena`)."""

    def __init__(
        self,
        spec: ModelSpec,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        buf: StepBuffers,
        experts: dict[int, ExpertTypes] | None = None,
        whole: Whole | None = None,
        last: bool = False,
    ) -> None:
        self.spec, self.kv, self.buf = spec, kv, buf
        self.experts = experts or {}  # MoE layer -> its routed experts' ggml types, for `fused` graphs
        self.whole = whole  # where each MoE layer's experts lie, for the `step` graph
        self.tokens = buf.tokens.numel()
        self.span = buf.mask.shape[1]
        # `last`: past the last layer's attention only the last position goes on (its FFN or experts,
        # the head), as llama.cpp's graphs do: the logits are the last position's, and the KV cache is
        # written before; the runner hands the layer's expert runtime that one row (`rows`)
        self.last = last and self.tokens > 1

    def rows(self, layer: int) -> int:
        """Token columns of the FFN of `layer` and of the stream past it (len(layers): the head's input)."""
        return 1 if self.last and layer >= len(self.spec.layers) - 1 else self.tokens

    # --- inputs: the residual stream with the previous layer's routed experts added -------------

    def _stream(self, net: Net, layer: int, fused: bool = False, carry: Carry | None = None) -> int:
        """The residual stream entering `layer` (len(layers): the final norm) [H, T]. `fused` (every expert
        the previous layer routes the step to is cached): those experts are computed here, from their
        slots, by the very kernel the expert runtime runs them with (ggml_mul_mat_id). `carry`: the
        previous layer's nodes in this same graph (a whole step's graph, `step`): its experts are
        computed here from the router's ids, each expert's slot being `Whole.first[layer] + id`."""
        H, T = self.spec.hidden, self.rows(layer - 1)
        if layer == 0:
            ids = net.tensor(I32, [T], self.buf.tokens.data_ptr())
            return net.get_rows(net.weight(self.spec.embed.ggml, [H, self.spec.vocab]), ids)
        prev = self.spec.layers[layer - 1]
        if carry is not None:
            x = carry.resid
        else:
            x = net.tensor(F32, [H, T], self.buf.resid[(layer - 1) % 2].data_ptr())
        if prev.router is None:
            return x
        K = prev.router.top_k
        if carry is not None:
            first = self.whole.first[prev.index] if self.whole is not None else 0
            moe_in = net.reshape_3d(carry.moe_in, H, 1, T)
            y = self._cached_experts(net, self.experts[prev.index], moe_in, carry.top, first, carry.top)
            w = net.reshape_3d(carry.weights, 1, K, T)
        else:
            if fused:
                moe_in = net.tensor(F32, [H, 1, T], self.buf.moe_in.data_ptr())
                ids = net.tensor(I32, [K, T], self.buf.slots.data_ptr())
                E = self.buf.order.shape[1]  # the expert ids (bias rows): the router's first K
                order = net.tensor(I32, [E, T], self.buf.order.data_ptr())
                experts = net.view_2d(order, K, T, 4 * E, 0)
                y = self._cached_experts(net, self.experts[prev.index], moe_in, ids, 0, experts)  # [H, K, T]
            else:
                y = net.tensor(F32, [H, K, T], self.buf.outputs.data_ptr())  # the runtime's outputs
            w = net.tensor(F32, [1, K, T], self.buf.weights[(layer - 1) % 2].data_ptr())
        return net.add(x, moe_sum(net, y, w, H, K, T))

    def _cached_experts(self, net: Net, p: ExpertTypes, x: int, ids: int, first: int, experts: int) -> int:
        """Each token's experts, slots `first + ids` of the layer's size class, on the FFN norm's output
        x [H, 1, T]: [H, K, T]. `experts` [K, T]: their ids (gpt-oss's bias rows)."""
        arena = p.arena
        slots = arena.slots - first

        def weights(kind: str, type_id: int, cols: int, rows: int) -> int:
            t = net.tensor(type_id, [cols, rows, slots], arena.address[kind] + first * arena.slot_bytes)
            GgmlTensor.from_address(t).nb[2] = arena.slot_bytes  # experts a slot apart
            return t

        def biased(y: int, kind: str) -> int:  # + the bias row of each token's expert (gpt-oss)
            if p.biases is None:
                return y
            b = p.biases[kind]  # [E, out]
            return net.add_id(y, net.weight(b, [b.shape[1], b.shape[0]]), experts)

        H = self.spec.hidden
        g = biased(net.mul_mat_id(weights("gate", p.gate, H, p.inter), x, ids), "gate")  # [I, K, T]
        u = biased(net.mul_mat_id(weights("up", p.up, H, p.inter), x, ids), "up")
        act = net.swiglu_split(g, u) if p.oai is None else net.swiglu_oai(g, u, *p.oai)
        return biased(net.mul_mat_id(weights("down", p.down, p.inter, H), act, ids), "down")

    def can_fuse(self, layer: int) -> bool:
        """Whether the graph of `layer` (len(layers): the head) has a `fused` variant."""
        p = self.experts.get(layer - 1)
        return p is not None and p.arena is not None

    # --- one decoder layer ---------------------------------------------------------------------

    def layer(self, net: Net, layer: Layer, fused: bool = False) -> list[int]:
        """The graph of `layer`; returns its outputs in execution order."""
        buf = self.buf
        c = self._layer(net, layer, self._stream(net, layer.index, fused))
        out = layer.index % 2
        resid = net.fix(c.resid, buf.resid[out].data_ptr())
        if layer.router is None:
            return [*c.writes, resid]
        weights = net.fix(c.picked if c.weights == c.view else c.weights, buf.weights[out].data_ptr())
        moe_in = net.fix(c.moe_in, buf.moe_in.data_ptr())
        return [*c.writes, resid, moe_in, net.fix(c.order, buf.order.data_ptr()), weights]

    def step(self, net: Net) -> list[int]:
        """Every layer and the head as one graph (every routed expert cached, in slots `whole` names):
        the routers' ids pick the slots in the graph, nothing returns to the host between layers."""
        outputs: list[int] = []
        carry = None
        moe = 0
        for layer in self.spec.layers:
            carry = self._layer(net, layer, self._stream(net, layer.index, carry=carry))
            outputs += carry.writes
            if layer.router is not None:  # the routing, for the cache's counts and the tests
                outputs.append(net.fix(net.cont(carry.top), self.buf.routed[moe].data_ptr()))
                moe += 1
        return [*outputs, *self.head(net, carry=carry)]

    def _layer(self, net: Net, layer: Layer, x: int) -> Carry:
        """One decoder layer on the residual stream x [H, T]: its nodes the next layer or the caller
        needs (the KV-cache writes first: the attention reads what they write)."""
        spec = self.spec
        h = self._norm(net, x, layer.attn_norm)
        if layer.linear is not None:  # Gated DeltaNet (its states are this layer's cache)
            writes, attn = delta_net(net, h, layer.linear, self.kv[layer.index], self.tokens, spec.eps)
        else:
            writes, attn = self._attention(net, h, layer.attention, layer.index)
        T = self.rows(layer.index)
        if self.last and layer.index == len(spec.layers) - 1:  # the last position only, from here on
            x, attn = (_last_column(net, t, self.tokens) for t in (x, attn))
        resid = net.add(x, attn)
        h2 = self._norm(net, resid, layer.ffn_norm)
        if layer.router is None:
            return Carry(writes, net.add(resid, self._mlp(net, h2, layer.mlp)))
        r = layer.router
        E = r.weight.rows
        logits = self._linear(net, h2, r.weight, r.logit_bias)  # [E, T]
        if r.softmax_top:  # gpt-oss: the choice by logits, a softmax over the chosen K
            probs = logits
        else:
            probs = net.sigmoid(logits) if r.sigmoid else net.soft_max(logits)
        choice = probs if r.bias is None else net.add(probs, net.weight(r.bias, [E]))
        if r.groups is not None:  # DeepSeek: only the best groups' experts
            choice = group_limit(net, choice, r, T)
        order = net.argsort(choice, SORT_DESC)  # [E, T] i32
        top = net.view_2d(order, r.top_k, T, 4 * E, 0)  # [K, T]
        picked = net.get_rows(net.reshape_3d(probs, 1, E, T), top)  # [1, K, T]
        w = view = net.reshape_2d(picked, r.top_k, T)  # [K, T]
        if r.softmax_top:
            w = net.soft_max(w)
        if r.normalize:
            w = net.div(w, net.sum_rows(w))
        if r.scale != 1.0:
            w = net.scale(w, r.scale)
        if r.shared is not None:
            shared = self._mlp(net, h2, r.shared)
            if r.shared_gate is not None:  # Qwen2-MoE: sigmoid(gate . x) * shared(x)
                gate = net.sigmoid(net.mul_mat(net.weight(r.shared_gate.ggml, [spec.hidden, 1]), h2))
                shared = net.mul(shared, gate)  # [H, T] * [1, T]
            resid = net.add(resid, shared)
        return Carry(writes, resid, h2, order, top, w, picked, view)

    def head(self, net: Net, fused: bool = False, carry: Carry | None = None) -> list[int]:
        """Final norm and LM head on the last position -> logits [V]."""
        spec = self.spec
        x = self._stream(net, len(spec.layers), fused, carry)
        T = self.rows(len(spec.layers))
        if T > 1:
            x = net.view_2d(x, spec.hidden, 1, 4 * spec.hidden, 4 * spec.hidden * (T - 1))
        h = self._norm(net, x, spec.norm)
        logits = net.mul_mat(net.weight(spec.lm_head.ggml, [spec.hidden, spec.vocab]), h)
        return [net.fix(logits, self.buf.logits.data_ptr())]

    # --- the pieces ----------------------------------------------------------------------------

    def _norm(self, net: Net, x: int, weight: torch.Tensor) -> int:
        return net.mul(net.rms_norm(x, self.spec.eps), net.weight(weight, [weight.numel()]))

    def _linear(self, net: Net, x: int, m, bias: torch.Tensor | None = None) -> int:
        y = net.mul_mat(net.weight(m.ggml, [m.cols, m.rows]), x)
        return y if bias is None else net.add(y, net.weight(bias, [bias.numel()]))

    def _mlp(self, net: Net, x: int, mlp: Mlp) -> int:
        g, u = self._linear(net, x, mlp.gate), self._linear(net, x, mlp.up)
        return self._linear(net, net.swiglu_split(g, u), mlp.down)

    def _attention(self, net: Net, h: int, a: Attention, index: int) -> tuple[list[int], int]:
        """Returns (the KV-cache writes, which must run first; the attention output [H, T])."""
        if isinstance(a, Mla):  # DeepSeek's latent attention
            return mla_attention(self, net, h, a, index)
        spec, T, S = self.spec, self.tokens, self.span
        D, N, Nkv = a.head_dim, a.heads, a.kv_heads
        q = self._linear(net, h, a.q, a.biases.get("q"))
        gate = None
        if a.gated:  # Qwen3-Next / Qwen3.5: q_proj also yields the output's gate
            q, gate = output_gate(net, q, N, D, T)
        k = self._linear(net, h, a.k, a.biases.get("k"))
        v = self._linear(net, h, a.v, a.biases.get("v"))
        if a.qk_norm == "full":  # OLMoE: over the whole projection
            q, k = self._norm(net, q, a.q_norm), self._norm(net, k, a.k_norm)
        q, k = net.reshape_3d(q, D, N, T), net.reshape_3d(k, D, Nkv, T)
        if a.qk_norm == "head":  # Qwen3: over each head
            q, k = self._norm(net, q, a.q_norm), self._norm(net, k, a.k_norm)
        pos = net.tensor(I32, [T], self.buf.positions.data_ptr())
        # a scaled rope: transformers' frequencies as freq_factors, its attention_scaling as attn_factor
        freqs = None if spec.rope_freqs is None else net.weight(spec.rope_freqs, [spec.rope_dims // 2])
        rope = (ROPE_NEOX, spec.context, spec.rope_base, 1.0, 0.0, spec.rope_attn, 0.0, 0.0)
        q = net.rope_ext(q, pos, freqs, spec.rope_dims, *rope)
        k = net.rope_ext(k, pos, freqs, spec.rope_dims, *rope)
        kc, vc = self.kv[index]  # f16 [ctx, Nkv * D] each
        rows = net.tensor(I64, [T], self.buf.rows.data_ptr())
        ctx, size = kc.shape[0], kc.element_size()
        k_all = net.tensor(F16, [Nkv * D, ctx], kc.data_ptr())
        v_all = net.tensor(F16, [Nkv * D, ctx], vc.data_ptr())
        writes = [
            net.set_rows(k_all, net.reshape_2d(k, Nkv * D, T), rows),
            net.set_rows(v_all, net.reshape_2d(v, Nkv * D, T), rows),
        ]
        row = Nkv * D * size
        keys = net.view_3d(k_all, D, S, Nkv, row, D * size, 0)  # [D, S, Nkv]
        values = net.view_3d(v_all, D, S, Nkv, row, D * size, 0)
        mask = self.buf.window if a.window else self.buf.mask  # a sliding window: its own mask
        mask = net.tensor(F16, [S, T], mask.data_ptr())
        out = net.flash_attn_ext(net.permute(q, 0, 2, 1, 3), keys, values, mask, a.scale, 0.0, 0.0)
        if a.sinks is not None:  # one more logit per head, whose value is 0 (gpt-oss)
            net.lib.base.ggml_flash_attn_ext_add_sinks(out, net.weight(a.sinks, [N]))
        out = net.reshape_2d(out, D * N, T)  # [D, N, T] -> [D * N, T]
        if gate is not None:
            out = net.mul(out, net.sigmoid(gate))
        return writes, self._linear(net, out, a.o, a.biases.get("o"))


def moe_sum(net: Net, y: int, w: int, H: int, K: int, T: int) -> int:
    """sum_k w_k * y_k per token: y [H, K, T] (contiguous), w [1, K, T] -> [H, T], as llama.cpp's
    build_moe_ffn sums them: each product y_k * w_k rounded once, then the K products added in the
    router's order, one [H, T] view at a time (the same roundings as llama.cpp, so the same bits where
    its kernels are ours). The products by one ggml_out_prod over K*T single-term sums (0 + y*w, fused:
    the rounding of y*w) instead of llama.cpp's broadcast ggml_mul, which multiplies a scalar at a time
    (2 ms a token on 6 Qwen3-30B-A3B-shaped layers); ggml_out_prod summing over K (what this did
    before) rounds otherwise, and parted from llama.cpp's greedy tokens on the trained fixture."""
    weighted = net.out_prod(net.reshape_3d(y, H, 1, K * T), net.reshape_3d(w, 1, 1, K * T))
    summed = net.view_2d(weighted, H, T, 4 * H * K, 0)
    for k in range(1, K):
        summed = net.add(summed, net.view_2d(weighted, H, T, 4 * H * K, 4 * H * k))
    return summed


def _last_column(net: Net, t: int, tokens: int) -> int:
    """The last of the `tokens` columns of a 2-D tensor [H, T] (a view)."""
    g = GgmlTensor.from_address(t)
    return net.view_2d(t, g.ne[0], 1, g.nb[1], g.nb[1] * (tokens - 1))
