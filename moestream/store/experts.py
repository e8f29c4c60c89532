"""The expert map: (layer, expert) -> per kind, the byte ranges to read, straight from the shards.

Two families of expert math are known:
  * "swiglu" (Qwen, Mixtral, OLMoE, DeepSeek, GLM): kinds gate [I,H], up [I,H], down [H,I], stored
    per expert (`experts.{e}.gate_proj.weight`, Mixtral `w1/w3/w2`) or fused 3-D
    (`experts.gate_up_proj [E,2I,H]`, gate rows first, and `experts.down_proj [E,H,I]`);
  * "gpt_oss": kinds gate_up [H,2I] (gate/up interleaved by column) and down [I,H], stored fused in
    bf16, or MXFP4 as `*_blocks [E,R,K/32,16]` + `*_scales [E,R,K/32]` (two parts per kind); the small
    per-expert biases are kept resident.
Expert e of a fused tensor is one contiguous byte range because E is the outermost dimension.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from moestream.errors import CheckpointError
from moestream.store.safetensors_file import TensorRef

SWIGLU_KINDS = ("gate", "up", "down")
GPT_OSS_KINDS = ("gate_up", "down")
KINDS_BY_FAMILY = {"swiglu": SWIGLU_KINDS, "gpt_oss": GPT_OSS_KINDS}

_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
    r"(?P<name>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_FUSED = re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<name>[a-z_]+)$")
_PER_EXPERT_KIND = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_IGNORED_PREFIXES = ("mtp", "visual", "vision", "audio")

Parts = tuple[TensorRef, ...]


@dataclass
class ExpertMap:
    """Where every routed expert's bytes are. `units[(layer, e)][kind]` is a tuple of parts to read."""

    family: str
    kinds: tuple[str, ...]
    num_experts: int
    quant: str = "none"  # "none" or "mxfp4"
    units: dict[tuple[int, int], dict[str, Parts]] = field(default_factory=dict)
    resident: dict[tuple[int, str], TensorRef] = field(default_factory=dict)  # (layer, name) -> bias tensor

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.units})

    def unit_bytes(self, layer: int, expert: int) -> int:
        """Bytes of one expert on disk (all kinds and parts)."""
        return sum(p.nbytes for parts in self.units[(layer, expert)].values() for p in parts)

    @property
    def expert_bytes(self) -> int:
        """Bytes of all routed experts on disk."""
        return sum(self.unit_bytes(*key) for key in self.units)


def moe_layers(tensors: dict[str, TensorRef]) -> list[int]:
    """Layers that hold routed-expert tensors (MTP and vision towers excluded)."""
    layers = set()
    for name in tensors:
        match = _PER_EXPERT.match(name) or _FUSED.match(name)
        if match and not match["prefix"].startswith(_IGNORED_PREFIXES):
            layers.add(int(match["layer"]))
    return sorted(layers)


def build_expert_map(tensors: dict[str, TensorRef], family: str, layers: list[int], num_experts: int) -> ExpertMap:
    """Locate every (layer, expert, kind) of the given MoE layers among the checkpoint's tensors.

    Raises:
        CheckpointError: an expected expert tensor is absent or has an unexpected shape.
    """
    emap = ExpertMap(family=family, kinds=KINDS_BY_FAMILY[family], num_experts=num_experts)
    wanted = set(layers)
    fused: dict[tuple[int, str], TensorRef] = {}
    for name, ref in tensors.items():
        match = _PER_EXPERT.match(name) or _FUSED.match(name)
        if not match or match["prefix"].startswith(_IGNORED_PREFIXES) or int(match["layer"]) not in wanted:
            continue
        layer = int(match["layer"])
        if "expert" in match.groupdict() and match["expert"] is not None:
            kind = _PER_EXPERT_KIND[match["name"]]
            emap.units.setdefault((layer, int(match["expert"])), {})[kind] = (ref,)
        else:
            fused[(layer, match["name"])] = ref
    if fused:
        _split_fused(emap, fused, wanted)
    _check_complete(emap, wanted)
    return emap


