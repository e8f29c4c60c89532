"""A GGUF model (one file, or every part of a split) as a `CheckpointSource`.

Routed experts are llama.cpp's 3-D tensors `blk.N.ffn_{gate,up,down}_exps.weight` ([E, rows, cols] in
numpy order, experts outermost; `ffn_gate_up_exps` [E, 2I, H] where the converter fused them): expert e
is the contiguous byte range `offset + e * rows * row_bytes`, read and computed as stored, in the GGML
type the file holds for that (layer, kind) (a Q4_K_M file mixes Q4_K and Q6_K). gpt-oss stores gate and
up separately and one bias per kind (`ffn_*_exps.bias` [E, rows]), which stay resident.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moestream.errors import CheckpointError, UnsupportedModelError
from moestream.store.experts import SWIGLU_KINDS, ExpertMap, StoredFormat, expert_row
from moestream.store.gguf_config import config_kwargs, decoder_layers, gguf_arch
from moestream.store.gguf_file import GgufFile, open_gguf
from moestream.store.gguf_trunk import Trunk
from moestream.store.safetensors_file import TensorRef

SYNTH_KEY = "moestream.synth"  # the marker `moestream synth --format gguf` writes
_EXPERTS = re.compile(
    r"^blk\.(?P<layer>\d+)\.ffn_(?P<kind>gate|up|down|gate_up)_exps\.(?P<what>weight|bias)$"
)


class GgufSource:
    """`CheckpointSource` over a GGUF file (the header of every part read, no tensor)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.gguf: GgufFile = open_gguf(path)
        self.files, self.tensors = self.gguf.files, self.gguf.tensors
        self.synthetic = SYNTH_KEY in self.gguf.metadata
        self.arch = gguf_arch(self.gguf)
        self._config: Any = None

    def config(self) -> Any:
        if self._config is None:
            from transformers import AutoConfig

            model_type, kwargs = config_kwargs(self.gguf)
            try:
                config = AutoConfig.for_model(model_type, **kwargs)
            except (ValueError, TypeError) as exc:
                raise UnsupportedModelError(
                    f"transformers cannot build a {model_type} config from {self.path} ({exc})"
                ) from None
            config.dtype = self._compute_dtype()
            self._config = config
        return self._config

    def _compute_dtype(self) -> str:
        """bfloat16 where most trunk bytes are BF16; float32 otherwise (F16 values and dequantized
        blocks are exact in it). `--dtype` overrides it."""
        by_type: dict[str, int] = {}
        for name, ref in self.tensors.items():
            if not _EXPERTS.match(name):
                by_type[ref.dtype] = by_type.get(ref.dtype, 0) + ref.nbytes
        return "bfloat16" if by_type and max(by_type, key=by_type.__getitem__) == "BF16" else "float32"

    def generation_config(self) -> Any | None:
        from transformers import GenerationConfig

        meta = self.gguf.metadata
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
        if not eos and "tokenizer.ggml.bos_token_id" not in meta:
            return None
        return GenerationConfig(
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=list(dict.fromkeys(eos)) if len(set(eos)) > 1 else (eos[0] if eos else None),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        )

    def tokenizer(self) -> Any | None:
        if "tokenizer.ggml.tokens" not in self.gguf.metadata:
            return None
        from moestream.store.gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(self.path)

    def expert_map(self, family: str, num_experts: int) -> ExpertMap:
        # llama.cpp appends multi-token-prediction blocks (with experts) after the decoder layers
        return gguf_expert_map(self.tensors, family, num_experts, decoder_layers(self.gguf))

    def trunk_state_dict(
        self, emap: ExpertMap, expected: Mapping[str, tuple[int, ...]] | None = None, keep_blocks: bool = True
    ) -> dict[str, Any]:
        if expected is None:
            raise CheckpointError("a GGUF trunk needs the model's expected keys (see model/loader.py)")
        trunk = Trunk(self.arch.name, self.arch.tensor_arch, _text(self.config()), self.tensors, keep_blocks)
        return trunk.state_dict(expected, emap.tensor_names)


