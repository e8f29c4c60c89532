"""The trunk of a GGUF: every non-expert tensor under the name transformers gives it.

Names: each key of the model transformers builds is mapped to its GGUF name with llama.cpp's own table
(`gguf.TensorNameMap`, the one its converter writes with), after the renames the converter makes first.
Values: what llama.cpp's converter changed is undone here, per architecture:
  * llama (Mixtral): Q and K rows permuted for llama.cpp's rope -> permuted back;
  * qwen3next, qwen35moe: norms stored as w + 1 (except the gated delta-net norm), A_log stored as
    -exp(A_log), conv1d squeezed; Qwen3-Next's in_proj_qkvz split into attn_qkv + attn_gate;
    Qwen3.5's value heads reordered from grouped (by key head) to tiled (rows moved back as whole rows;
    out_proj's columns not moved: its input is permuted instead, `_moved_cols`);
  * deepseek2: kv_b_proj split into attn_k_b (transposed per head) and attn_v_b;
  * any: a tensor llama.cpp stores with other singleton dimensions (shared-expert gate [H] for [1, H]).
F32/F16/BF16 tensors are read as stored; other types are dequantized on load (`load_tensor`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from moestream.errors import CheckpointError
from moestream.store.safetensors_file import TensorRef
from moestream.store.tensors import TORCH_DTYPES, QuantizedTensor, read_bytes, read_tensor

Load = Callable[[], torch.Tensor]


def load_tensor(ref: TensorRef) -> torch.Tensor:
    """A GGUF tensor in its logical shape, read into memory the process owns: F32/F16/BF16 as stored,
    any other ggml type dequantized to float32."""
    if ref.dtype in TORCH_DTYPES:
        return read_tensor(ref)
    return dequantize_blocks(read_bytes(ref), ref.dtype, tuple(ref.shape))


def dequantize_blocks(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Blocks of a ggml type (uint8) -> float32 of `shape` (ggml's own dequantizer: bit-identical to the
    gguf package's, and much faster)."""
    from moestream import ggml

    rows = math.prod(shape[:-1])
    return ggml.dequantize(raw, type_name, rows, shape[-1]).view(shape)


