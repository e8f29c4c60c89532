"""The expert map: (layer, expert) -> per kind, the byte ranges to read, straight from the checkpoint.

Two families of expert math are known:
  * "swiglu" (Qwen, Mixtral, OLMoE, DeepSeek, GLM): kinds gate [I,H], up [I,H], down [H,I], stored
    per expert (`experts.{e}.gate_proj.weight`, Mixtral `w1/w3/w2`) or fused 3-D
    (`experts.gate_up_proj [E,2I,H]`, gate rows first, and `experts.down_proj [E,H,I]`);
  * "gpt_oss": kinds gate_up [H,2I] (gate/up interleaved by column) and down [I,H], stored fused in
    bf16, or MXFP4 as `*_blocks [E,R,K/32,16]` + `*_scales [E,R,K/32]` (two parts per kind); the small
    per-expert biases are kept resident.
Expert e of a fused tensor is one contiguous byte range because E is the outermost dimension.
Every (layer, kind) records its stored format (`StoredFormat`); what a format name means and how it is
computed is decided in `moestream.runtime.formats` only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

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
_PER_EXPERT_KIND = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}
_IGNORED_PREFIXES = ("mtp", "visual", "vision", "audio")

Parts = tuple[TensorRef, ...]


@dataclass(frozen=True)
class StoredFormat:
    """How one kind of one layer is stored: a format name ("BF16", "F32", "mxfp4", a GGML type such as
    "Q4_K") and whether the matrix is stored [in, out] (computed as x @ W) instead of [out, in]."""

    name: str
    transposed: bool = False


@dataclass
class ExpertMap:
    """Where every routed expert's bytes are. `units[(layer, e)][kind]` is a tuple of parts to read,
    `formats[(layer, kind)]` how they are stored."""

    family: str
    kinds: tuple[str, ...]
    num_experts: int
    units: dict[tuple[int, int], dict[str, Parts]] = field(default_factory=dict)
    formats: dict[tuple[int, str], StoredFormat] = field(default_factory=dict)
    resident: dict[tuple[int, str], TensorRef] = field(default_factory=dict)  # (layer, name) -> bias tensor
    tensor_names: set[str] = field(default_factory=set)  # checkpoint tensors the map covers (not trunk)

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.units})

    @property
    def files(self) -> list[str]:
        """The files holding expert bytes."""
        return sorted({ref.file for parts in self.units.values() for refs in parts.values() for ref in refs})

    def unit_bytes(self, layer: int, expert: int) -> int:
        """Bytes of one expert on disk (all kinds and parts)."""
        return sum(p.nbytes for parts in self.units[(layer, expert)].values() for p in parts)

    @property
    def expert_bytes(self) -> int:
        """Bytes of all routed experts on disk."""
        return sum(self.unit_bytes(*key) for key in self.units)

    def format_names(self) -> list[str]:
        """The distinct stored formats, in first-seen order (for mode lines and trace headers)."""
        return list(dict.fromkeys(f.name for f in self.formats.values()))

    def restrict(self, layers: list[int]) -> None:
        """Keep only `layers` (the model's streamed layers); every one of them must be present."""
        missing = sorted(set(layers) - set(self.layers))
        if missing:
            raise CheckpointError(f"the checkpoint has no routed-expert tensors for MoE layer {missing[0]}")
        wanted = set(layers)
        self.units = {key: parts for key, parts in self.units.items() if key[0] in wanted}
        self.formats = {key: fmt for key, fmt in self.formats.items() if key[0] in wanted}
        self.resident = {key: ref for key, ref in self.resident.items() if key[0] in wanted}


def moe_layers(tensors: dict[str, TensorRef]) -> list[int]:
    """Layers that hold routed-expert tensors (MTP and vision towers excluded)."""
    layers = set()
    for name in tensors:
        match = _expert_match(name)
        if match:
            layers.add(int(match["layer"]))
    return sorted(layers)


def is_expert_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to a routed-experts module (of any tower or MTP head)."""
    return bool(_PER_EXPERT.match(name) or _FUSED.match(name))


def _expert_match(name: str) -> re.Match | None:
    match = _PER_EXPERT.match(name) or _FUSED.match(name)
    if not match or match["prefix"].startswith(_IGNORED_PREFIXES):
        return None
    return match


def build_expert_map(
    tensors: dict[str, TensorRef], family: str, layers: list[int] | None, num_experts: int
) -> ExpertMap:
    """Locate every (layer, expert, kind) of the given MoE layers (None: every layer that has experts).

    Raises:
        CheckpointError: an expected expert tensor is absent or has an unexpected shape.
    """
    emap = ExpertMap(family=family, kinds=KINDS_BY_FAMILY[family], num_experts=num_experts)
    wanted = set(moe_layers(tensors) if layers is None else layers)
    fused: dict[tuple[int, str], TensorRef] = {}
    emap.tensor_names = {name for name in tensors if is_expert_tensor(name)}
    for name, ref in tensors.items():
        match = _expert_match(name)
        if not match or int(match["layer"]) not in wanted:
            continue
        layer = int(match["layer"])
        if match.groupdict().get("expert") is not None:
            kind, expert = _PER_EXPERT_KIND[match["name"]], int(match["expert"])
            emap.units.setdefault((layer, expert), {})[kind] = (ref,)
            if expert == 0:  # the layer's format is expert 0's; the load-time check holds the others to it
                emap.formats[(layer, kind)] = StoredFormat(ref.dtype)
        else:
            fused[(layer, match["name"])] = ref
    for layer in sorted({lay for lay, _ in fused}):
        _FUSED_SPLITTERS[family](emap, layer, fused)
    _check_complete(emap, wanted)
    return emap


def _split_swiglu(emap: ExpertMap, layer: int, fused: dict[tuple[int, str], TensorRef]) -> None:
    gate_up, down = fused.get((layer, "gate_up_proj")), fused.get((layer, "down_proj"))
    if gate_up is None or down is None:
        raise CheckpointError(f"layer {layer} has fused experts but lacks gate_up_proj or down_proj")
    if len(gate_up.shape) != 3 or gate_up.shape[1] % 2:
        raise CheckpointError(f"tensor {gate_up.name} has shape {list(gate_up.shape)}, expected [E, 2I, H]")
    for e in range(emap.num_experts):
        row = expert_row(gate_up, e)
        half = row.nbytes // 2
        inter, hidden = gate_up.shape[1] // 2, gate_up.shape[2]
        gate = TensorRef(row.file, row.offset, half, row.dtype, (inter, hidden), f"{row.name}[gate]")
        up = TensorRef(row.file, row.offset + half, half, row.dtype, (inter, hidden), f"{row.name}[up]")
        emap.units.setdefault((layer, e), {}).update(gate=(gate,), up=(up,), down=(expert_row(down, e),))
    for kind, ref in (("gate", gate_up), ("up", gate_up), ("down", down)):
        emap.formats[(layer, kind)] = StoredFormat(ref.dtype)


def _split_gpt_oss(emap: ExpertMap, layer: int, fused: dict[tuple[int, str], TensorRef]) -> None:
    for kind, base in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
        if (layer, base + "_blocks") in fused:  # MXFP4: [R, K/32, 16] blocks and [R, K/32] E8M0 scales
            blocks, scales = fused[(layer, base + "_blocks")], fused[(layer, base + "_scales")]
            for e in range(emap.num_experts):
                emap.units.setdefault((layer, e), {})[kind] = (expert_row(blocks, e), expert_row(scales, e))
            emap.formats[(layer, kind)] = StoredFormat("mxfp4")
        elif (layer, base) in fused:  # bf16, stored [in, out]
            for e in range(emap.num_experts):
                emap.units.setdefault((layer, e), {})[kind] = (expert_row(fused[(layer, base)], e),)
            emap.formats[(layer, kind)] = StoredFormat(fused[(layer, base)].dtype, transposed=True)
    for bias in ("gate_up_proj_bias", "down_proj_bias"):
        if (layer, bias) in fused:
            emap.resident[(layer, bias)] = fused[(layer, bias)]


_FUSED_SPLITTERS: dict[str, Callable[[ExpertMap, int, dict[tuple[int, str], TensorRef]], None]] = {
    "swiglu": _split_swiglu,
    "gpt_oss": _split_gpt_oss,
}


def expert_row(ref: TensorRef, e: int) -> TensorRef:
    """Expert e's slice of a fused [E, ...] tensor: one contiguous byte range."""
    if not ref.shape or e >= ref.shape[0]:
        # a shorter E would make the last experts' rows point past the tensor, into its neighbours' bytes
        raise CheckpointError(
            f"tensor {ref.name} in {ref.file} has shape {list(ref.shape)}, which holds no row for expert {e}"
        )
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
