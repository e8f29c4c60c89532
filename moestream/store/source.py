"""Checkpoint sources: everything the engine needs from a checkpoint, whatever its file format.

A source gives the transformers config, the tokenizer, every tensor's location (file, byte range,
stored type), the routed-expert table (`ExpertMap`) and the trunk (every non-expert tensor, named as
transformers names it, read lazily). The engine builds the model from these alone, so a new on-disk
format is one module implementing `CheckpointSource`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from moestream.store.experts import ExpertMap
from moestream.store.safetensors_file import TensorRef


class CheckpointSource(Protocol):
    path: Path  # the checkpoint as opened (a directory, or a file)
    files: list[str]  # files holding tensors
    tensors: dict[str, TensorRef]  # every tensor by its name in the checkpoint
    synthetic: bool  # written by `moestream synth` (random weights)

    def config(self) -> Any:
        """The transformers config of the model (quantization entries that moestream handles removed)."""

    def generation_config(self) -> Any | None:
        """transformers GenerationConfig from the checkpoint, or None to derive it from the config."""

    def tokenizer(self) -> Any | None:
        """The tokenizer (with its chat template), or None when the checkpoint has none."""

    def expert_map(self, family: str, num_experts: int) -> ExpertMap:
        """Every routed expert of every MoE layer: byte ranges and stored formats."""

    def trunk_state_dict(
        self, emap: ExpertMap, expected: Mapping[str, tuple[int, ...]] | None = None, keep_blocks: bool = True
    ) -> dict[str, Any]:
        """Non-expert tensors by name, as values transformers materializes with `value[...]`.

        `expected`: the model's own keys and shapes (its state dict built on the meta device), for a
        source whose tensor names are not transformers' (GGUF); a source that stores transformers'
        names may ignore it. `keep_blocks`: tensors stored in block types come as `QuantizedTensor`
        (computed on their blocks), else dequantized.
        """


def open_source(path_or_id: str | Path) -> CheckpointSource:
    """Open a checkpoint: a HF directory, a GGUF file (or the first part of a split GGUF), a directory
    holding one GGUF model, or a model by name (`REPO[:QUANT]`, fetched into the HF cache by `store.hub`).

    A directory with both a HF checkpoint (config.json) and GGUF files opens the HF checkpoint, with a
    warning; pass the .gguf file itself to use it.

    Raises:
        CheckpointError: nothing usable at `path_or_id`.
    """
    from moestream.store.checkpoint import resolve_path
    from moestream.store.gguf import GgufSource, find_gguf
    from moestream.store.safetensors_dir import SafetensorsSource

    path = resolve_path(str(path_or_id))
    if path.is_file():
        return GgufSource(path)
    gguf = find_gguf(path)
    if gguf is not None and (path / "config.json").exists():
        warnings.warn(
            f"{path} holds a HF checkpoint and {gguf.name}; using the HF checkpoint (pass the .gguf file "
            "to use it instead)",
            stacklevel=2,
        )
    elif gguf is not None:
        return GgufSource(gguf)
    return SafetensorsSource(path)
