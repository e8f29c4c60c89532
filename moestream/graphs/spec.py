"""What a ggml graph of a transformers model needs: each layer's weights and hyperparameters.

Read once at load from the model transformers built (its trunk modules hold the weights: float
tensors, or a GGUF file's blocks in `QuantLinear`/`QuantEmbedding`), so the graphs compute the very
bytes the transformers path computes. The family registered for the model's type (`graphs/family.py`,
one module per family) reads what differs between families; `graph_spec` refuses, with the reason,
what the graphs do not compute yet, and the engine then runs transformers' forward instead (the mode
line says so).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from moestream.ggml.net import Net
from moestream.graphs.family import family_for
from moestream.graphs.parts import Matrix, Mlp, NoGraph, Router, matrix, read_mlp
from moestream.hfconfig import text_config
from moestream.model.streaming import StreamingExperts


class Mixer(Protocol):
    """A layer's token mixer as the graphs compute it: attention (`attention.Attention`), DeepSeek's
    Multi-head Latent Attention (`deepseek.Mla`), a Gated DeltaNet (`qwen3_next.DeltaNet`). Each keeps
    its own cache and builds its own nodes."""

    recurrent: bool  # its cache folds in every token (it cannot be cropped back)

    def cache(self, ctx: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Its cache for `ctx` positions (zeros on `device`)."""

    def graph(self, g: Any, net: Net, h: int, index: int) -> tuple[list[int], int]:
        """Layer `index`'s mixer on the normed stream h [H, T], built by `g` (a `LayerGraphs`):
        (its cache writes, which must run first; its output [H, T])."""


@dataclass
class Layer:
    index: int
    attn_norm: torch.Tensor  # f32 [hidden]
    ffn_norm: torch.Tensor
    attention: Any  # an attention `Mixer`, or None: a linear-attention layer (`linear`)
    router: Router | None  # a MoE layer: its routed experts stream; else `mlp` is dense
    mlp: Mlp | None
    linear: Any = None  # a linear-attention `Mixer` (a Gated DeltaNet)

    @property
    def mixer(self) -> Mixer:
        """What mixes the tokens: the linear attention where the layer has one, else its attention."""
        return self.linear if self.linear is not None else self.attention


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
    # a scaled rope (YaRN): ggml_rope_ext's freq_factors f32 [rope_dims / 2], so that each pair turns by
    # transformers' own inv_freq, and the factor its cos and sin are multiplied by (attention_scaling)
    rope_freqs: torch.Tensor | None = None
    rope_attn: float = 1.0
    copied_bytes: int = 0  # weights the spec holds as copies beside the model's (routers in float32)

    @property
    def top_k(self) -> int:
        return next(layer.router.top_k for layer in self.layers if layer.router is not None)

    @property
    def window(self) -> int | None:
        """The sliding window of the layers that have one (one size for all), or None."""
        return next((x.attention.window for x in self.layers if x.attention and x.attention.window), None)


# rope types whose frequencies are fixed at load: the graphs turn each pair by transformers' own inv_freq
_SCALED_ROPE = ("yarn",)


@dataclass
class Rope:
    base: float
    dims: int
    freqs: torch.Tensor | None = None  # ggml freq_factors f32 [dims / 2] (a scaled rope), else None
    attn: float = 1.0  # cos and sin times this (YaRN's attention_scaling)


