"""Build the transformers model with every routed-experts module replaced by `StreamingExperts`.

transformers' own `from_pretrained` builds the model (attention, norms, routers, shared experts, rotary
buffers, tied weights, checkpoint renames); only the experts class is swapped for the duration of the
call, through `transformers.monkey_patching.register_patch_mapping`. Since `StreamingExperts` has no
parameters, transformers finds no target for the expert tensors and never reads them.
"""
from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.monkey_patching import register_patch_mapping, unregister_patch_mapping

from moestream.errors import CheckpointError, UnsupportedModelError
from moestream.model.arch import Arch
from moestream.model.streaming import StreamingExperts

_PATCH_LOCK = threading.Lock()  # the patch mapping is process-global
_LAYER = re.compile(r"layers\.(\d+)\.")
_ROUTER = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(?:gate|router)$")
_EXPERT_KEY = re.compile(r"\.(mlp|block_sparse_moe)\.experts\.")


def load_config(path: Path) -> Any:
    """The checkpoint's transformers config, with a clear error when there is none or it is malformed."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{path} has no config.json, so it is not a HF checkpoint directory")
    try:
        json.loads(config_file.read_bytes())
    except OSError as exc:
        raise CheckpointError(f"cannot read {config_file}: {exc.strerror}") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(f"{config_file} is not valid JSON ({exc})") from None
    try:
        return AutoConfig.from_pretrained(str(path))
    except ValueError as exc:
        raise UnsupportedModelError(f"transformers cannot read the config in {path} ({exc})") from None
    except Exception as exc:  # a field of the wrong type (huggingface_hub's strict dataclass validation)
        reason = " ".join(str(exc).split())
        raise CheckpointError(f"transformers cannot read the config in {path} ({reason})") from None


@contextlib.contextmanager
def _quiet_transformers():
    """The replaced experts' checkpoint keys are reported as unexpected; we check them ourselves."""
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


def build_model(path: Path, config: Any, arch: Arch, dtype: str | torch.dtype) -> torch.nn.Module:
    """from_pretrained with the experts class patched; checks that nothing but experts went unloaded."""
    if getattr(config, "quantization_config", None) is not None:
        method = dict(config.quantization_config).get("quant_method") if isinstance(config.quantization_config, dict) \
            else getattr(config.quantization_config, "quant_method", None)
        if method != "mxfp4":
            raise UnsupportedModelError(f"quantization {method!r} in {path} is not supported (only MXFP4 experts)")
        del config.quantization_config  # only the experts are MXFP4; moestream dequantizes them after each read
    with _PATCH_LOCK, _quiet_transformers():
        register_patch_mapping({arch.experts_class: StreamingExperts}, overwrite=True)
        try:
            # mismatched sizes are reported by us, naming the tensor, instead of transformers' RuntimeError
            model, info = AutoModelForCausalLM.from_pretrained(
                str(path), config=config, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True
            )
        except OSError as exc:  # e.g. shards without model.safetensors or an index naming them
            reason = " ".join(str(exc).split())
            raise CheckpointError(f"transformers cannot load the weights in {path} ({reason})") from None
        finally:
            unregister_patch_mapping([arch.experts_class])
    mismatched = sorted(info.get("mismatched_keys", []))
    if mismatched:
        name, stored, expected = mismatched[0]
        raise CheckpointError(f"tensor {name} in {path} has shape {list(stored)}, but config.json implies "
                              f"{list(expected)} ({len(mismatched)} tensors disagree with the config)")
    missing = [k for k in info.get("missing_keys", []) if not _EXPERT_KEY.search(k)]
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} non-expert tensors, e.g. {sorted(missing)[0]}")
    model.eval()
    return model


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


def router_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """layer index -> the router module of that MoE layer (`mlp.gate`, or `mlp.router` for gpt-oss)."""
    found = {}
    for name, module in model.named_modules():
        match = _ROUTER.search(name)
        if match:
            found[int(match.group(1))] = module
    return found
