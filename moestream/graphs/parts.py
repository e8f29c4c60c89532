"""The pieces of a ggml graph's spec that every family's reader shares: a weight matrix as ggml reads it,
an MLP, a router (and the softmax router most families read), and the refusal (`NoGraph`). The family
modules (`graphs/qwen3_moe.py`, ...) read the rest; `graphs/spec.py` puts a model's spec together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moestream.ggml.net import FLOAT_TYPES
from moestream.model.quantized import QuantEmbedding, QuantLinear


class NoGraph(Exception):
    """This model's layers are not (yet) computed by ggml graphs; the message says why."""


@dataclass
class Matrix:
    """A weight W [rows, cols] (y = x @ W^T) as ggml reads it: `address` of `type_id` data; `ref` keeps
    that memory alive."""

    ref: torch.Tensor
    address: int
    type_id: int
    rows: int
    cols: int

    @property
    def ggml(self) -> tuple[int, int]:
        return self.address, self.type_id


@dataclass
class Mlp:
    gate: Matrix
    up: Matrix
    down: Matrix


@dataclass
class Router:
    weight: Matrix  # [experts, hidden]
    top_k: int
    normalize: bool  # the top-k probabilities divided by their sum
    shared: Mlp | None = None  # a shared expert (Qwen2-MoE: gated by sigmoid(shared_gate . x))
    shared_gate: Matrix | None = None
    sigmoid: bool = False  # scores are sigmoid(logits) (GLM-4.5), else softmax(logits)
    bias: torch.Tensor | None = None  # f32 [experts], added to the scores for the choice only
    scale: float = 1.0  # the chosen weights' factor (routed_scaling_factor)
    logit_bias: torch.Tensor | None = None  # f32 [experts]: the router linear's bias (gpt-oss)
    # gpt-oss: the weights are a softmax over the chosen K logits (= softmax over all, normalised over K)
    softmax_top: bool = False
    # group-limited routing: (groups, groups kept, a group's score: the sum of its best this many scores)
    groups: tuple[int, int, int] | None = None


def matrix(module: nn.Module, permuted_inputs: bool = False) -> Matrix:
    """The weight of an nn.Linear / nn.Embedding (float) or a QuantLinear / QuantEmbedding (blocks).
    A QuantLinear whose input is permuted (`QuantLinear.inputs`) only where the caller says its graph
    permutes the activation (`permuted_inputs`): its blocks are the stored matrix, not the model's."""
    if getattr(module, "inputs", None) is not None and not permuted_inputs:
        raise NoGraph(f"{module} multiplies a permuted input, which this graph does not make")
    if isinstance(module, (QuantLinear, QuantEmbedding)):
        from moestream import ggml

        return Matrix(
            module.raw, module.raw.data_ptr(), ggml.ggml_type(module.stored.name).id, *_shape(module)
        )
    w = module.weight.detach()
    if w.dtype not in FLOAT_TYPES or w.device.type != "cpu":
        raise NoGraph(f"a {w.dtype} weight on {w.device} is not a ggml weight")
    if not w.is_contiguous():
        w = w.contiguous()
    return Matrix(w, w.data_ptr(), FLOAT_TYPES[w.dtype], w.shape[0], w.shape[1])


def router_matrix(module: nn.Module) -> Matrix:
    """A router's weight as llama.cpp computes it: float32 (its converter stores routers F32, and ggml's
    bf16/f16 products round the activations to 16 bits first: on the trained fixture's bf16 GGUF that
    moved the first token's log-probabilities by up to 0.15 and changed the greedy token; in float32
    they equal llama-server's to 5 decimals). A copy where the model holds it in 16 bits
    (`ModelSpec.copied_bytes`); a router in GGUF blocks stays as stored."""
    m = matrix(module)
    f32 = FLOAT_TYPES[torch.float32]
    if m.type_id == f32 or m.type_id not in FLOAT_TYPES.values():  # float32 already, or GGUF blocks
        return m
    w = m.ref.float()
    return Matrix(w, w.data_ptr(), f32, m.rows, m.cols)


def read_mlp(module: nn.Module) -> Mlp:
    """A SwiGLU MLP's three projections (a dense layer's FFN, a shared expert)."""
    return Mlp(matrix(module.gate_proj), matrix(module.up_proj), matrix(module.down_proj))


def softmax_router(gate: nn.Module, cfg: Any, normalize: bool) -> Router:
    """The router most families have: softmax over the gate's logits, top-k, the chosen probabilities
    divided by their sum where `normalize`."""
    return Router(router_matrix(gate), int(cfg.num_experts_per_tok), normalize)


def _shape(module: nn.Module) -> tuple[int, int]:
    return module.rows, module.cols


def f32(t: torch.Tensor) -> torch.Tensor:
    """`t` as a contiguous float32 tensor of its own (a norm's weight, a bias)."""
    return t.detach().float().contiguous()