def _split_fused(emap: ExpertMap, fused: dict[tuple[int, str], TensorRef], layers: set[int]) -> None:
    for layer in sorted(layers):
        names = {name for (lay, name) in fused if lay == layer}
        if not names:
            continue
        if emap.family == "swiglu":
            _split_swiglu(emap, layer, fused)
        elif "gate_up_proj_blocks" in names:
            emap.quant = "mxfp4"
            for kind, base in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
                blocks, scales = fused[(layer, base + "_blocks")], fused[(layer, base + "_scales")]
                for e in range(emap.num_experts):
                    emap.units.setdefault((layer, e), {})[kind] = (_row(blocks, e), _row(scales, e))
        else:
            for kind, base in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
                for e in range(emap.num_experts):
                    emap.units.setdefault((layer, e), {})[kind] = (_row(fused[(layer, base)], e),)
        for bias in ("gate_up_proj_bias", "down_proj_bias"):
            if (layer, bias) in fused:
                emap.resident[(layer, bias)] = fused[(layer, bias)]


def _split_swiglu(emap: ExpertMap, layer: int, fused: dict[tuple[int, str], TensorRef]) -> None:
    gate_up, down = fused.get((layer, "gate_up_proj")), fused.get((layer, "down_proj"))
    if gate_up is None or down is None:
        raise CheckpointError(f"layer {layer} has fused experts but lacks gate_up_proj or down_proj")
    if len(gate_up.shape) != 3 or gate_up.shape[1] % 2:
        raise CheckpointError(f"tensor {gate_up.name} has shape {list(gate_up.shape)}, expected [E, 2I, H]")
    for e in range(emap.num_experts):
        row = _row(gate_up, e)
        half = row.nbytes // 2
        inter, hidden = gate_up.shape[1] // 2, gate_up.shape[2]
        gate = TensorRef(row.file, row.offset, half, row.dtype, (inter, hidden), f"{row.name}[gate]")
        up = TensorRef(row.file, row.offset + half, half, row.dtype, (inter, hidden), f"{row.name}[up]")
        emap.units.setdefault((layer, e), {}).update(gate=(gate,), up=(up,), down=(_row(down, e),))


def _row(ref: TensorRef, e: int) -> TensorRef:
    """Expert e's slice of a fused [E, ...] tensor: one contiguous byte range."""
    if not ref.shape or e >= ref.shape[0]:
        # a shorter E would make the last experts' rows point past the tensor, into its neighbours' bytes
        raise CheckpointError(f"tensor {ref.name} in {ref.file} has shape {list(ref.shape)}, which holds "
                              f"no row for expert {e}")
    per = ref.nbytes // ref.shape[0]
    return TensorRef(ref.file, ref.offset + e * per, per, ref.dtype, ref.shape[1:], f"{ref.name}[{e}]")


def _check_complete(emap: ExpertMap, layers: set[int]) -> None:
    for layer in sorted(layers):
        for e in range(emap.num_experts):
            kinds = emap.units.get((layer, e), {})
            for kind in emap.kinds:
                if kind not in kinds:
                    raise CheckpointError(
                        f"the checkpoint has no {kind} weights for expert {e} of layer {layer}"
                    )


# What the expert math reads each kind as, per (family, quant): (rows, cols) in units of the config's
# hidden size H and expert intermediate size I (the logical matrix before any quantized packing).
_LOGICAL_SHAPES: dict[tuple[str, str], dict[str, tuple[str, str]]] = {
    ("swiglu", "none"): {"gate": ("I", "H"), "up": ("I", "H"), "down": ("H", "I")},
    ("gpt_oss", "none"): {"gate_up": ("H", "2I"), "down": ("I", "H")},  # x @ W, gate/up columns interleaved
    ("gpt_oss", "mxfp4"): {"gate_up": ("2I", "H"), "down": ("H", "I")},  # dequantized [R,K], then transposed
}
_DENSE_DTYPES = ("BF16", "F16", "F32", "F64")  # cast to the compute dtype after the read
_MXFP4_GROUP = 32  # elements per E8M0 scale; 16 bytes of packed E2M1 codes per group
PartSpec = tuple[tuple[str, ...], tuple[int, ...]]  # (allowed dtypes, shape) of one part


