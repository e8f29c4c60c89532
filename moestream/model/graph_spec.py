"""What a ggml graph of a transformers model needs: each layer's weights and hyperparameters.

Read once at load from the model transformers built (its trunk modules hold the weights: float
tensors, or a GGUF file's blocks in `QuantLinear`/`QuantEmbedding`), so the graphs compute the very
bytes the transformers path computes. This module is the only place on the ggml path that looks at a
family's module names; `graph_spec` refuses, with the reason, what the graphs do not compute yet, and
the engine then runs transformers' forward instead (the mode line says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moestream.hfconfig import text_config
from moestream.model.quantized import QuantEmbedding, QuantLinear
from moestream.model.streaming import StreamingExperts

# families whose decoder layer moestream builds as ggml graphs (standard attention, softmax routers)
GRAPH_FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "glm4_moe")
_FLOAT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}  # GGML_TYPE_*


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


@dataclass
class Layer:
    index: int
    attn_norm: torch.Tensor  # f32 [hidden]
    ffn_norm: torch.Tensor
    attention: Attention
    router: Router | None  # a MoE layer: its routed experts stream; else `mlp` is dense
    mlp: Mlp | None


@dataclass
class ModelSpec:
    family: str
    hidden: int
    vocab: int
    eps: float
    rope_base: float
    rope_dims: int
    context: int  # the positions the model was trained for (rope's n_ctx_orig)
    embed: Matrix  # [vocab, hidden]
    norm: torch.Tensor
    lm_head: Matrix
    layers: list[Layer]

    @property
    def top_k(self) -> int:
        return next(layer.router.top_k for layer in self.layers if layer.router is not None)


def matrix(module: nn.Module) -> Matrix:
    """The weight of an nn.Linear / nn.Embedding (float) or a QuantLinear / QuantEmbedding (blocks)."""
    if isinstance(module, (QuantLinear, QuantEmbedding)):
        from moestream import ggml

        return Matrix(
            module.raw, module.raw.data_ptr(), ggml.ggml_type(module.stored.name).id, *_shape(module)
        )
    w = module.weight.detach()
    if w.dtype not in _FLOAT_TYPES or w.device.type != "cpu":
        raise NoGraph(f"a {w.dtype} weight on {w.device} is not a ggml weight")
    if not w.is_contiguous():
        w = w.contiguous()
    return Matrix(w, w.data_ptr(), _FLOAT_TYPES[w.dtype], w.shape[0], w.shape[1])


def _shape(module: nn.Module) -> tuple[int, int]:
    return module.rows, module.cols


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


def _rope(cfg: Any, head_dim: int) -> tuple[float, int]:
    params = getattr(cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise NoGraph(f"rope type {rope_type!r} is not in the graphs yet")
    base = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if base is None:
        raise NoGraph("the config names no rope_theta")
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0
    return float(base), int(head_dim * factor)


def _attention(module: nn.Module, cfg: Any, family: str) -> Attention:
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    if getattr(cfg, "clip_qkv", None):
        raise NoGraph("clip_qkv is not in the graphs yet")
    projections = {n: getattr(module, f"{n}_proj") for n in ("q", "k", "v", "o")}
    biases = {n: _f32(p.bias) for n, p in projections.items() if getattr(p, "bias", None) is not None}
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    qk = None
    if q_norm is not None:
        qk = "head" if q_norm.weight.numel() == head_dim else "full"
    return Attention(
        *(matrix(projections[n]) for n in ("q", "k", "v", "o")),
        biases=biases,
        q_norm=_f32(q_norm.weight) if q_norm is not None else None,
        k_norm=_f32(k_norm.weight) if k_norm is not None else None,
        qk_norm=qk,
        heads=heads,
        kv_heads=int(cfg.num_key_value_heads),
        head_dim=head_dim,
        scale=float(getattr(module, "scaling", head_dim**-0.5)),
    )


def _mlp(module: nn.Module) -> Mlp:
    return Mlp(matrix(module.gate_proj), matrix(module.up_proj), matrix(module.down_proj))


def _router(mlp: nn.Module, cfg: Any, family: str) -> Router:
    gate = mlp.gate
    normalize = True if family == "mixtral" else bool(getattr(cfg, "norm_topk_prob", False))
    router = Router(matrix(gate), int(cfg.num_experts_per_tok), normalize)
    if getattr(mlp, "shared_expert", None) is not None:
        router.shared = _mlp(mlp.shared_expert)
        router.shared_gate = matrix(mlp.shared_expert_gate)
    if family == "glm4_moe":  # sigmoid scores, a bias for the choice, groups, a scaling factor
        groups, kept = int(getattr(cfg, "n_group", 1) or 1), int(getattr(cfg, "topk_group", 1) or 1)
        if groups > 1 and kept < groups:
            raise NoGraph("group-limited routing (topk_group < n_group) is not in the graphs yet")
        router.sigmoid = True
        router.bias = _f32(gate.e_score_correction_bias)
        router.scale = float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)
        router.shared = _mlp(mlp.shared_experts)
    return router


def _check_config(cfg: Any, family: str) -> None:
    if family not in GRAPH_FAMILIES:
        raise NoGraph(f"{family} has no ggml graph yet (graphs: {', '.join(GRAPH_FAMILIES)})")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise NoGraph(f"activation {cfg.hidden_act!r} is not in the graphs yet")
    window = getattr(cfg, "sliding_window", None)
    if window and (family == "mixtral" or getattr(cfg, "use_sliding_window", False)):
        raise NoGraph("sliding-window attention is not in the graphs yet")


def graph_spec(model: nn.Module, config: Any) -> ModelSpec:
    """The ggml graphs' view of `model` (its trunk on the CPU).

    Raises:
        NoGraph: the family, or something this checkpoint uses, is not computed by the graphs yet.
    """
    cfg = text_config(config)
    family = str(config.model_type)
    _check_config(cfg, family)
    inner = model.model
    layers = []
    for i, layer in enumerate(inner.layers):
        mlp = layer.mlp
        moe = isinstance(getattr(mlp, "experts", None), StreamingExperts)
        layers.append(
            Layer(
                index=i,
                attn_norm=_f32(layer.input_layernorm.weight),
                ffn_norm=_f32(layer.post_attention_layernorm.weight),
                attention=_attention(layer.self_attn, cfg, family),
                router=_router(mlp, cfg, family) if moe else None,
                mlp=None if moe else _mlp(mlp),
            )
        )
    first = layers[0].attention
    base, dims = _rope(cfg, first.head_dim)
    embed = matrix(inner.embed_tokens)
    return ModelSpec(
        family=family,
        hidden=int(cfg.hidden_size),
        vocab=embed.rows,
        eps=float(cfg.rms_norm_eps),
        rope_base=base,
        rope_dims=dims,
        context=int(getattr(cfg, "max_position_embeddings", 0) or 0),
        embed=embed,
        norm=_f32(inner.norm.weight),
        lm_head=matrix(model.lm_head),
        layers=layers,
    )
