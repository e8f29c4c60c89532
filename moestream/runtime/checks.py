"""Expert tensors checked against the config at load, before anything is read or computed.

The family says what [out, in] matrix each kind is (from the config's hidden and expert sizes), the
format says which parts of which stored type and shape hold such a matrix, so an integer, short or
transposed expert is named at load instead of giving plausible text (or a traceback at its first use).
Every expert of a (layer, kind) must match, since one format and one shape serve the whole layer.
"""

from __future__ import annotations

from typing import Any

from moestream.errors import CheckpointError, UnsupportedModelError
from moestream.hfconfig import text_config
from moestream.runtime.families import FAMILY_CLASSES
from moestream.runtime.formats import make_format
from moestream.store.experts import ExpertMap
from moestream.store.safetensors_file import TensorRef


def expert_dims(config: Any) -> tuple[int, int]:
    """(H, I): hidden size and routed-expert intermediate size of a transformers config (or its text
    part): `moe_intermediate_size` where the model also has a dense MLP size, else `intermediate_size`."""
    cfg = text_config(config)
    inter = getattr(cfg, "moe_intermediate_size", None) or getattr(cfg, "intermediate_size", None)
    if not inter or not getattr(cfg, "hidden_size", None):
        raise CheckpointError(
            f"config of model_type {getattr(config, 'model_type', '?')!r} gives no hidden size or expert "
            "intermediate size"
        )
    return int(cfg.hidden_size), int(inter)


def check_experts(emap: ExpertMap, config: Any) -> None:
    """Check the stored type and shape of every part of every expert (and the resident per-layer tensors)
    against what the config implies.

    Raises:
        CheckpointError: naming the first tensor that disagrees, with what was expected.
        UnsupportedModelError: a layer's experts are stored in a type no format computes.
    """
    hidden, inter = expert_dims(config)
    family = FAMILY_CLASSES[emap.family]
    logical = family.logical_shapes(hidden, inter)
    for (layer, kind), stored in sorted(emap.formats.items()):
        first = emap.units[(layer, 0)][kind]
        try:
            expected = make_format(stored, first).expected_parts(*logical[kind])
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(f"tensor {first[0].name} in {first[0].file}: {exc}") from None
        if expected is None:
            continue
        for expert in range(emap.num_experts):
            parts = emap.units[(layer, expert)][kind]
            if len(parts) != len(expected):
                raise CheckpointError(
                    f"the {kind} weights of expert {expert} of layer {layer} have {len(parts)} parts, "
                    f"expected {len(expected)}"
                )
            for ref, spec in zip(parts, expected):
                _check_part(ref, spec, hidden, inter)
    resident = family.resident_shapes(hidden, inter, emap.num_experts)
    for (_, name), ref in sorted(emap.resident.items()):
        if name in resident and tuple(ref.shape) != resident[name]:
            raise CheckpointError(
                f"tensor {ref.name} in {ref.file} has shape {list(ref.shape)}, but config.json "
                f"(hidden_size {hidden}, expert intermediate size {inter}) implies {list(resident[name])}"
            )


def _check_part(ref: TensorRef, spec: tuple[str, tuple[int, ...]], hidden: int, inter: int) -> None:
    dtype, shape = spec
    if ref.dtype != dtype:
        raise CheckpointError(
            f"tensor {ref.name} in {ref.file} has dtype {ref.dtype}; the experts of its layer are stored "
            f"as {dtype}, so it must be too"
        )
    if tuple(ref.shape) != shape:
        raise CheckpointError(
            f"tensor {ref.name} in {ref.file} has shape {list(ref.shape)}, but config.json (hidden_size "
            f"{hidden}, expert intermediate size {inter}) implies {list(shape)}"
        )
