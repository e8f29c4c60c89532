"""`REPO[:QUANT]` (llama.cpp's `-hf` convention) and which files of a repository it names.

Pure: a repository's file list in, the files to fetch and the one to open out (`select_files`). The
GGUF model whose path holds QUANT as a word (case-insensitive; else as a substring), every part of a
split; with several models and no QUANT, Q4_K_M (llama.cpp's default); in a repository without GGUF
files, the safetensors checkpoint (config, tokenizer, shards, chat template).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moestream.errors import CheckpointError

DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's choice when a repository holds several quants and none is named
# what a safetensors checkpoint needs beside its shards: config, generation config, tokenizer, template
CHECKPOINT_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model", "*.tiktoken")
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_SHOWN = 12  # files named at most in an error


@dataclass(frozen=True)
class HubSpec:
    """`REPO[:QUANT]` as the user wrote it."""

    repo: str
    quant: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}:{self.quant}" if self.quant else self.repo


@dataclass(frozen=True)
class Selection:
    """What to fetch of a repository (paths in it) and what to open: a GGUF file, or "" (the snapshot)."""

    files: tuple[str, ...]
    open: str


def parse_spec(text: str) -> HubSpec:
    """`owner/name` or `owner/name:QUANT`; anything else is a one-sentence error."""
    repo, _, quant = text.strip().partition(":")
    if not _REPO.match(repo) or (":" in text and not quant) or ":" in quant:
        raise CheckpointError(
            f"a model by name is OWNER/REPO or OWNER/REPO:QUANT (e.g. unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M), "
            f"not {text!r}"
        )
    return HubSpec(repo, quant or None)


def select_files(spec: HubSpec, names: list[str]) -> Selection:
    """The files of `spec` among a repository's `names`: a GGUF model (llama.cpp's rules) when the
    repository has GGUF files, else its safetensors checkpoint.

    Raises:
        CheckpointError: no GGUF matches the quant, several do, a split lacks a part, or the repository
            holds neither GGUF files nor a safetensors checkpoint; the message lists what it holds.
    """
    models = _gguf_models(names)
    if models:
        first = _pick_gguf(spec, models)
        missing = [part for part in models[first] if part not in names]
        if missing:
            raise CheckpointError(
                f"{spec.repo} lacks {_list(missing)} of the split GGUF {_model_name(first)}"
            )
        return Selection(tuple(models[first]), first)
    if spec.quant is not None:
        raise CheckpointError(
            f"{spec.repo} has no GGUF files, so no quant {spec.quant} to pick "
            f"({_holds(names)}){_hint_safetensors(spec, names)}"
        )
    top = [n for n in names if "/" not in n and not Path(n).name.startswith("consolidated")]
    if "config.json" in top and any(n.endswith(".safetensors") for n in top):
        files = [n for n in top if any(fnmatch.fnmatch(n, p) for p in CHECKPOINT_PATTERNS)]
        return Selection(tuple(sorted(files)), "")
    raise CheckpointError(
        f"{spec.repo} holds neither GGUF files nor a safetensors checkpoint (config.json and *.safetensors) "
        f"({_holds(names)})"
    )


def _gguf_models(names: list[str]) -> dict[str, list[str]]:
    """GGUF models by the path of their (first) file -> every file of the model, parts in order.
    Vision projectors (mmproj) are not models."""
    models: dict[str, list[str]] = {}
    for name in sorted(names):
        base = name.rsplit("/", 1)[-1]
        if not base.lower().endswith(".gguf") or "mmproj" in base.lower():
            continue
        match = _SPLIT.match(name)
        if match is None:
            models[name] = [name]
            continue
        count = int(match["count"])
        first = f"{match['stem']}-{1:05d}-of-{match['count']}.gguf"
        parts = (f"{match['stem']}-{no:05d}-of-{match['count']}.gguf" for no in range(1, count + 1))
        models.setdefault(first, list(parts))
    return models


def _pick_gguf(spec: HubSpec, models: dict[str, list[str]]) -> str:
    if spec.quant is None and len(models) == 1:
        return next(iter(models))
    quant = spec.quant or DEFAULT_QUANT
    token = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    matches = [m for m in models if token.search(m)] or [m for m in models if quant.lower() in m.lower()]
    shown = _list(_model_name(m) for m in models)
    if len(matches) == 1:
        return matches[0]
    if spec.quant is None:
        raise CheckpointError(
            f"{spec.repo} holds {len(models)} GGUF models and none is {DEFAULT_QUANT} (the default): "
            f"name one as {spec.repo}:QUANT ({shown})"
        )
    if not matches:
        raise CheckpointError(f"{spec.repo} has no GGUF file for the quant {spec.quant} ({shown})")
    raise CheckpointError(
        f"the quant {spec.quant} matches {len(matches)} GGUF models of {spec.repo}: name one exactly "
        f"({_list(_model_name(m) for m in matches)})"
    )


def _model_name(first: str) -> str:
    match = _SPLIT.match(first)
    return first if match is None else f"{match['stem']}.gguf in {match['count'].lstrip('0')} parts"


def _list(items: Any) -> str:
    items = list(items)
    more = f", ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def _holds(names: list[str]) -> str:
    return f"it holds {_list(sorted(names))}" if names else "it holds no files"


def _hint_safetensors(spec: HubSpec, names: list[str]) -> str:
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        return f"; for its safetensors checkpoint, drop the quant: {spec.repo}"
    return ""
