"""Streaming safetensors writer, sharding, atomic output directory, and the random-value source."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open

from moestream.errors import MoestreamError
from moestream.synth import noise
from moestream.synth.build import SYNTH_MARKER, synthesize
from moestream.synth.writer import TensorData, plan_shards, shard_names, write_checkpoint

TINY = dict(arch="qwen3_moe", layers=2, experts=8, top_k=2, hidden=64, moe_intermediate=32)


def _const(name: str, shape: tuple[int, ...], value: float, dtype=torch.float32, sd="F32") -> TensorData:
    t = torch.full(shape, value, dtype=dtype)
    return TensorData(name, sd, shape, lambda: noise.tensor_bytes(t))


def test_header_format_and_values(tmp_path):
    tensors = [_const("a", (3,), 1.5), _const("b.weight", (2, 5), -2.0, torch.bfloat16, "BF16")]
    files = write_checkpoint(tmp_path, tensors, shard_bytes=1 << 30)
    assert files == ["model.safetensors"]
    raw = (tmp_path / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and raw[8 : 8 + n].rstrip(b" ").endswith(b"}")
    header = json.loads(raw[8 : 8 + n])
    assert header["a"] == {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}
    assert header["b.weight"]["data_offsets"] == [12, 32]
    assert len(raw) == 8 + n + 32
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as st:
        assert torch.equal(st.get_tensor("a"), torch.full((3,), 1.5))
        assert torch.equal(st.get_tensor("b.weight"), torch.full((2, 5), -2.0, dtype=torch.bfloat16))


def test_sharding_and_index(tmp_path):
    tensors = [_const(f"t{i}", (256,), float(i)) for i in range(5)]  # 1 KiB each
    tensors.insert(2, _const("big", (1024,), 9.0))  # 4 KiB: larger than a shard
    assert [len(s) for s in plan_shards(tensors, 2048)] == [2, 1, 2, 1]
    files = write_checkpoint(tmp_path, tensors, shard_bytes=2048)
    assert files == shard_names(4) + ["model.safetensors.index.json"]
    assert files[0] == "model-00001-of-00004.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 1024 + 4096
    assert index["weight_map"]["big"] == "model-00002-of-00004.safetensors"
    for name, shard in index["weight_map"].items():
        with safe_open(str(tmp_path / shard), "pt") as st:
            assert name in st.keys()  # noqa: SIM118 (safe_open has no __contains__)


def test_short_chunk_producer_is_an_error(tmp_path):
    bad = TensorData("x", "F32", (4,), lambda: iter([torch.zeros(8, dtype=torch.uint8)]))
    with pytest.raises(RuntimeError, match="produced 8 bytes, expected 16"):
        write_checkpoint(tmp_path, [bad], shard_bytes=1 << 20)


def test_sharded_synth_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    out = synthesize(tmp_path / "sharded", shard_bytes=100_000, **TINY)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    marker = json.loads((out / SYNTH_MARKER).read_text())
    assert index["metadata"]["total_size"] == marker["total_bytes"]
    _model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = synthesize(tmp_path / "a", seed=3, **TINY)
    b = synthesize(tmp_path / "b", seed=3, **TINY)
    c = synthesize(tmp_path / "c", seed=4, **TINY)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_interrupted_synth_leaves_nothing(tmp_path):
    def boom(done: int, total: int) -> None:
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        synthesize(tmp_path / "out", on_progress=boom, **TINY)
    assert list(tmp_path.iterdir()) == []


def test_existing_directory_needs_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    synthesize(out, **TINY)  # an empty directory is fine
    with pytest.raises(MoestreamError, match="not empty"):
        synthesize(out, **TINY)
    (out / "stale.txt").write_text("old")
    synthesize(out, force=True, seed=1, **TINY)
    assert not (out / "stale.txt").exists() and (out / SYNTH_MARKER).exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_noise_statistics_and_uniqueness():
    src = noise.NoiseSource(seed=0)
    chunks = [
        c.view(torch.bfloat16).float().clone()
        for _ in range(64)
        for c in src.gaussian(4096, 0.02, torch.bfloat16)
    ]
    x = torch.stack(chunks)  # 64 "experts" of 4096 values
    assert abs(x.std().item() - 0.02) < 0.001 and abs(x.mean().item()) < 0.001
    assert len({tuple(r[:16].tolist()) for r in x}) == 64  # every expert differs


def test_noise_has_no_short_period():
    """A tensor read 4096 (or 8192, ...) bytes off must not look right: no period of 2**k elements."""
    src = noise.NoiseSource(seed=1)
    big = torch.cat([c.clone() for c in src.gaussian(noise.PERIOD + 100_000, 1.0, torch.bfloat16)])
    vals = big.view(torch.bfloat16).float()
    assert vals.numel() == noise.PERIOD + 100_000
    for shift_bytes in (4096, 8192, 1 << 20, 2 * noise.PERIOD):
        s = shift_bytes // 2
        assert not torch.equal(vals[s : s + 50_000], vals[:50_000])


def test_window_offsets_are_distinct():
    src = noise.NoiseSource(seed=7)
    offsets = [src.offset_of(k) for k in range(200_000)]
    assert len(set(offsets)) == len(offsets)
    n = noise.PERIOD
    assert all(n % p for p in range(2, int(n**0.5) + 1))  # PERIOD is prime
