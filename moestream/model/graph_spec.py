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
from moestream.model.graph_parts import Matrix, Mlp, NoGraph, Router, _f32, matrix, router_matrix
from moestream.model.streaming import StreamingExperts

# families whose decoder layer moestream builds as ggml graphs (standard attention, softmax routers;
# gpt_oss: attention sinks, sliding windows, YaRN, a router with a bias; qwen3_next and qwen3_5_moe:
# Gated DeltaNet layers between gated full-attention ones, zero-centred norms;
# deepseek_v2 and deepseek_v3: Multi-head Latent Attention, `mla_spec`)
GRAPH_FAMILIES = (
    "qwen3_moe",
    "qwen2_moe",
    "olmoe",
    "mixtral",
    "glm4_moe",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5_moe",
    "deepseek_v2",
    "deepseek_v3",
)
# Qwen3-Next and Qwen3.5: their RMSNorms scale by 1 + w (the gated one in a DeltaNet layer by w), the
# attention's q_proj also yields an output gate, and every other layer (most) is a Gated DeltaNet
_LINEAR_FAMILIES = ("qwen3_next", "qwen3_5_moe")
_ALIASES = {"qwen3_5_moe_text": "qwen3_5_moe"}  # a GGUF's (and a text-only checkpoint's) model_type


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

    @property
    def cache_widths(self) -> tuple[int, int]:
        """Values a token keeps in the KV cache: (keys, values)."""
        return self.kv_heads * self.head_dim, self.kv_heads * self.head_dim


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

    @property
    def channels(self) -> int:
        return (2 * self.k_heads + self.v_heads) * self.head_dim


@dataclass
class Layer:
    index: int
    attn_norm: torch.Tensor  # f32 [hidden]
    ffn_norm: torch.Tensor
    attention: Attention | None  # None: a linear-attention layer (`linear`); deepseek: a `mla_spec.Mla`
    router: Router | None  # a MoE layer: its routed experts stream; else `mlp` is dense
    mlp: Mlp | None
    linear: DeltaNet | None = None


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


def _norm_weight(norm: nn.Module, family: str) -> torch.Tensor:
    """An RMSNorm's factor: its weight, or 1 + weight (in f32, as transformers adds it) where the family's
    norms are zero-centred."""
    w = _f32(norm.weight)
    return (1.0 + w).contiguous() if family in _LINEAR_FAMILIES else w


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


def _attention(module: nn.Module, cfg: Any, family: str) -> Attention:
    if family in ("deepseek_v2", "deepseek_v3"):
        from moestream.model.mla_spec import mla_attention

        return mla_attention(module, cfg)
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
    sinks = getattr(module, "sinks", None)
    window = getattr(module, "sliding_window", None) if family == "gpt_oss" else None
    return Attention(
        *(matrix(projections[n]) for n in ("q", "k", "v", "o")),
        biases=biases,
        q_norm=_norm_weight(q_norm, family) if q_norm is not None else None,
        k_norm=_norm_weight(k_norm, family) if k_norm is not None else None,
        qk_norm=qk,
        heads=heads,
        kv_heads=int(cfg.num_key_value_heads),
        head_dim=head_dim,
        scale=float(getattr(module, "scaling", head_dim**-0.5)),
        sinks=_f32(sinks) if sinks is not None else None,
        window=int(window) if window else None,
        gated=family in _LINEAR_FAMILIES,
    )


def _delta_net(module: nn.Module, cfg: Any) -> DeltaNet:
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
        conv=_f32(conv.reshape(conv.shape[0], conv.shape[-1])),
        decay=(-_f32(module.A_log).exp()).contiguous(),
        dt_bias=_f32(module.dt_bias),
        norm=_f32(module.norm.weight),
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


def _mlp(module: nn.Module) -> Mlp:
    return Mlp(matrix(module.gate_proj), matrix(module.up_proj), matrix(module.down_proj))


def _router(mlp: nn.Module, cfg: Any, family: str) -> Router:
    if family == "gpt_oss":  # logits = W x + b, top-k of the logits, softmax over the chosen k
        router = mlp.router
        return Router(
            router_matrix(router),
            int(cfg.num_experts_per_tok),
            normalize=False,
            logit_bias=_f32(router.bias),
            softmax_top=True,
        )
    if family in ("deepseek_v2", "deepseek_v3"):
        from moestream.model.mla_spec import deepseek_router

        return deepseek_router(mlp, cfg, family)
    gate = mlp.gate
    always = family in ("mixtral", "qwen3_5_moe")  # their routers normalise whatever the config says
    normalize = True if always else bool(getattr(cfg, "norm_topk_prob", False))
    router = Router(router_matrix(gate), int(cfg.num_experts_per_tok), normalize)
    if getattr(mlp, "shared_expert", None) is not None:
        router.shared = _mlp(mlp.shared_expert)
        router.shared_gate = router_matrix(mlp.shared_expert_gate)
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
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if family == "gpt_oss" and not kinds <= {"sliding_attention", "full_attention"}:
        raise NoGraph(f"layer types {sorted(kinds)} are not in the graphs yet")
    if family in _LINEAR_FAMILIES and not kinds <= {"linear_attention", "full_attention"}:
        raise NoGraph(f"layer types {sorted(kinds)} are not in the graphs yet")


def graph_spec(model: nn.Module, config: Any) -> ModelSpec:
    """The ggml graphs' view of `model` (its trunk on the CPU).

    Raises:
        NoGraph: the family, or something this checkpoint uses, is not computed by the graphs yet.
    """
    cfg = text_config(config)
    family = _ALIASES.get(str(config.model_type), str(config.model_type))
    _check_config(cfg, family)
    inner = model.model
    layers = []
    for i, layer in enumerate(inner.layers):
        mlp = layer.mlp
        moe = isinstance(getattr(mlp, "experts", None), StreamingExperts)
        attention, linear = getattr(layer, "self_attn", None), getattr(layer, "linear_attn", None)
        layers.append(
            Layer(
                index=i,
                attn_norm=_norm_weight(layer.input_layernorm, family),
                ffn_norm=_norm_weight(layer.post_attention_layernorm, family),
                attention=_attention(attention, cfg, family) if attention is not None else None,
                router=_router(mlp, cfg, family) if moe else None,
                mlp=None if moe else _mlp(mlp),
                linear=_delta_net(linear, cfg) if linear is not None else None,
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
        family=family,
        hidden=int(cfg.hidden_size),
        vocab=embed.rows,
        eps=float(cfg.rms_norm_eps),
        rope_base=rope.base,
        rope_dims=rope.dims,
        context=int(getattr(cfg, "max_position_embeddings", 0) or 0),
        embed=embed,
        norm=_norm_weight(inner.norm, family),
        lm_head=matrix(model.lm_head),
        layers=layers,
        rope_freqs=rope.freqs,
        rope_attn=rope.attn,
        copied_bytes=_router_copies(model, layers),
    )


def _router_copies(model: nn.Module, layers: list[Layer]) -> int:
    """Bytes of the routers' float32 copies (`router_matrix`): those not in the model's own storage."""
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    routers = [x.router for x in layers if x.router is not None]
    weights = [m for r in routers for m in (r.weight, r.shared_gate) if m is not None]
    return sum(m.ref.nbytes for m in weights if m.ref.untyped_storage().data_ptr() not in own)
