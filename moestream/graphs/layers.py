"""The decoder layer as a ggml graph, written once over a model's spec (`graphs/spec.py`) for every family.

One graph per layer and step shape: the previous MoE layer's routed experts summed onto the residual
stream (their outputs are this graph's per-run inputs); RMSNorm and the layer's token mixer, which
builds its own nodes (`Layer.mixer.graph`: attention in `graphs/attention.py`, DeepSeek's MLA in
`graphs/deepseek.py`, a Gated DeltaNet in `graphs/qwen3_next.py`); the residual, the FFN norm, then
either a dense MLP or the router and the shared expert (`graphs/moe.py`). The routed experts are not
in the graph: the runner hands the router's choice to the expert cache between two graphs (hits at
once, each miss as its bytes land), then the next graph adds their outputs. A last graph does the
final norm and the LM head on the last position.

Shapes (ggml order, ne[0] first): H hidden, T tokens of the step, K experts per token, E experts,
D head dim, N / Nkv query / key-value heads, S positions the step's attention spans (a multiple of 256).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from moestream.ggml import tiled
from moestream.ggml.lib import GgmlTensor
from moestream.ggml.net import F16, F32, I32, Net
from moestream.ggml.repack import Repacker
from moestream.graphs.moe import Whole, cached_experts, moe_sum, route, shared_expert
from moestream.graphs.parts import Matrix, Mlp
from moestream.graphs.spec import Layer, ModelSpec
from moestream.runtime.expert_layers import ExpertTypes

SPAN_STEP = 256  # attention spans the KV cache in multiples of this: one graph set serves 256 positions
POOL_MAX = 0  # ggml_op_pool's GGML_OP_POOL_MAX
ARGMAX_CHUNK = 128  # the logits' argmax in chunks of at most this many (`argmax_chunk`)


def argmax_chunk(vocab: int) -> int:
    """The logits per chunk of the greedy argmax (`LayerGraphs.greedy`): the largest divisor of `vocab`
    up to ARGMAX_CHUNK (Qwen3's 151936 and gpt-oss's 201088: 128), or the whole vocabulary where that is
    below 16 (a prime's: one chunk)."""
    size = next(d for d in range(min(ARGMAX_CHUNK, vocab), 0, -1) if vocab % d == 0)
    return size if size >= 16 else vocab


def _chunks(vocab: int) -> int:
    return vocab // argmax_chunk(vocab)


def layer_caches(spec: ModelSpec, ctx: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's cache, as its mixer keeps it (`cache`): (keys, values) f16 [ctx, Nkv * D] of an
    attention layer (MLA: the latent and rotated key rows [ctx, L + R], no values); (conv state f32
    [C, kernel - 1], recurrent state f32 [Hv, D, D]) of a Gated DeltaNet layer."""
    return [layer.mixer.cache(ctx, device) for layer in spec.layers]


def recurrent_bytes(spec: ModelSpec, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Bytes of the recurrent layers' states (held whatever the number of tokens)."""
    return sum(c.nbytes + s.nbytes for layer, (c, s) in zip(spec.layers, caches) if layer.mixer.recurrent)


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
    weights3: int = 0  # weights as [1, K, T]


@dataclass
class StepBuffers:
    """Memory the graphs of one step shape (T tokens, span S) read and write between them (torch shapes)."""

    tokens: torch.Tensor  # i32 [T]
    positions: torch.Tensor  # i32 [T]
    rows: torch.Tensor  # i64 [T]: the KV-cache rows the step writes (its slot's first row + position)
    mask: torch.Tensor  # f16 [T, S]: 0 where a token may attend (in its own slot's rows), -inf elsewhere
    window: torch.Tensor  # f16 [T, S]: the sliding-window layers' mask ([0, S] when none has a window)
    resid: tuple[torch.Tensor, torch.Tensor]  # f32 [T, H] each: layer l writes resid[l % 2]
    moe_in: torch.Tensor  # f32 [T, H]: the routed experts' input (the FFN norm's output)
    order: torch.Tensor  # i32 [T, E]: experts by descending router probability (the first K are routed)
    weights: tuple[torch.Tensor, torch.Tensor]  # f32 [T, K] each: layer l writes weights[l % 2]
    logits: torch.Tensor  # f32 [V], or [B, V] for a batch of B sequences (one token each)
    # i32 [3, R] of one sequence (a batch's: empty): on a backend, each of the logits' R chunks' argmax,
    # and the f32 bits of its maximum and its check (`LayerGraphs.greedy`, `argmax_chunk`)
    argmax: torch.Tensor
    slots: torch.Tensor  # i32 [T, K]: each token's cached experts, by slot, in the router's order
    outputs: torch.Tensor  # f32 [T, K, H]: each token's experts' outputs, from the expert runtime
    # i32 [T, K]: a `mixed` graph's choice of each (token, k) output: t*K + k, the device's from its slot,
    # or T*K + t*K + k, the host's in `outputs` (a GPU tier's miss computed on the CPU)
    pick: torch.Tensor
    routed: torch.Tensor  # i32 [MoE layers, T, K]: the whole-step graph's routing, each MoE layer's
    zeros: torch.Tensor  # i32 [T] of a batch (else empty): every row's matrix in `LayerGraphs.product`
    # i32 [T] of a batch of 8 rows or more (else empty): each row's group (`ggml.tiled.row_groups`), its
    # matrix in `LayerGraphs.product` where the rows go in groups
    groups: torch.Tensor
    # not fields: numpy views of the inputs and the masks' rows as written (`set_inputs`), and of the
    # argmax and its check (`greedy_token`), made on first use
    _host = None
    _argmax = None

    @classmethod
    def make(cls, spec: ModelSpec, tokens: int, span: int, experts: int, seqs: int = 1) -> StepBuffers:
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
            logits=torch.zeros(*((seqs,) if seqs > 1 else ()), spec.vocab, **f32),
            argmax=torch.zeros(3, _chunks(spec.vocab) if seqs == 1 else 0, dtype=torch.int32),
            slots=torch.zeros(tokens, k, dtype=torch.int32),
            outputs=torch.zeros(tokens, k, spec.hidden, **f32),
            pick=torch.zeros(tokens, k, dtype=torch.int32),
            routed=torch.zeros(sum(x.router is not None for x in spec.layers), tokens, k, dtype=torch.int32),
            zeros=torch.zeros(tokens if seqs > 1 else 0, dtype=torch.int32),
            groups=_group_ids(tokens if seqs > 1 and tokens >= tiled.TILED_ROWS else 0),
        )

    def gather(self, alloc: Callable[[int], torch.Tensor]) -> None:
        """Move every buffer into one host block of `alloc(bytes)` (uint8): a device's pinned memory, so
        that its copies to and from the buffers run asynchronously."""
        parts = self.tensors()
        offsets, total = [], 0
        for _, t in parts:
            offsets.append(total)
            total += (t.nbytes + 63) // 64 * 64
        block = alloc(total)
        moved = {}
        for (name, t), offset in zip(parts, offsets):
            view = block[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            moved[id(t)] = view
        for name, value in _buffers(self):
            if isinstance(value, tuple):
                setattr(self, name, tuple(moved.get(id(t), t) for t in value))
            else:
                setattr(self, name, moved.get(id(value), value))
        self._host = self._argmax = None  # their views were of the tensors before

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every buffer (of a pair, each), named, non-empty: what a backend mirrors."""
        out = []
        for name, value in _buffers(self):
            for i, t in enumerate(value if isinstance(value, tuple) else (value,)):
                if t.numel():
                    out.append((f"{name}{i if isinstance(value, tuple) else ''}", t))
        return out

    def set_inputs(
        self, ids: list[int], positions: list[int], first_rows: list[int], window: int | None
    ) -> None:
        """The step's inputs: its tokens, their positions, the KV-cache rows they write (each its slot's
        first row, `first_rows`, plus its position) and the masks (`fill_masks`), written through numpy
        views made once (a decoded token's step: a few microseconds, not torch's tens)."""
        host = self._host or self._views()
        if len(ids) == 1:  # a decoded token: numpy's scalar stores, no arrays made from the lists
            p = positions[0]
            host.tokens[0], host.positions[0], host.rows[0] = ids[0], p, first_rows[0] + p
        else:
            host.tokens[:] = ids
            host.positions[:] = positions
            host.rows[:] = np.add(first_rows, positions)
        self.fill_masks(window, positions)

    def fill_masks(self, window: int | None, positions: list[int] | None = None) -> None:
        """The step's masks for its `positions` (default: the buffer's; each over its own slot's rows):
        causal; and for the sliding layers, also what lies `window` or more positions back
        (transformers' sliding mask). Each row holds 0 on one run of columns, -inf elsewhere: only the
        columns where that run differs from the one the row holds from the step before are written (a
        decoded token's rows: one column each), the whole row where nothing was written yet."""
        host = self._host or self._views()
        if positions is None:
            positions = self.positions.tolist()
        runs = host.runs
        for i, p in enumerate(positions):
            runs[i] = _zero_run(host.mask[i], 0, p, runs[i])
        if host.window is not None:
            wruns = host.window_runs
            for i, p in enumerate(positions):
                wruns[i] = _zero_run(host.window[i], max(0, p - window + 1), p, wruns[i])

    def greedy_token(self) -> int | None:
        """The argmax the step's graph left (`LayerGraphs.greedy`) where it is numpy's: the first chunk
        whose maximum is the largest, that maximum no other chunk's, and every chunk's check saying its
        maximum is its only one and it holds no NaN. Else None: numpy's argmax of the logits decides."""
        if self._argmax is None:
            chunks = self.argmax.numpy()
            self._argmax = (chunks[0], chunks[1].view(np.float32), chunks[2].view(np.float32))
        index, best, check = self._argmax
        c = int(best.argmax())
        size = self.logits.shape[-1] // len(best)
        token = int(index[c])
        if token < 0 or check.min() != 1 - size or check.max() != 1 - size:
            return None
        return c * size + token if np.count_nonzero(best == best[c]) == 1 else None

    def _views(self) -> _HostViews:
        self._host = _HostViews(self)
        return self._host


class _HostViews:
    """A step's input buffers as numpy arrays (made once: `.numpy()` is ~1 us a call), and each mask
    row's run of zero columns (first, last) as last written (None: not written yet)."""

    def __init__(self, b: StepBuffers) -> None:
        self.tokens, self.positions, self.rows = b.tokens.numpy(), b.positions.numpy(), b.rows.numpy()
        self.mask = b.mask.numpy()
        self.window = b.window.numpy() if b.window.numel() else None
        self.runs: list[tuple[int, int] | None] = [None] * b.mask.shape[0]
        self.window_runs: list[tuple[int, int] | None] = [None] * b.mask.shape[0]


def _zero_run(row: np.ndarray, lo: int, hi: int, was: tuple[int, int] | None) -> tuple[int, int]:
    """`row` 0 on columns [lo, hi], -inf elsewhere, given that it holds that for `was` (None: unknown);
    returns (lo, hi). Only the columns in one run and not the other are written (slices out of order are
    empty): the same bytes as writing the whole row."""
    if was is None:
        row[:lo] = -np.inf
        row[lo : hi + 1] = 0.0
        row[hi + 1 :] = -np.inf
        return lo, hi
    lo0, hi0 = was
    if lo == lo0 and hi0 < hi:  # the run grew to the right (a decoded token: one column)
        row[hi0 + 1 : hi + 1] = 0.0
        return lo, hi
    # the columns that were zero and are now left of the run, right of it; those now zero that were left
    # of the old run, right of it (a decoded token's step: the last, one column)
    for start, end, value in (
        (lo0, min(hi0 + 1, lo), -np.inf),
        (max(lo0, hi + 1), hi0 + 1, -np.inf),
        (lo, min(hi + 1, lo0), 0.0),
        (max(lo, hi0 + 1), hi + 1, 0.0),
    ):
        if start < end:
            row[start:end] = value
    return lo, hi


def _buffers(b: StepBuffers) -> list[tuple[str, object]]:
    """The buffers' attributes (not the private ones: `_host`)."""
    return [(name, value) for name, value in vars(b).items() if not name.startswith("_")]


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
        segments: tuple[tuple[int, int], ...] = ((0, 0),),
        mixed: bool = False,
        kv_views: list[tuple[int, int, int]] | None = None,
        trunk: dict[int, tuple[int, int, int]] | None = None,
    ) -> None:
        """`mixed`: the `fused` graphs take each (token, k) output from the device's slots or from the
        host's `outputs`, as `pick` says (a GPU tier whose misses the CPU computes). `kv_views`: a
        batch's attention appends each (keys or values view's address, its segment, its bytes a KV
        row) there, so that `GraphSet.rebase` can point them at other slots' rows. `trunk`: a matrix's
        address -> (its repacked copy's address, that copy's ggml buffer, its kernels), for the trunk's
        products that read a copy in ggml's repacked layout (`engine/repacked.py`, RepackedTrunk)."""
        self.spec, self.kv, self.buf = spec, kv, buf
        self.trunk = trunk or {}
        self.kv_views = kv_views
        self.mixed = mixed
        self.experts = experts or {}  # MoE layer -> its routed experts' ggml types, for `fused` graphs
        self.whole = whole  # where each MoE layer's experts lie, for the `step` graph
        self.tokens = buf.tokens.numel()
        self.span = buf.mask.shape[1]
        # (first KV-cache row of its slot, its tokens) per sequence, in the step's token order: one
        # sequence (a prefill chunk, a token decoded alone), or a batch of sequences one token each
        self.segments = segments if len(segments) > 1 else ((segments[0][0], self.tokens),)
        self.batch = len(self.segments) > 1  # every position goes on to the head: logits [B, V]
        # `last`: past the last layer's attention only the last position goes on (its FFN or experts,
        # the head), as llama.cpp's graphs do: the logits are the last position's, and the KV cache is
        # written before; the runner hands the layer's expert runtime that one row (`rows`)
        self.last = last and self.tokens > 1 and not self.batch

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
        p = self.experts.get(prev.index)
        if carry is not None:
            first = self.whole.first[prev.index] if self.whole is not None else 0
            moe_in = net.reshape_3d(carry.moe_in, H, 1, T)
            return net.add(x, self.routed(net, p, moe_in, carry.top, first, carry.top, carry.weights3))
        w = net.tensor(F32, [1, K, T], self.buf.weights[(layer - 1) % 2].data_ptr())
        if fused:
            moe_in = net.tensor(F32, [H, 1, T], self.buf.moe_in.data_ptr())
            ids = net.tensor(I32, [K, T], self.buf.slots.data_ptr())
            E = self.buf.order.shape[1]  # the expert ids (bias rows): the router's first K
            order = net.tensor(I32, [E, T], self.buf.order.data_ptr())
            experts = net.view_2d(order, K, T, 4 * E, 0)
            if not self.mixed:
                return net.add(x, self.routed(net, p, moe_in, ids, 0, experts, w))
            # each output the device's or the host's: rows of [device | host], copied
            y = cached_experts(net, p, H, moe_in, ids, 0, experts)  # [H, K, T]
            host = net.tensor(F32, [H, K * T], self.buf.outputs.data_ptr())
            both = net.concat(net.reshape_2d(y, H, K * T), host, 1)  # [H, 2KT]
            pick = net.tensor(I32, [K * T], self.buf.pick.data_ptr())
            y = net.reshape_3d(net.get_rows(both, pick), H, K, T)
        else:
            y = net.tensor(F32, [H, K, T], self.buf.outputs.data_ptr())  # the runtime's outputs
        return net.add(x, moe_sum(net, y, w, H, K, T))

    def routed(self, net: Net, p: ExpertTypes, x: int, ids: int, first: int, experts: int, w: int) -> int:
        """The routed experts' weighted sum [H, T] from the cache's slots (`cached_experts` on the FFN
        norm's output x [H, 1, T], slots `first + ids` [K, T], expert ids `experts` [K, T], weights w
        [1, K, T]). A batch of 8 rows or more on the CPU, over K-quant experts: in groups of at most 7
        rows (`ggml.tiled`), each group's products nodes of their own (an expert then has at most 7
        rows in a node: vec_dot, each row's bits alone), the groups' sums concatenated [H, T]."""
        H, T = self.spec.hidden, GgmlTensor.from_address(x).ne[2]
        K = GgmlTensor.from_address(ids).ne[0]
        if not self.batch or net.memory is not None or not tiled.split(p.stored_types(), T):
            return moe_sum(net, cached_experts(net, p, H, x, ids, first, experts), w, H, K, T)
        out = None
        for start, n in tiled.row_groups(T):
            part = (
                _tokens(net, x, 2, start, n),
                _tokens(net, ids, 1, start, n),
                _tokens(net, experts, 1, start, n),
            )
            y = cached_experts(net, p, H, part[0], part[1], first, part[2])
            s = moe_sum(net, y, _tokens(net, w, 2, start, n), H, K, n)
            out = s if out is None else net.concat(out, s, 1)
        return out

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
            if layer.router is not None:
                outputs.append(carry.weights3)  # the router's nodes in one run (see moe.route)
                if self.tokens > 1:  # the routing, for the cache's counts (one token: K experts a layer)
                    outputs.append(net.fix(net.cont(carry.top), self.buf.routed[moe].data_ptr()))
                moe += 1
        head = self.head(net, carry=carry)
        if net.memory is not None and not self.batch:  # the greedy token, read back without the logits
            head += self.greedy(net, head[0])
        return [*outputs, *head]

    def _layer(self, net: Net, layer: Layer, x: int) -> Carry:
        """One decoder layer on the residual stream x [H, T]: its nodes the next layer or the caller
        needs (the KV-cache writes first: the attention reads what they write)."""
        spec = self.spec
        h = self.norm(net, x, layer.attn_norm)
        writes, attn = layer.mixer.graph(self, net, h, layer.index)  # its cache: self.kv[layer.index]
        T = self.rows(layer.index)
        if self.last and layer.index == len(spec.layers) - 1:  # the last position only, from here on
            x, attn = (_tokens(net, t, 1, self.tokens - 1, 1) for t in (x, attn))
        resid = net.add(x, attn)
        h2 = self.norm(net, resid, layer.ffn_norm)
        if layer.router is None:
            return Carry(writes, net.add(resid, self.mlp(net, h2, layer.mlp)))
        c = route(self, net, h2, layer.router, T)
        shared = shared_expert(self, net, h2, layer.router, spec.hidden)
        if shared is not None:
            resid = net.add(resid, shared)
        return Carry(writes, resid, h2, c.order, c.top, c.weights, c.picked, c.view, c.weights3)

    def head(self, net: Net, fused: bool = False, carry: Carry | None = None) -> list[int]:
        """Final norm and LM head on the last position -> logits [V]."""
        spec = self.spec
        x = self._stream(net, len(spec.layers), fused, carry)
        T = self.rows(len(spec.layers))
        if T > 1 and not self.batch:
            x = net.view_2d(x, spec.hidden, 1, 4 * spec.hidden, 4 * spec.hidden * (T - 1))
        h = self.norm(net, x, spec.norm)
        logits = self.product(net, spec.lm_head.ggml, spec.hidden, spec.vocab, h)
        if self.batch:  # [V, B] out of a reshape: a view, and a fixed result must be a node of its own
            logits = net.cont(logits)
        return [net.fix(logits, self.buf.logits.data_ptr())]

    def greedy(self, net: Net, logits: int) -> list[int]:
        """The argmax of the fixed logits [V] (the greedy token) in R chunks of `argmax_chunk(V)` = C
        logits, into `buf.argmax` [3, R]: each chunk's argmax, its maximum and its check. A run copies back
        either these 12 R bytes or the logits (`Net.on_demand`); the host takes the first chunk of the
        largest maximum (`StepBuffers.greedy_token`). In chunks because ggml's argmax gives a row one block
        of threads: one row of Qwen3's 151936 logits took 60 us of a 2 ms step on an H100 (12-07), its
        check as one row 24 us more; 1187 rows of 128, a few us each. On a backend only: the CPU path
        takes numpy's argmax of its logits in place (ggml's CPU argmax is a scalar loop).

        numpy's argmax is the first maximum, or the first NaN; ggml's (llama-cpp-python 0.3.36's) is not,
        where the maximum is tied or a logit is NaN. The CPU's (ggml-cpu/vec.h, ggml_vec_argmax_f32:
        `max = MAX(max, x[i]); if (max == x[i]) { idx = i; }` from idx 0) is the last maximum, and a NaN
        restarts its running maximum at the logit after it. CUDA's (ggml-cuda/argmax.cu, argmax_f32: each
        thread keeps `val > maxval` over its strided columns from -FLT_MAX and -1, then its warp and the
        block reduce by `val > maxval` through xor shuffles) is one of the tied maxima by lane, not the
        first (maxima at columns 1 and 2: 2), skips NaN, and is -1 where no logit exceeds -FLT_MAX. Both
        are numpy's exactly where one logit of the chunk is above every other and none is NaN, which the
        check tells: sum(sgn(chunk - its max pool)) is 1 - C then and only then (-1 a logit below, 0 equal
        or NaN, 1 above: integers below 2^24, exact in any order of summing; the pool's maximum, from
        -FLT_MAX by `>` on the CPU and CUDA's fmaxf, skips NaN and is a logit of the chunk or -FLT_MAX,
        whose logits then give -1 each where they are -inf, 0 where NaN: never 1 - C). Every chunk's check
        is asked, so a NaN anywhere is seen; a tie at the top of a chunk that does not hold the largest
        maximum sends the step to numpy too (rarer than exact, and then numpy decides exactly)."""
        V, at = self.spec.vocab, self.buf.argmax.data_ptr()
        C = argmax_chunk(V)
        R = V // C
        net.on_demand(logits)
        chunks = net.reshape_2d(logits, C, R)
        index = net.on_demand(net.fix(net.argmax(chunks), at), stand_in=True)  # i32 [R]
        best = net.pool_2d(chunks, POOL_MAX, C, 1, C, 1, 0.0, 0.0)  # f32 [1, R]
        best = net.on_demand(net.fix(best, at + 4 * R), stand_in=True)
        terms = net.sgn_inplace(net.sub(chunks, best))  # [C, R]
        return [index, best, net.on_demand(net.fix(net.sum_rows(terms), at + 8 * R), stand_in=True)]

    # --- the pieces every mixer and FFN builds with ---------------------------------------------

    def attend(
        self,
        net: Net,
        q: int,
        rows: Callable[[int], tuple[int, int]],
        mask: torch.Tensor,
        scale: float,
        sinks: int | None = None,
    ) -> int:
        """Flash attention of q [Dq, N, T] (contiguous) over each sequence's own KV rows ->
        [Dv, N, T]. `rows(first)`: the (keys, values) views of the span from KV-cache row `first` (its
        slot's first row); `mask`: the step's mask buffer [T, S]. One sequence: one flash attention;
        a batch: one per sequence, its query column, its slot's rows and its mask row, the outputs
        concatenated (each token's attention then has the operands and the shape it has alone)."""
        S = self.span
        qt = GgmlTensor.from_address(q)
        out = None
        column = 0
        for segment, (first, n) in enumerate(self.segments):
            part = (
                q
                if not self.batch
                else net.view_3d(q, qt.ne[0], qt.ne[1], n, qt.nb[1], qt.nb[2], column * qt.nb[2])
            )
            keys, values = rows(first)
            if self.batch and self.kv_views is not None:  # [D, S, ...] views: dim 1 steps a KV row
                for t in (keys, values):
                    self.kv_views.append((t, segment, GgmlTensor.from_address(t).nb[1]))
            m = net.tensor(F16, [S, n], mask.data_ptr() + column * S * mask.element_size())
            o = net.flash_attn_ext(net.query(part), keys, values, m, scale, 0.0, 0.0)
            if sinks is not None:  # one more logit per head, whose value is 0 (gpt-oss)
                net.lib.base.ggml_flash_attn_ext_add_sinks(o, sinks)
            out = o if out is None else net.concat(out, o, 2)  # [Dv, N, T]
            column += n
        return out

    def norm(self, net: Net, x: int, weight: torch.Tensor) -> int:
        """RMSNorm(x) * weight."""
        return net.mul(net.rms_norm(x, self.spec.eps), net.weight(weight, [weight.numel()]))

    def linear(self, net: Net, x: int, m: Matrix, bias: torch.Tensor | None = None) -> int:
        """x [cols, T] -> W x (+ bias) [rows, T]."""
        y = self.product(net, m.ggml, m.cols, m.rows, x)
        return y if bias is None else net.add(y, net.weight(bias, [bias.numel()]))

    def product(self, net: Net, w: torch.Tensor | tuple[int, int], cols: int, rows: int, x: int) -> int:
        """W x: the weight `w` [rows, cols] (a `Matrix.ggml`) times x [cols, T] -> [rows, T]. A batch's
        rows through ggml_mul_mat_id over the one matrix: ggml_mul_mat takes llamafile's sgemm for
        two rows or more, which rounds otherwise than the vec_dot it takes for one, so a token decoded
        beside others would not get the bits it gets alone; mul_mat_id takes vec_dot for every row
        (the weights still read once for all of them) up to 7 rows of a matrix. From 8 on, ggml takes
        its tiled kernel for a K-quant matrix (chosen per matrix of a mul_mat_id: its rows there), which
        rounds otherwise too: there, on the CPU, the matrix is given as G matrices at the same address
        (a stride of 0 between them), row t to its group's (`ggml.tiled.row_groups`, at most 7 rows
        each; `groups`): one node, its output in the rows' order, the matrix read once a group."""
        if not self.batch:
            return net.mul_mat(self._weight(net, w, [cols, rows]), x)
        T = GgmlTensor.from_address(x).ne[1]
        x3 = net.reshape_3d(x if _contiguous(x) else net.cont(x), cols, 1, T)
        if self._split(net, w, T):
            weight = net.weight(w, [cols, rows, len(tiled.row_groups(T))])
            GgmlTensor.from_address(weight).nb[2] = 0  # every group's matrix the one matrix
            ids = net.tensor(I32, [1, T], self.buf.groups.data_ptr())
        else:
            weight = self._weight(net, w, [cols, rows, 1])
            ids = net.tensor(I32, [1, T], self.buf.zeros.data_ptr())
        return net.reshape_2d(net.mul_mat_id(weight, x3, ids), rows, T)

    def _split(self, net: Net, w: torch.Tensor | tuple[int, int], rows: int) -> bool:
        """Whether a batch's product of `rows` rows over the stored matrix `w` goes in groups of at most
        7 rows (`ggml.tiled`): on the CPU (ggml's CUDA backend has no tiled kernel), not over a repacked
        copy (its own kernels, which ggml's tiled kernel leaves alone)."""
        if net.memory is not None or not isinstance(w, tuple) or w[0] in self.trunk:
            return False
        return tiled.split(w[1], rows)

    def _weight(self, net: Net, w: torch.Tensor | tuple[int, int], ne: list[int]) -> int:
        """A product's weight leaf: over its repacked copy where `trunk` has one (marked with its
        kernels), else over the matrix as stored."""
        copy = self.trunk.get(w[0]) if self.trunk and isinstance(w, tuple) else None
        if copy is None:
            return net.weight(w, ne)
        t = net.tensor(w[1], ne, copy[0])
        Repacker.mark(t, copy[1], copy[2])
        return t

    def mlp(self, net: Net, x: int, mlp: Mlp) -> int:
        """A SwiGLU MLP: down(silu(gate x) * up x)."""
        g, u = self.linear(net, x, mlp.gate), self.linear(net, x, mlp.up)
        return self.linear(net, net.swiglu_split(g, u), mlp.down)


def _group_ids(rows: int) -> torch.Tensor:
    """i32 [rows]: each row's group of `ggml.tiled.row_groups` (empty for none)."""
    ids = torch.zeros(rows, dtype=torch.int32)
    for g, (first, n) in enumerate(tiled.row_groups(rows) if rows else ()):
        ids[first : first + n] = g
    return ids


def _contiguous(t: int) -> bool:
    """Whether the f32 2-D tensor t is laid out row after row with no gap."""
    g = GgmlTensor.from_address(t)
    return g.nb[0] == 4 and g.nb[1] == 4 * g.ne[0]


def _tokens(net: Net, t: int, dim: int, start: int, n: int) -> int:
    """A view of tokens [start, start + n) of t, a 2-D or 3-D tensor whose dimension `dim` (1 or 2) is
    the tokens'."""
    g = GgmlTensor.from_address(t)
    if dim == 1:
        return net.view_2d(t, g.ne[0], n, g.nb[1], start * g.nb[1])
    return net.view_3d(t, g.ne[0], g.ne[1], n, g.nb[1], g.nb[2], start * g.nb[2])