def _text(config: Any) -> Any:
    sub = getattr(config, "text_config", None)
    return sub if sub is not None and hasattr(sub, "num_hidden_layers") else config


def gguf_expert_map(
    tensors: dict[str, TensorRef], family: str, num_experts: int, n_layers: int | None = None
) -> ExpertMap:
    """Every routed expert of every decoder layer (below `n_layers`) that has `ffn_*_exps` tensors.

    Raises:
        CheckpointError: a layer lacks a kind, or an expert tensor does not hold `num_experts` experts.
    """
    emap = ExpertMap(family=family, kinds=SWIGLU_KINDS, num_experts=num_experts)
    weights: dict[tuple[int, str], TensorRef] = {}
    for name, ref in tensors.items():
        match = _EXPERTS.match(name)
        if match is None:
            continue
        emap.tensor_names.add(name)  # never trunk, even in a block moestream does not run
        if n_layers is not None and int(match["layer"]) >= n_layers:
            continue
        if ref.shape[0] != num_experts:
            raise CheckpointError(
                f"GGUF tensor {name} holds {ref.shape[0]} experts, the model has {num_experts}"
            )
        layer, kind = int(match["layer"]), match["kind"]
        if match["what"] == "bias":
            emap.resident[(layer, f"{kind}_bias")] = ref  # [E, rows], gpt-oss
        else:
            weights[(layer, kind)] = ref
    for layer in sorted({layer for layer, _ in weights}):
        _add_layer(emap, layer, weights)
    return emap


def _add_layer(emap: ExpertMap, layer: int, weights: dict[tuple[int, str], TensorRef]) -> None:
    gate_up = weights.get((layer, "gate_up"))
    for kind in SWIGLU_KINDS:
        ref = weights.get((layer, kind))
        if ref is None and not (gate_up is not None and kind in ("gate", "up")):
            raise CheckpointError(f"the GGUF has no ffn_{kind}_exps weights for layer {layer}")
        if ref is None:
            continue
        for e in range(emap.num_experts):
            emap.units.setdefault((layer, e), {})[kind] = (expert_row(ref, e),)
        emap.formats[(layer, kind)] = StoredFormat(ref.dtype)
    if gate_up is not None and (layer, "gate") not in weights:
        _split_gate_up(emap, layer, gate_up)


def _split_gate_up(emap: ExpertMap, layer: int, ref: TensorRef) -> None:
    """`ffn_gate_up_exps` [E, 2I, H]: per expert, the gate rows then the up rows, each one byte range."""
    if len(ref.shape) != 3 or ref.shape[1] % 2:
        raise CheckpointError(f"GGUF tensor {ref.name} has shape {list(ref.shape)}, expected [E, 2I, H]")
    inter, hidden = ref.shape[1] // 2, ref.shape[2]
    for e in range(emap.num_experts):
        row = expert_row(ref, e)
        half = row.nbytes // 2
        gate = TensorRef(row.file, row.offset, half, row.dtype, (inter, hidden), f"{row.name}[gate]")
        up = TensorRef(row.file, row.offset + half, half, row.dtype, (inter, hidden), f"{row.name}[up]")
        emap.units.setdefault((layer, e), {}).update(gate=(gate,), up=(up,))
    emap.formats[(layer, "gate")] = emap.formats[(layer, "up")] = StoredFormat(ref.dtype)


def find_gguf(directory: Path) -> Path | None:
    """The GGUF model in a directory: its only .gguf file, or the first part of its only split.

    Raises:
        CheckpointError: the directory holds several GGUF models.
    """
    files = sorted(p for p in directory.glob("*.gguf") if p.is_file())
    models = [p for p in files if not re.search(r"-\d{5}-of-\d{5}\.gguf$", p.name) or "-00001-of-" in p.name]
    models = [p for p in models if not p.name.startswith("mmproj")]  # vision towers llama.cpp ships beside
    if len(models) > 1:
        names = ", ".join(p.name for p in models)
        raise CheckpointError(f"{directory} holds several GGUF models ({names}); pass the file to use")
    return models[0] if models else None
