"""A checkpoint directory: its config, its safetensors shards and every tensor's location."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from moestream.errors import CheckpointError
from moestream.store.safetensors_file import TensorRef, check_not_truncated, read_header

INDEX_NAME = "model.safetensors.index.json"


@dataclass
class Checkpoint:
    """The tensors of a local HF checkpoint directory, by name, with their file locations."""

    path: Path
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(ref.nbytes for ref in self.tensors.values())


def resolve_path(path_or_id: str) -> Path:
    """A local checkpoint directory or .gguf file, or a model by name (`REPO[:QUANT]`, see `store.hub`)
    from the HF cache, downloaded into it first where it is not there.

    Raises:
        CheckpointError: the path does not exist and is not a hub id that can be fetched, or it is a
            file that is not a .gguf file.
    """
    path = Path(path_or_id).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists():
        raise CheckpointError(
            f"{path} is a file but not a .gguf file; moestream needs a checkpoint directory "
            "(config.json + *.safetensors) or a GGUF file"
        )
    if path_or_id.count("/") == 1 and not path_or_id.startswith((".", "/", "~")):
        return _from_hub(path_or_id)
    kind = "file" if path.suffix == ".gguf" else "directory"
    raise CheckpointError(f"checkpoint {kind} {path} does not exist")


def _from_hub(name: str) -> Path:
    """`REPO[:QUANT]`, fetched as `-hf` fetches it (`store.hub`)."""
    from moestream.store.hub import fetch

    try:
        return fetch(name)
    except CheckpointError as exc:
        raise CheckpointError(f"{name} is not a local checkpoint, and as a model by name: {exc}") from None


def shard_files(path: Path) -> list[str]:
    """The safetensors files of a checkpoint, from its index when it has one."""
    index = path / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except KeyError:
            raise CheckpointError(
                f"{index} is not a valid safetensors index (it has no weight_map)"
            ) from None
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index ({exc})") from None
        except OSError as exc:
            raise CheckpointError(f"cannot read {index}: {exc.strerror}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(
                f"{index} is not a valid safetensors index (its weight_map must map tensor "
                "names to shard file names)"
            )
        files = sorted({str(path / name) for name in weight_map.values()})
        for name in files:
            if not os.path.exists(name):
                raise CheckpointError(f"shard {name} listed in {index} is missing")
        return files
    files = sorted(str(p) for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors files")
    return files


def open_checkpoint(path: Path) -> Checkpoint:
    """Read every shard's header (not the tensors) and check no shard is truncated."""
    ckpt = Checkpoint(path=path, files=shard_files(path))
    for name in ckpt.files:
        refs = read_header(name)
        check_not_truncated(name, refs)
        ckpt.tensors.update(refs)
    return ckpt
