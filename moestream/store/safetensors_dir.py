"""A HF checkpoint directory: config.json, tokenizer files and safetensors shards."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moestream.errors import CheckpointError, UnsupportedModelError
from moestream.store.checkpoint import open_checkpoint
from moestream.store.experts import ExpertMap, build_expert_map
from moestream.store.tensors import LazyTensor

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class SafetensorsSource:
    """`CheckpointSource` over a local HF directory (every shard's header read, no tensor)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not (path / "config.json").exists():
            raise CheckpointError(f"{path} has no config.json, so it is not a HF checkpoint directory")
        checkpoint = open_checkpoint(path)
        self.files, self.tensors = checkpoint.files, checkpoint.tensors
        self.synthetic = (path / "moestream_synth.json").exists()

    def config(self) -> Any:
        from transformers import AutoConfig

        _check_json(self.path / "config.json")
        try:
            config = AutoConfig.from_pretrained(str(self.path))
        except ValueError as exc:
            raise UnsupportedModelError(
                f"transformers cannot read the config in {self.path} ({exc})"
            ) from None
        except Exception as exc:  # a field of the wrong type (huggingface_hub's strict dataclass validation)
            raise CheckpointError(
                f"transformers cannot read the config in {self.path} ({_one_line(exc)})"
            ) from None
        quant = getattr(config, "quantization_config", None)
        if quant is not None:
            method = (
                quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
            )
            if method != "mxfp4":
                raise UnsupportedModelError(
                    f"quantization {method!r} in {self.path} is not supported (only MXFP4 experts)"
                )
            del config.quantization_config  # only the experts are MXFP4, and moestream computes those itself
        return config

    def generation_config(self) -> Any | None:
        if not (self.path / "generation_config.json").exists():
            return None
        from transformers import GenerationConfig

        _check_json(self.path / "generation_config.json")
        try:
            return GenerationConfig.from_pretrained(str(self.path))
        except Exception as exc:  # a value GenerationConfig validates and refuses
            raise CheckpointError(
                f"transformers cannot read {self.path / 'generation_config.json'} ({_one_line(exc)})"
            ) from None

    def tokenizer(self) -> Any | None:
        if not any((self.path / name).exists() for name in _TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path))
        except Exception as exc:  # a malformed tokenizer file raises whatever its parser raises
            raise CheckpointError(
                f"the tokenizer files in {self.path} cannot be loaded ({_one_line(exc)})"
            ) from None

    def expert_map(self, family: str, num_experts: int) -> ExpertMap:
        return build_expert_map(self.tensors, family, None, num_experts)

    def trunk_state_dict(
        self, emap: ExpertMap, expected: Mapping[str, tuple[int, ...]] | None = None, keep_blocks: bool = True
    ) -> dict[str, Any]:
        # transformers' names, no block types: `expected` and `keep_blocks` change nothing here
        return {name: LazyTensor(ref) for name, ref in self.tensors.items() if name not in emap.tensor_names}


def _check_json(path: Path) -> None:
    """A JSON file transformers will read, parsed first so a broken one is named with the position."""
    try:
        json.loads(path.read_bytes())
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