def expert_dims(config: Any) -> tuple[int, int]:
    """(H, I): hidden size and routed-expert intermediate size of a transformers config (or its text
    part): `moe_intermediate_size` where the family also has a dense MLP size, else `intermediate_size`."""
    sub = getattr(config, "text_config", None)
    cfg = sub if sub is not None and hasattr(sub, "num_hidden_layers") else config
    inter = getattr(cfg, "moe_intermediate_size", None) or getattr(cfg, "intermediate_size", None)
    if not inter or not getattr(cfg, "hidden_size", None):
        raise CheckpointError(f"config of model_type {getattr(config, 'model_type', '?')!r} gives no hidden "
                              "size or expert intermediate size")
    return int(cfg.hidden_size), int(inter)


def expected_parts(family: str, quant: str, hidden: int, inter: int) -> dict[str, list[PartSpec]]:
    """kind -> per part, (allowed dtypes, shape) of one expert as the runtime will view its bytes."""
    sizes = {"H": hidden, "I": inter, "2I": 2 * inter}
    logical = _LOGICAL_SHAPES.get((family, quant))
    if logical is None:
        raise CheckpointError(f"no expected expert layout is known for family {family!r} with "
                              f"quantization {quant!r}")
    out = {}
    for kind, (r, c) in logical.items():
        rows, cols = sizes[r], sizes[c]
        if quant == "mxfp4":
            groups = cols // _MXFP4_GROUP
            out[kind] = [(("U8",), (rows, groups, 16)), (("U8",), (rows, groups))]
        else:
            out[kind] = [(_DENSE_DTYPES, (rows, cols))]
    return out


def check_expert_shapes(emap: ExpertMap, config: Any) -> None:
    """Check the dtype and shape of every part of every expert (and of the resident expert biases)
    against what the config implies, so a wrongly sized, transposed or integer expert is refused at load
    instead of computing plausible text (or failing at first use).

    Raises:
        CheckpointError: naming the first tensor whose dtype or shape disagrees, with what was expected.
    """
    hidden, inter = expert_dims(config)
    expected = expected_parts(emap.family, emap.quant, hidden, inter)
    for (layer, expert), kinds in sorted(emap.units.items()):
        for kind, parts in kinds.items():
            want = expected[kind]
            if len(parts) != len(want):
                raise CheckpointError(f"the {kind} weights of expert {expert} of layer {layer} have "
                                      f"{len(parts)} parts, expected {len(want)}")
            for ref, spec in zip(parts, want):
                _check_part(ref, spec, hidden, inter)
    biases = {"gate_up_proj_bias": 2 * inter, "down_proj_bias": hidden}
    for (_, name), ref in sorted(emap.resident.items()):
        if name in biases:
            _check_part(ref, (_DENSE_DTYPES, (emap.num_experts, biases[name])), hidden, inter)


def _check_part(ref: TensorRef, spec: PartSpec, hidden: int, inter: int) -> None:
    dtypes, shape = spec
    if ref.dtype not in dtypes:
        allowed = dtypes[0] if len(dtypes) == 1 else "one of " + ", ".join(dtypes)
        raise CheckpointError(f"tensor {ref.name} in {ref.file} has dtype {ref.dtype}; an expert weight here "
                              f"must be {allowed}")
    if tuple(ref.shape) != shape:
        raise CheckpointError(f"tensor {ref.name} in {ref.file} has shape {list(ref.shape)}, but config.json "
                              f"(hidden_size {hidden}, expert intermediate size {inter}) implies "
                              f"{list(shape)}")
