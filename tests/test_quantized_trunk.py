"""Trunk weights kept in block types: QuantLinear / QuantEmbedding from placeholders, tied output layers,
dequantized fallbacks, and the bytes they keep (their size in the file, nothing more)."""

from __future__ import annotations

import torch
from torch import nn

from moestream import ggml
from moestream.model.quantized import QuantEmbedding, QuantLinear, apply_quantized_trunk
from moestream.store.safetensors_file import TensorRef
from moestream.store.tensors import QuantizedTensor


def _ggml_dequantize(raw, type_name, shape):
    return ggml.dequantize(raw, type_name, shape[0], shape[1])


def _write(path, tensors):
    """Write (name, type, f32 weights) as blocks back to back (32-aligned); returns QuantizedTensors."""
    blob, values = bytearray(), {}
    for name, type_name, w in tensors:
        data = ggml.quantize(w, type_name).numpy().tobytes()
        ref = TensorRef(str(path), len(blob), len(data), type_name, tuple(w.shape), name)
        values[name] = QuantizedTensor(ref, tuple(w.shape), torch.float32, _ggml_dequantize)
        blob += data + b"\0" * (-len(data) % 32)
    path.write_bytes(bytes(blob))
    return values


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 256)
        self.proj = nn.Linear(256, 256, bias=True)
        self.norm_scale = nn.Parameter(torch.ones(64, 256))  # neither Linear nor Embedding: dequantized
        self.head = nn.Linear(256, 64, bias=False)
        self.head.weight = self.embed.weight  # tied


def _placeholders(model, values):
    """What transformers leaves: placeholder parameters, then the output layer tied to the embedding."""
    for name, value in values.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, nn.Parameter(value[...], requires_grad=False))
    model.head.weight = model.embed.weight


def test_block_modules_compute_with_the_stored_blocks(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = {
        "embed.weight": torch.randn(64, 256, generator=g),
        "proj.weight": torch.randn(256, 256, generator=g),
        "norm_scale": torch.randn(64, 256, generator=g),
    }
    values = _write(
        tmp_path / "t.bin",
        [
            ("embed.weight", "Q6_K", w["embed.weight"]),
            ("proj.weight", "Q8_0", w["proj.weight"]),
            ("norm_scale", "Q4_K", w["norm_scale"]),
        ],
    )
    model = Tiny()
    _placeholders(model, values)
    bias = model.proj.bias.detach().clone()
    assert model.proj.weight.untyped_storage().nbytes() == 4  # the placeholder holds one element
    kept = apply_quantized_trunk(model, values, dense=False, dtype=torch.float32)
    assert isinstance(model.embed, QuantEmbedding) and isinstance(model.proj, QuantLinear)
    assert isinstance(model.head, QuantLinear)  # the tied output layer reads the embedding's blocks
    assert model.head.raw.data_ptr() == model.embed.raw.data_ptr()
    assert kept == values["embed.weight"].ref.nbytes + values["proj.weight"].ref.nbytes
    x = torch.randn(3, 256, generator=g)
    raw = values["proj.weight"].raw()
    assert torch.equal(model.proj(x), ggml.linear(x, raw, "Q8_0", 256) + bias)
    ids = torch.tensor([[3, 7], [63, 0]])
    table = ggml.dequantize(values["embed.weight"].raw(), "Q6_K", 64, 256)
    assert torch.equal(model.embed(ids), table[ids])
    assert torch.equal(model.norm_scale, ggml.dequantize(values["norm_scale"].raw(), "Q4_K", 64, 256))
    assert model.proj(x.reshape(1, 3, 256)).shape == (1, 3, 256)


def test_dense_trunk_dequantizes_every_block_weight(tmp_path):
    g = torch.Generator().manual_seed(1)
    values = _write(tmp_path / "t.bin", [("proj.weight", "Q8_0", torch.randn(256, 256, generator=g))])
    model = Tiny()
    _placeholders(model, values)
    assert apply_quantized_trunk(model, values, dense=True, dtype=torch.bfloat16) == 0
    assert isinstance(model.proj, nn.Linear) and model.proj.weight.dtype == torch.bfloat16
    expected = ggml.dequantize(values["proj.weight"].raw(), "Q8_0", 256, 256).to(torch.bfloat16)
    assert torch.equal(model.proj.weight, expected)