def _rope(cfg: Any, head_dim: int, rotary: nn.Module | None) -> Rope:
    params = getattr(cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default" and (rope_type not in _SCALED_ROPE or rotary is None):
        raise NoGraph(f"rope type {rope_type!r} is not in the graphs yet")
    base = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if base is None:
        raise NoGraph("the config names no rope_theta")
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0
    rope = Rope(float(base), int(head_dim * factor))
    if rope_type != "default":
        # ggml turns pair i of position p by p * base^(-2i/dims) / freq_factors[i] (ext_factor 0: no
        # YaRN ramp of its own), so freq_factors = base^(-2i/dims) / inv_freq gives transformers' angles
        # whatever its YaRN computed (truncated correction range or not)
        inv = rotary.inv_freq.detach().double().cpu()
        rope.dims = 2 * inv.numel()
        pairs = torch.arange(inv.numel(), dtype=torch.float64)
        rope.freqs = (rope.base ** (-2 * pairs / rope.dims) / inv).float().contiguous()
        rope.attn = float(rotary.attention_scaling)
    return rope


def config_no_graph(config: Any) -> str | None:
    """Why the ggml graphs do not run a model of `config`, as far as its config tells (its family, the
    activation, windows and layer kinds the family checks), or None; what only the built model tells
    (`graph_spec`'s other refusals) is not looked at. `--device cuda` decides its path by this before the
    model is built (`engine/gpu_path.py`)."""
    try:
        family_for(str(config.model_type)).check(text_config(config))
    except NoGraph as exc:
        return str(exc)
    return None


def graph_spec(model: nn.Module, config: Any) -> ModelSpec:
    """The ggml graphs' view of `model` (its trunk on the CPU).

    Raises:
        NoGraph: the family, or something this checkpoint uses, is not computed by the graphs yet.
    """
    cfg = text_config(config)
    family = family_for(str(config.model_type))
    family.check(cfg)
    inner = model.model
    layers = []
    for i, layer in enumerate(inner.layers):
        mlp = layer.mlp
        moe = isinstance(getattr(mlp, "experts", None), StreamingExperts)
        attention, linear = getattr(layer, "self_attn", None), getattr(layer, "linear_attn", None)
        layers.append(
            Layer(
                index=i,
                attn_norm=family.norm(layer.input_layernorm),
                ffn_norm=family.norm(layer.post_attention_layernorm),
                attention=family.attention(attention, cfg) if attention is not None else None,
                router=family.router(mlp, cfg) if moe else None,
                mlp=None if moe else read_mlp(mlp),
                linear=family.linear(linear, cfg) if linear is not None else None,
            )
        )
    attentions = [x.attention for x in layers if x.attention is not None]
    if len({x.window for x in attentions} - {None}) > 1:
        raise NoGraph("sliding windows of several sizes are not in the graphs yet")
    first = attentions[0]
    head = getattr(first, "rope", None) or first.head_dim  # MLA: only its rope part turns
    rope = _rope(cfg, head, getattr(inner, "rotary_emb", None))
    embed = matrix(inner.embed_tokens)
    return ModelSpec(
        family=family.name,
        hidden=int(cfg.hidden_size),
        vocab=embed.rows,
        eps=float(cfg.rms_norm_eps),
        rope_base=rope.base,
        rope_dims=rope.dims,
        context=int(getattr(cfg, "max_position_embeddings", 0) or 0),
        embed=embed,
        norm=family.norm(inner.norm),
        lm_head=matrix(model.lm_head),
        layers=layers,
        rope_freqs=rope.freqs,
        rope_attn=rope.attn,
        copied_bytes=_router_copies(model, layers),
    )


def spec_tensors(spec: ModelSpec) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the spec holds (name, tensor): the weights its graphs read (a `Matrix`'s `ref`, norms,
    biases, the rope's frequencies), found through its dataclasses, lists, tuples and dicts."""
    found: list[tuple[str, torch.Tensor]] = []

    def walk(value: Any, name: str) -> None:
        if isinstance(value, torch.Tensor):
            found.append((name, value))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{name}.{f.name}" if name else f.name)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{name}[{i}]")
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{name}[{key!r}]")

    walk(spec, "")
    return found


def _router_copies(model: nn.Module, layers: list[Layer]) -> int:
    """Bytes of the routers' float32 copies (`router_matrix`): those not in the model's own storage."""
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    routers = [x.router for x in layers if x.router is not None]
    weights = [m for r in routers for m in (r.weight, r.shared_gate) if m is not None]
    return sum(m.ref.nbytes for m in weights if m.ref.untyped_storage().data_ptr() not in own)
