"""Build the transformers model with every routed-experts module replaced by `StreamingExperts`.

transformers' own `from_pretrained` builds the model on the meta device (attention, norms, routers,
shared experts, rotary buffers, tied weights, checkpoint renames) and then assigns the trunk tensors a
`CheckpointSource` provides (read lazily, into memory the process owns); only the experts class is
swapped for the duration of the call, through `transformers.monkey_patching.register_patch_mapping`.
`StreamingExperts` has no parameters, so no expert tensor is asked for.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.monkey_patching import apply_patches, register_patch_mapping, unregister_patch_mapping

from moestream.errors import CheckpointError, UnsupportedModelError
from moestream.model.arch import Arch
from moestream.model.lazy_dir import linear_lazy_dir, tolerant_alias_dirs
from moestream.model.quantized import apply_quantized_trunk
from moestream.model.streaming import StreamingExperts
from moestream.store.experts import ExpertMap
from moestream.store.source import CheckpointSource
from moestream.store.tensors import QuantizedTensor

_PATCH_LOCK = threading.Lock()  # the patch mapping is process-global
_LAYER = re.compile(r"layers\.(\d+)\.")
_ROUTER = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(?:gate|router)$")
_EXPERT_KEY = re.compile(r"\.(mlp|block_sparse_moe)\.experts\.")


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' loading bars and notices about keys it did not use; we check the keys ourselves."""
    from transformers.utils import logging as hf_logging

    logger = logging.getLogger("transformers")
    level, bars = logger.level, hf_logging.is_progress_bar_enabled()
    logger.setLevel(logging.ERROR)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


def trunk_tensors(
    source: CheckpointSource, config: Any, arch: Arch, emap: ExpertMap, keep_blocks: bool = True
) -> dict[str, Any]:
    """The source's trunk (non-expert) tensors by model parameter name, not read yet (what `build_model`
    loads; the memory check sizes them before anything is read)."""
    with _PATCH_LOCK, _quiet_transformers(), linear_lazy_dir(), tolerant_alias_dirs():
        register_patch_mapping({arch.experts_class: StreamingExperts}, overwrite=True)
        try:
            expected = ExpectedKeys(_causal_lm_class(config), _model_config(config))
            return source.trunk_state_dict(emap, expected, keep_blocks)
        finally:
            unregister_patch_mapping([arch.experts_class])


def build_model(
    source: CheckpointSource, config: Any, arch: Arch, dtype: str | torch.dtype, trunk: dict[str, Any]
) -> torch.nn.Module:
    """The model built on the meta device with the experts class patched, then given the source's trunk
    (`trunk`: what `trunk_tensors` returned). Trunk weights stored in block types (`QuantizedTensor`:
    `trunk_tensors` with `keep_blocks`) stay in them (`QuantLinear`, `QuantEmbedding`); the others are
    loaded in the model's dtype.

    Raises:
        CheckpointError: a non-expert tensor the model needs is not in the checkpoint, or has a shape
            the config does not imply.
    """
    model_class = _causal_lm_class(config)
    with _PATCH_LOCK, _quiet_transformers(), linear_lazy_dir(), tolerant_alias_dirs():
        register_patch_mapping({arch.experts_class: StreamingExperts}, overwrite=True)
        try:
            blocks = {k: v for k, v in trunk.items() if isinstance(v, QuantizedTensor)}
            for value in blocks.values():  # placeholders in the model's dtype: never cast, never allocated
                value.placeholder_dtype = model_dtype(dtype, config)
            # sizes that disagree with the config are reported below, naming the tensor, instead of
            # transformers' RuntimeError pointing at a report it logged
            model, info = model_class.from_pretrained(
                None,
                config=_model_config(config),
                state_dict=trunk,
                dtype=dtype,
                output_loading_info=True,
                ignore_mismatched_sizes=True,
            )
        finally:
            unregister_patch_mapping([arch.experts_class])
    mismatched = sorted(info.get("mismatched_keys", []))
    if mismatched:
        name, stored, expected = mismatched[0]
        raise CheckpointError(
            f"tensor {name} in {source.path} has shape {list(stored)}, but config.json implies "
            f"{list(expected)} ({len(mismatched)} tensors disagree with the config)"
        )
    missing = [k for k in info.get("missing_keys", []) if not _EXPERT_KEY.search(k)]
    if missing:
        raise CheckpointError(
            f"{source.path} lacks {len(missing)} non-expert tensors, e.g. {sorted(missing)[0]}"
        )
    if blocks:
        apply_quantized_trunk(model, blocks, dense=False, dtype=model_dtype(dtype, config))
    generation = source.generation_config()
    if generation is not None:
        model.generation_config = generation
    model.eval()
    return model


def model_dtype(dtype: str | torch.dtype, config: Any) -> torch.dtype:
    """The dtype transformers builds the model in for `dtype` ("auto": the config's, else float32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    configured = getattr(config, "dtype", None)
    if isinstance(configured, str):
        configured = getattr(torch, configured, None)
    return configured if isinstance(configured, torch.dtype) else torch.float32


class ExpectedKeys(Mapping):
    """The model's state-dict keys and shapes (StreamingExperts patched in, so no expert keys), from the
    model built on the meta device on first use: a source whose names are not transformers' (GGUF)
    maps them onto these; a safetensors source never asks, so pays nothing."""

    def __init__(self, model_class: type, config: Any) -> None:
        self._model_class, self._config = model_class, config
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def _built(self) -> dict[str, tuple[int, ...]]:
        if self._shapes is None:
            with torch.device("meta"), linear_lazy_dir(), tolerant_alias_dirs(), apply_patches():
                model = self._model_class(self._config)
            self._shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
        return self._shapes

    def __getitem__(self, key: str) -> tuple[int, ...]:
        return self._built()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._built())


def _model_config(config: Any) -> Any:
    """The config the causal LM class is built from: a composite (vision-language) config's text config
    where transformers' causal LM class takes that (Qwen3.5's), as AutoModelForCausalLM.from_pretrained
    swaps it; else `config`."""
    text = (getattr(config, "sub_configs", None) or {}).get("text_config")
    if text is not None and getattr(_causal_lm_class(config), "config_class", None) is text:
        return config.get_text_config()
    return config


def _causal_lm_class(config: Any) -> type:
    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise UnsupportedModelError(
            f"transformers has no causal LM class for model_type {config.model_type!r}"
        ) from None


def streaming_modules(model: torch.nn.Module) -> list[tuple[int, StreamingExperts]]:
    """(layer index, module) for every replaced experts module, in layer order."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, StreamingExperts):
            match = _LAYER.search(name)
            if match is None:
                raise UnsupportedModelError(f"cannot tell the layer of experts module {name}")
            found.append((int(match.group(1)), module))
    if not found:
        raise UnsupportedModelError(f"{type(model).__name__} has no routed-experts module to stream")
    return sorted(found, key=lambda item: item[0])


def is_router_tensor(name: str) -> bool:
    """Whether the model parameter `name` is a router module's (`router_modules`)."""
    return _ROUTER.search(name.rpartition(".")[0]) is not None


def router_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """layer index -> the router module of that MoE layer (`mlp.gate`, or `mlp.router` for gpt-oss)."""
    found = {}
    for name, module in model.named_modules():
        match = _ROUTER.search(name)
        if match:
            found[int(match.group(1))] = module
    return found
