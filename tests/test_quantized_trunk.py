"""Trunk weights kept in block types: QuantLinear / QuantEmbedding from placeholders, tied output layers,
dequantized fallbacks, and the bytes they keep (their size in the file, nothing more)."""

from __future__ import annotations

import torch
from torch import nn

from moestream import ggml
from moestream.model.quantized import QuantEmbedding, QuantLinear, apply_quantized_trunk
from moestream.store.safetensors_file import TensorRef
from moestream.store.tensors import QuantizedTensor, read_bytes


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


def _exact_in_q8(rows: int, cols: int, group: int, g: torch.Generator) -> torch.Tensor:
    """Integer activations whose every `group` (a head, and so any 32-block of whole heads) holds 127:
    ggml's 8-bit activations (scale max|x| / 127 = 1) are then these values exactly, so a product on them
    differs from the f64 one only by float rounding."""
    x = torch.randint(-127, 128, (rows, cols), generator=g).float()
    x[:, ::group] = 127.0
    return x


def test_a_matrix_with_moved_columns_multiplies_its_stored_blocks_by_the_input_permuted(tmp_path):
    """A block matrix whose columns the model reads in another order (Qwen3.5's out_proj: whole value
    heads moved) keeps its blocks as stored; QuantLinear permutes its input instead. Its products (one row:
    ggml's 8-bit-activation kernel; many rows: the dequantized blocks by F.linear) equal the moved f32
    matrix's within float rounding, and differ without the permutation; dense it is the moved matrix."""
    g = torch.Generator().manual_seed(2)
    heads, head_dim = 8, 32
    stored = torch.randn(96, heads * head_dim, generator=g)
    values = _write(tmp_path / "t.bin", [("proj.weight", "Q8_0", stored)])
    value = values["proj.weight"]
    cols = torch.randperm(heads, generator=g).repeat_interleave(head_dim) * head_dim
    cols += torch.arange(head_dim).repeat(heads)  # column j is stored column cols[j], whole heads
    value.cols = cols
    blocks = ggml.dequantize(read_bytes(value.ref), "Q8_0", 96, heads * head_dim)
    moved = blocks[:, cols]
    assert torch.equal(value.dequantize(torch.float32), moved)
    layer = QuantLinear(value.raw(), value, None)
    assert torch.equal(layer.raw, read_bytes(value.ref))  # the file's bytes, nothing else
    assert "inputs" in dict(layer.named_buffers())  # moves with the module (.to(device))
    for rows in (1, max(layer.format().threshold, 2)):
        x = _exact_in_q8(rows, heads * head_dim, head_dim, g)
        ref = x.double() @ moved.double().T
        scale = ref.abs().max().item()
        assert (layer(x).double() - ref).abs().max().item() <= 1e-6 * scale, rows
        inputs, layer.inputs = layer.inputs, None
        assert (layer(x).double() - ref).abs().max().item() > 0.1 * scale, rows  # not permuted: wrong
        layer.inputs = inputs
    model = nn.Sequential()
    model.proj = nn.Linear(heads * head_dim, 96, bias=False)
    model.proj.weight = nn.Parameter(value[...], requires_grad=False)
    apply_quantized_trunk(model, {"proj.weight": value}, dense=True, dtype=torch.float32)
    assert torch.equal(model.proj.weight, moved)