class GgufTensor:
    """A trunk tensor computed on first use (`t[...]`) from one or more GGUF tensors; exposes its shape
    and dtype without reading, like `LazyTensor`."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, load: Load) -> None:
        self._shape, self._dtype, self._load = torch.Size(shape), dtype, load

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def shape(self) -> torch.Size:
        return self._shape

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def get_dtype(self) -> str:
        return str(self._dtype).removeprefix("torch.")

    def is_floating_point(self) -> bool:
        return self._dtype.is_floating_point

    def __getitem__(self, index: object) -> torch.Tensor:
        tensor = self._load().to(self._dtype).reshape(self._shape)
        return tensor if index is Ellipsis else tensor[index]


def gguf_name(key: str, name_map: Any) -> str | None:
    """The GGUF name of a transformers key, after the renames llama.cpp's converter makes before its
    name table (`filter_tensors`, `modify_tensors`)."""
    key = key.replace(".e_score_correction_bias", ".e_score_correction.bias")
    key = key.replace("linear_attn.dt_bias", "linear_attn.dt_proj.bias")
    key = re.sub(r"\.sinks$", ".sinks.weight", key)
    return name_map.get_name(key, try_suffixes=(".weight", ".bias"))


def _stored_dtype(ref: TensorRef) -> torch.dtype:
    return TORCH_DTYPES.get(ref.dtype, torch.float32)


class Trunk:
    """Builds the trunk state dict of one GGUF for one model (its config and expected keys)."""

    def __init__(
        self,
        arch: str,
        tensor_arch: str,
        config: Any,
        tensors: Mapping[str, TensorRef],
        keep_blocks: bool = True,
    ) -> None:
        import gguf

        self.arch, self.config, self.tensors, self.keep_blocks = arch, config, tensors, keep_blocks
        blocks = config.num_hidden_layers + 8  # room for the MTP blocks llama.cpp appends
        self.name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, tensor_arch), blocks)

    def state_dict(
        self, expected: Mapping[str, tuple[int, ...]], skip: set[str]
    ) -> dict[str, GgufTensor | QuantizedTensor]:
        """Every expected key the GGUF holds (the GGUF tensors in `skip`, the experts, are never used)."""
        out = {}
        for key, shape in expected.items():
            value = self.tensor(key, tuple(shape), skip)
            if value is not None:
                out[key] = value
        return out

    def tensor(self, key: str, shape: tuple[int, ...], skip: set[str]) -> GgufTensor | QuantizedTensor | None:
        composed = self._composite(key)
        if composed is not None:
            return self._joined_blocks(key, shape) or GgufTensor(shape, torch.float32, composed)
        name = gguf_name(key, self.name_map)
        if name is None or name not in self.tensors or name in skip:
            return None
        ref = self.tensors[name]
        if math.prod(ref.shape) != math.prod(shape):
            raise CheckpointError(
                f"GGUF tensor {name} has shape {list(ref.shape)}, but {key} needs {list(shape)}"
            )
        transform = self._transform(key)
        rows, cols = self._moved_rows(key, shape), self._moved_cols(key, shape)
        if (
            (transform is None or rows is not None or cols is not None)
            and self.keep_blocks
            and ref.dtype not in TORCH_DTYPES
            and len(shape) == 2
            and tuple(ref.shape) == shape
        ):
            return QuantizedTensor(
                ref, shape, torch.float32, dequantize_blocks, rows, cols=cols
            )  # computed on its blocks
        dtype = _stored_dtype(ref) if transform is None or transform[1] else torch.float32
        if transform is None:
            return GgufTensor(shape, dtype, lambda: load_tensor(ref))
        fn = transform[0]
        return GgufTensor(shape, dtype, lambda: fn(load_tensor(ref)))

    # --- what llama.cpp's converter changed -------------------------------------------------------

    def _transform(self, key: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], bool] | None:
        """(undo, keeps_values) for a key whose stored value llama.cpp changed, else None."""
        cfg = self.config
        if self.arch == "llama" and re.search(r"\.(q|k)_proj\.(weight|bias)$", key):
            heads = cfg.num_attention_heads if ".q_proj." in key else cfg.num_key_value_heads
            return (lambda t: unpermute_rope(t, heads)), True
        if self.arch not in ("qwen3next", "qwen35moe"):
            return None
        if key.endswith("norm.weight") and not key.endswith("linear_attn.norm.weight"):
            return (lambda t: t.float() - 1), False  # stored as w + 1
        if key.endswith("linear_attn.A_log"):
            return (lambda t: self._v_order(key, torch.log(-t.float()))), False  # stored as -exp(A_log)
        if self.arch == "qwen35moe" and ".linear_attn." in key:
            return (lambda t: self._v_order(key, t)), True
        return None

    def _moved_rows(self, key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Where `_transform` only reorders whole rows (Qwen3.5's value heads in in_proj_qkv, in_proj_z,
        in_proj_a, in_proj_b): that order (row i is stored row rows[i]), so a block type's rows move as
        they are and stay blocks (f32 else: 3 GB more for Qwen3.5-35B-A3B's). Else None."""
        cfg = self.config
        moved = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight")
        if self.arch != "qwen35moe" or not key.endswith(moved) or len(shape) != 2:
            return None
        if cfg.linear_num_key_heads == cfg.linear_num_value_heads:
            return None
        return self._v_order(key, torch.arange(shape[0]).reshape(-1, 1)).reshape(-1)

    def _moved_cols(self, key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Qwen3.5's out_proj, whose columns (inputs) `_transform` reorders by whole value heads: that
        order (column j is stored column cols[j]), so its blocks stay as stored (a moved column would
        split them: f32 else, ~1 GB more for Qwen3.5-35B-A3B's) and its products permute their input
        (`QuantizedTensor.stored_inputs`). Else None."""
        cfg = self.config
        if self.arch != "qwen35moe" or not key.endswith("linear_attn.out_proj.weight") or len(shape) != 2:
            return None
        if cfg.linear_num_key_heads == cfg.linear_num_value_heads:
            return None
        return self._v_order(key, torch.arange(shape[1]).reshape(1, -1)).reshape(-1)

    def _v_order(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """Qwen3.5: value heads back from llama.cpp's tiled order to grouped by key head."""
        cfg = self.config
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        if self.arch != "qwen35moe" or nk == nv:
            return t
        r, dv, qk = nv // nk, cfg.linear_value_head_dim, 2 * cfg.linear_key_head_dim * nk
        if key.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # rows [q; k; v]: only v moved
            t = t.reshape(t.shape[0], -1)
            return torch.cat([t[:qk], grouped(t[qk:], 0, nk, r, dv)])
        if key.endswith("in_proj_z.weight"):
            return grouped(t, 0, nk, r, dv)
        if key.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            return grouped(t, 0, nk, r, 1)
        if key.endswith("out_proj.weight"):
            return grouped(t, 1, nk, r, dv)
        return t

    def _composite(self, key: str) -> Load | None:
        """A transformers tensor llama.cpp splits into several GGUF tensors (newer converters)."""
        if self.arch == "deepseek2" and key.endswith("self_attn.kv_b_proj.weight"):
            return self._parts(key, ("attn_k_b", "attn_v_b"), self._kv_b)
        if self.arch == "qwen3next" and key.endswith("linear_attn.in_proj_qkvz.weight"):
            return self._parts(key, ("attn_qkv", "attn_gate"), self._qkvz)
        return None

    def _joined_blocks(self, key: str, shape: tuple[int, ...]) -> QuantizedTensor | None:
        """Qwen3-Next's in_proj_qkvz from attn_qkv and attn_gate of one block type: their rows, one after
        another, put in `_qkvz`'s order as whole rows, so they stay blocks (f32 else: 3.6 GB more for
        Qwen3-Next-80B-A3B's 36 linear-attention layers). Else None."""
        if self.arch != "qwen3next" or not key.endswith("linear_attn.in_proj_qkvz.weight"):
            return None
        block = re.search(r"layers\.(\d+)\.", key)
        refs = [self.tensors.get(f"blk.{block[1]}.{leaf}.weight") for leaf in ("attn_qkv", "attn_gate")]
        if not self.keep_blocks or any(r is None for r in refs) or len(shape) != 2:
            return None
        qkv, gate = refs
        if qkv.dtype != gate.dtype or qkv.dtype in TORCH_DTYPES or qkv.shape[1:] != gate.shape[1:]:
            return None
        n = qkv.shape[0]
        if (n + gate.shape[0], qkv.shape[1]) != tuple(shape):
            return None
        order = self._qkvz(torch.arange(n).reshape(-1, 1), torch.arange(n, shape[0]).reshape(-1, 1))
        whole = dataclasses.replace(qkv, nbytes=qkv.nbytes + gate.nbytes, shape=tuple(shape), name=key)
        return QuantizedTensor(whole, shape, torch.float32, dequantize_blocks, order.reshape(-1), (qkv, gate))

    def _parts(self, key: str, leaves: tuple[str, ...], join: Callable[..., torch.Tensor]) -> Load | None:
        block = re.search(r"layers\.(\d+)\.", key)
        if block is None or gguf_name(key, self.name_map) in self.tensors:
            return None  # stored whole (older converters)
        refs = [self.tensors.get(f"blk.{block[1]}.{leaf}.weight") for leaf in leaves]
        if any(ref is None for ref in refs):
            return None
        return lambda: join(*(load_tensor(ref).float() for ref in refs))

    def _kv_b(self, k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
        """k_b [heads, kv_lora, nope] (transposed per head) and v_b [heads, v, kv_lora] ->
        kv_b_proj [heads * (nope + v), kv_lora], rows per head: nope then v."""
        heads = self.config.num_attention_heads
        k_b, v_b = k_b.reshape(heads, -1, k_b.shape[-1]), v_b.reshape(heads, -1, v_b.shape[-1])
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, v_b.shape[-1])

    def _qkvz(self, qkv: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """attn_qkv [q all; k all; v all] and attn_gate [z all] -> in_proj_qkvz, whose rows are grouped
        per key head: [q_h, k_h, v_h (nv/nk heads), z_h (nv/nk heads)] for each key head h."""
        cfg = self.config
        nk, dk, hidden = cfg.linear_num_key_heads, cfg.linear_key_head_dim, qkv.shape[-1]
        q, k, v = qkv[: nk * dk], qkv[nk * dk : 2 * nk * dk], qkv[2 * nk * dk :]
        parts = [t.reshape(nk, -1, hidden) for t in (q, k, v, z)]
        return torch.cat(parts, dim=1).reshape(-1, hidden)


def unpermute_rope(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's `LlamaModel.permute`, which reorders each head's rows from rotate-half pairs
    (i, i + d/2) to interleaved pairs (2i, 2i + 1): [heads * d, ...] -> [heads * d, ...]."""
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def grouped(t: torch.Tensor, dim: int, nk: int, r: int, head_dim: int) -> torch.Tensor:
    """Value heads along `dim` from tiled order [r, nk, head_dim] (llama.cpp) back to grouped order
    [nk, r, head_dim] (transformers: each key head's r value heads together)."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], r, nk, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)
