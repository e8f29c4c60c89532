"""Checkpoint tensor names and shapes of each architecture, as the real checkpoints lay them out.

Non-expert tensors come from the transformers model itself, built on the meta device (no memory),
renamed to their on-disk names. Routed experts are written in the family's original layout:

- per expert, `{p}mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight` ([I,H], [I,H], [H,I]):
  qwen3_moe, qwen2_moe, olmoe, deepseek_v2/v3, glm4_moe, qwen3_next;
- Mixtral: `{p}block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` (gate, up, down), router
  `{p}block_sparse_moe.gate.weight`;
- Qwen3.5-MoE, fused: `{p}mlp.experts.gate_up_proj` [E,2I,H] (gate rows, then up rows) and
  `{p}mlp.experts.down_proj` [E,H,I], every key under `model.language_model.`;
- gpt-oss, fused and transposed: `gate_up_proj` [E,H,2I] (gate/up interleaved in columns),
  `gate_up_proj_bias` [E,2I], `down_proj` [E,I,H], `down_proj_bias` [E,H]; with MXFP4,
  `{gate_up,down}_proj_blocks` [E,R,K/32,16] u8 and `_scales` [E,R,K/32] u8 replace the matrices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod
from typing import Any

from moestream.synth.writer import ITEMSIZE

SAFETENSORS_DTYPE = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
EXPERT_PARAM = re.compile(r"\.mlp\.experts\.")
_LAYER = re.compile(r"\.layers\.(\d+)\.")
# per-expert projection names on disk, in (gate, up, down) order
_PER_EXPERT = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}
_DEFAULT_PER_EXPERT = ("mlp", ("gate_proj", "up_proj", "down_proj"))
FUSED_ARCHS = ("qwen3_5_moe", "gpt_oss")


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor.

    role decides the initial values: "embed", "out" (attention output), "down" (MLP down
    projections), "matrix" (any other matrix), "zeros" (biases), "init" (small tensors initialised
    the way transformers does: norms, A_log, conv kernels, sinks). `mxfp4` is "blocks" or "scales"
    for packed gpt-oss experts. `param` is the transformers parameter a non-expert tensor loads into.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    routed: bool = False
    param: str | None = None
    layer: int | None = None
    expert: int | None = None
    mxfp4: str = ""

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * ITEMSIZE[self.dtype]


def checkpoint_name(arch: str, param: str) -> str:
    """On-disk name of a non-expert transformers parameter (the reverse of transformers' load renames)."""
    if arch == "mixtral":
        param = param.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    if arch == "qwen3_5_moe" and param.startswith("model."):
        param = "model.language_model." + param[len("model.") :]
    return param


def role_of(param: str, ndim: int) -> str:
    """Initialisation role of a non-expert parameter, from its name and rank."""
    if param.endswith(".bias"):
        return "zeros"
    if ndim != 2:
        return "init"
    if "embed_tokens" in param:
        return "embed"
    if re.search(r"\.(o_proj|out_proj)\.weight$", param):
        return "out"
    if re.search(r"\.(down_proj|w2)\.weight$", param):
        return "down"
    return "matrix"


def checkpoint_tensors(
    model: Any,
    arch: str,
    dtype: str,
    *,
    experts: int,
    hidden: int,
    moe_intermediate: int,
    mxfp4: bool = False,
) -> list[TensorSpec]:
    """All tensors of the checkpoint, in file order: each layer's experts follow its other tensors.

    `model` is the transformers model built on the meta device from the synth config.
    """
    sd_dtype = SAFETENSORS_DTYPE[dtype]
    out: list[TensorSpec] = []
    seen_layers: set[int] = set()
    for param, tensor in model.state_dict().items():
        match = _LAYER.search(param)
        layer = int(match.group(1)) if match else None
        if EXPERT_PARAM.search(param):
            if layer not in seen_layers:
                seen_layers.add(layer)
                prefix = checkpoint_name(arch, param[: match.end()])
                out += expert_tensors(arch, prefix, layer, experts, hidden, moe_intermediate, sd_dtype, mxfp4)
            continue
        # DeepSeek-V3 / GLM keep the routing bias in fp32 on disk, like the real checkpoints
        tdtype = "F32" if param.endswith("e_score_correction_bias") else sd_dtype
        out.append(
            TensorSpec(
                checkpoint_name(arch, param),
                tuple(tensor.shape),
                tdtype,
                role_of(param, tensor.dim()),
                param=param,
                layer=layer,
            )
        )
    return out


def expert_tensors(
    arch: str, prefix: str, layer: int, experts: int, hidden: int, inter: int, dtype: str, mxfp4: bool = False
) -> list[TensorSpec]:
    """The routed-expert tensors of one MoE layer; `prefix` is e.g. "model.layers.3."."""
    E, H, I = experts, hidden, inter
    if arch == "gpt_oss":
        return _gpt_oss_experts(prefix + "mlp.experts.", layer, E, H, I, dtype, mxfp4)
    if arch == "qwen3_5_moe":
        p = prefix + "mlp.experts."
        return [
            TensorSpec(p + "gate_up_proj", (E, 2 * I, H), dtype, "matrix", True, layer=layer),
            TensorSpec(p + "down_proj", (E, H, I), dtype, "down", True, layer=layer),
        ]
    block, (gate, up, down) = _PER_EXPERT.get(arch, _DEFAULT_PER_EXPERT)
    out = []
    for e in range(E):
        p = f"{prefix}{block}.experts.{e}."
        out += [
            TensorSpec(p + gate + ".weight", (I, H), dtype, "matrix", True, layer=layer, expert=e),
            TensorSpec(p + up + ".weight", (I, H), dtype, "matrix", True, layer=layer, expert=e),
            TensorSpec(p + down + ".weight", (H, I), dtype, "down", True, layer=layer, expert=e),
        ]
    return out


def _gpt_oss_experts(p: str, layer: int, E: int, H: int, I: int, dtype: str, mxfp4: bool) -> list[TensorSpec]:
    """gpt-oss experts: bf16 [E,H,2I]/[E,I,H] matrices, or MXFP4 blocks/scales over the input dim."""
    gate_up_bias = TensorSpec(p + "gate_up_proj_bias", (E, 2 * I), dtype, "zeros", True, layer=layer)
    down_bias = TensorSpec(p + "down_proj_bias", (E, H), dtype, "zeros", True, layer=layer)
    if not mxfp4:
        return [
            TensorSpec(p + "gate_up_proj", (E, H, 2 * I), dtype, "matrix", True, layer=layer),
            gate_up_bias,
            TensorSpec(p + "down_proj", (E, I, H), dtype, "down", True, layer=layer),
            down_bias,
        ]

    # blocks [E, rows, in/32, 16]: 32 FP4 values in 16 bytes; scales [E, rows, in/32]: E8M0 exponents
    def packed(name: str, shape: tuple[int, ...], role: str, part: str) -> TensorSpec:
        return TensorSpec(p + name, shape, "U8", role, True, layer=layer, mxfp4=part)

    return [
        packed("gate_up_proj_blocks", (E, 2 * I, H // 32, 16), "matrix", "blocks"),
        packed("gate_up_proj_scales", (E, 2 * I, H // 32), "matrix", "scales"),
        gate_up_bias,
        packed("down_proj_blocks", (E, H, I // 32, 16), "down", "blocks"),
        packed("down_proj_scales", (E, H, I // 32), "down", "scales"),
        down_bias,
    ]


def expert_layout(arch: str, mxfp4: bool = False) -> str:
    """A short name of the expert layout, recorded in moestream_synth.json."""
    if arch == "gpt_oss":
        return "fused_transposed_mxfp4" if mxfp4 else "fused_transposed"
    return "fused" if arch in FUSED_ARCHS else "per_expert"
