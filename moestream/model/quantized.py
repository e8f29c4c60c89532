"""Trunk modules that compute on block types as stored (a GGUF file's Q8_0/Q6_K/Q4_K attention, shared
experts, embedding and output matrices), with the same weight formats (and kernels) as the experts, so
the resident trunk costs its bytes in the file.

transformers builds the model with zero-size placeholders for these weights (`QuantizedTensor`); then
every `nn.Linear` whose weight is one becomes a `QuantLinear`, every `nn.Embedding` a `QuantEmbedding`
(looked-up rows dequantized), and any other parameter is dequantized in place. `dense=True`
(`--trunk-dtype`) dequantizes everything instead.
"""

from __future__ import annotations

import torch
from torch import nn

from moestream.runtime.formats import WeightFormat, make_format
from moestream.store.experts import StoredFormat
from moestream.store.tensors import QuantizedTensor


class _Blocks(nn.Module):
    """Holds one matrix's blocks and the format computing them on the device they are on."""

    def __init__(self, raw: torch.Tensor, value: QuantizedTensor) -> None:
        super().__init__()
        self.register_buffer("raw", raw, persistent=False)  # uint8 [rows * row_bytes]
        self.stored = StoredFormat(value.type_name)
        self.ref = value.ref
        self.rows, self.cols = value.logical_shape
        self._formats: dict[str, WeightFormat] = {}

    def format(self) -> WeightFormat:
        device = self.raw.device.type
        fmt = self._formats.get(device)
        if fmt is None:
            fmt = self._formats[device] = make_format(self.stored, (self.ref,), device)
        return fmt


class QuantLinear(_Blocks):
    """y = x @ W^T (+ b) for W [out, in] in a block type. With `inputs` (a stored matrix whose columns
    the model reads in another order: Qwen3.5's out_proj), the blocks are multiplied as stored by the
    input reordered: x[..., inputs] @ stored^T."""

    def __init__(self, raw: torch.Tensor, value: QuantizedTensor, bias: torch.Tensor | None) -> None:
        super().__init__(raw, value)
        self.out_features, self.in_features = self.rows, self.cols
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_buffer("inputs", value.stored_inputs, persistent=False)  # int64 [in] or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fmt = self.format()
        if self.inputs is not None:
            x = x.index_select(-1, self.inputs)
        y = fmt.linear(x.reshape(-1, self.in_features), fmt.view([self.raw]))  # [M, out], x's dtype
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        bias, moved = self.bias is not None, ", inputs permuted" if self.inputs is not None else ""
        return f"in={self.in_features}, out={self.out_features}, {self.stored.name}, bias={bias}{moved}"


class QuantEmbedding(_Blocks):
    """Embedding rows in a block type; the rows looked up are dequantized into `dtype`."""

    def __init__(self, raw: torch.Tensor, value: QuantizedTensor, dtype: torch.dtype) -> None:
        super().__init__(raw, value)
        self.num_embeddings, self.embedding_dim, self.dtype = self.rows, self.cols, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.format().lookup(self.raw, ids.reshape(-1), self.dtype)  # [n, dim]
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.stored.name}"


def apply_quantized_trunk(
    model: nn.Module, quantized: dict[str, QuantizedTensor], dense: bool, dtype: torch.dtype
) -> int:
    """Replace the placeholders of `quantized` (model parameter name -> tensor; tied names found here)
    with block modules, or (`dense`, or a parameter no block module computes) with dequantized weights
    in `dtype`. Returns the bytes of trunk weights kept in block types."""
    quantized = _with_tied_names(model, quantized)
    by_module: dict[str, dict[str, QuantizedTensor]] = {}
    for name, value in quantized.items():
        owner, _, attr = name.rpartition(".")
        by_module.setdefault(owner, {})[attr] = value
    raws: dict[int, torch.Tensor] = {}  # tied weights share one copy of their blocks
    kept = 0
    for owner, params in by_module.items():
        module = model.get_submodule(owner)
        weight = params.get("weight")
        if not dense and weight is not None and isinstance(module, (nn.Linear, nn.Embedding)):
            fresh = id(weight.ref) not in raws
            raw = raws.setdefault(id(weight.ref), weight.raw()) if fresh else raws[id(weight.ref)]
            if isinstance(module, nn.Linear):
                bias = module.bias.detach() if module.bias is not None else None
                _replace(model, owner, QuantLinear(raw, weight, bias))
            else:
                _replace(model, owner, QuantEmbedding(raw, weight, dtype))
            kept += raw.numel() if fresh else 0
            continue
        for attr, value in params.items():
            setattr(module, attr, nn.Parameter(value.dequantize(dtype), requires_grad=False))
    return kept


def block_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights kept in block types (QuantLinear, QuantEmbedding; tied ones once)."""
    raws = {m.raw.data_ptr(): m.raw.nbytes for m in model.modules() if isinstance(m, _Blocks)}
    return sum(raws.values())


def _with_tied_names(model: nn.Module, quantized: dict[str, QuantizedTensor]) -> dict[str, QuantizedTensor]:
    """Add the names of parameters tied to a placeholder (an output layer sharing the embedding)."""
    by_param = {id(model.get_parameter(name)): value for name, value in quantized.items()}
    out = dict(quantized)
    for name, param in model.named_parameters(remove_duplicate=False):
        if name not in out and id(param) in by_param:
            out[name] = by_param[id(param)]
    return out


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
