"""A MoE layer's FFN as graph pieces (llama.cpp's build_moe_ffn): the router's choice, the shared expert,
the cached routed experts computed from the expert cache's slots, and their weighted sum.

The router: softmax (or sigmoid) scores, an optional bias for the choice only, DeepSeek's group limit,
argsort, the first K; their weights normalised and scaled as the family says (`parts.Router`). The
routed experts are not always in the graph: the runner hands the router's choice to the expert cache
between two graphs, or, where every one is cached, the next graph computes them from the cache's slots
(`cached_experts`: one ggml_mul_mat_id per matrix kind over a size class's slots, as `ExpertTypes`
says, which the runner has from `runtime/expert_layers.py`).

Shapes (ggml order, ne[0] first): H hidden, T tokens, K experts per token, E experts, I the experts'
intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moestream.ggml.lib import GgmlTensor
from moestream.ggml.net import SORT_DESC, Net
from moestream.ggml.repack import Repacker
from moestream.graphs.parts import Router
from moestream.runtime.expert_layers import ExpertTypes

_DROPPED = -1e30  # added to the choice of an expert outside the kept groups: never among the top k


@dataclass(frozen=True)
class Whole:
    """Every routed expert cached, for good: MoE layer -> the slot of its expert 0 in its size class
    (expert e in slot first + e), so the routers' ids address the slots inside one graph."""

    first: dict[int, int]


@dataclass
class Choice:
    """The router's nodes (results, not yet placed)."""

    order: int  # [E, T] i32 experts by descending router choice
    top: int  # [K, T] i32 a view of order's first K rows
    weights: int  # [K, T] the routed experts' weights
    picked: int  # [1, K, T] the routers' probabilities of `top`
    view: int  # picked as [K, T] (weights is this view when nothing normalises or scales)
    weights3: int  # weights as [1, K, T], what the experts' sum multiplies by


def route(g: Any, net: Net, h: int, r: Router, tokens: int) -> Choice:
    """The router of `r` on the FFN norm's output h [H, T], built by `g` (a `LayerGraphs`)."""
    E, T = r.weight.rows, tokens
    logits = g.linear(net, h, r.weight, r.logit_bias)  # [E, T]
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
    if r.normalize:  # the sum clamped as llama.cpp's build_moe_ffn clamps it
        w = net.div(w, net.clamp(net.sum_rows(w), 6.103515625e-5, float("inf")))
    if r.scale != 1.0:
        w = net.scale(w, r.scale)
    # in llama.cpp's order of nodes (softmax .. argsort .. get_rows .. sum_rows, clamp, div, reshape),
    # which ggml's CUDA backend computes as one fused kernel where a step is built so (`step`)
    return Choice(order, top, w, picked, view, net.reshape_3d(w, 1, r.top_k, T))


def shared_expert(g: Any, net: Net, h: int, r: Router, hidden: int) -> int | None:
    """The shared expert's output [H, T] on the FFN norm's output h (Qwen2-MoE's: times sigmoid(gate . h)),
    or None where the layer has none."""
    if r.shared is None:
        return None
    shared = g.mlp(net, h, r.shared)
    if r.shared_gate is not None:  # Qwen2-MoE: sigmoid(gate . x) * shared(x)
        gate = net.sigmoid(g.product(net, r.shared_gate.ggml, hidden, 1, h))
        shared = net.mul(shared, gate)  # [H, T] * [1, T]
    return shared


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


def cached_experts(net: Net, p: ExpertTypes, hidden: int, x: int, ids: int, first: int, experts: int) -> int:
    """Each token's experts, slots `first + ids` of the layer's size class, on the FFN norm's output
    x [H, 1, T]: [H, K, T]. `experts` [K, T]: their ids (gpt-oss's bias rows)."""
    arena = p.arena
    slots = arena.slots - first

    shapes = p.shapes(hidden)

    def weights(kind: str) -> int:
        type_id, cols, rows = shapes[kind]
        t = net.tensor(type_id, [cols, rows, slots], arena.address[kind] + first * arena.stride(kind))
        GgmlTensor.from_address(t).nb[2] = arena.stride(kind)  # experts a slot apart
        if arena.repacked and kind in arena.repacked:  # a copy in ggml's repacked layout: its kernels
            Repacker.mark(t, *arena.repacked[kind])
        return t

    def biased(y: int, kind: str) -> int:  # + the bias row of each token's expert (gpt-oss)
        if p.biases is None:
            return y
        b = p.biases[kind]  # [E, out]
        return net.add_id(y, net.weight(b, [b.shape[1], b.shape[0]]), experts)

    g = biased(net.mul_mat_id(weights("gate"), x, ids), "gate")  # [I, K, T]
    u = biased(net.mul_mat_id(weights("up"), x, ids), "up")
    act = net.swiglu_split(g, u) if p.oai is None else net.swiglu_oai(g, u, *p.oai)
    return biased(net.mul_mat_id(weights("down"), act, ids), "down")


def moe_sum(net: Net, y: int, w: int, H: int, K: int, T: int) -> int:
    """sum_k w_k * y_k per token: y [H, K, T] (contiguous), w [1, K, T] -> [H, T], as llama.cpp's
    build_moe_ffn sums them: each product y_k * w_k rounded once, then the K products added in the
    router's order, one [H, T] view at a time (the same roundings as llama.cpp, so the same bits where
    its kernels are ours). The products by one ggml_out_prod over K*T single-term sums (0 + y*w, fused:
    the rounding of y*w) instead of llama.cpp's broadcast ggml_mul, which multiplies a scalar at a time
    (2 ms a token on 6 Qwen3-30B-A3B-shaped layers); ggml_out_prod summing over K (what this did
    before) rounds otherwise, and parted from llama.cpp's greedy tokens on the trained fixture."""
    if net.memory is not None:  # a backend's (ggml's CUDA: one kernel; out_prod there is cuBLAS, batched)
        weighted = net.mul(y, w)  # the same roundings: each y*w once
    else:
        weighted = net.out_prod(net.reshape_3d(y, H, 1, K * T), net.reshape_3d(w, 1, 1, K * T))
    summed = net.view_2d(weighted, H, T, 4 * H * K, 0)
    for k in range(1, K):
        summed = net.add(summed, net.view_2d(weighted, H, T, 4 * H * K, 4 * H * k))
    return summed
