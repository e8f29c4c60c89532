"""Experts whose size is not a multiple of 4 KiB: each kind moved to its region's start once read.

An expert's bytes are read with O_DIRECT as the 4096-aligned superset of its file range, so where they
start inside the slot depends on the file offset: in a GGUF whose expert tensors are, say, 17 KiB
apart, every expert of a layer starts elsewhere, and no single ggml_mul_mat_id over the cache's slots
could address them. The cache moves each kind to the start of its region once it is read, so the ggml
graphs compute such layers from the slots too (one graph a step when every expert is cached).

Oracles: the checkpoint file itself (the bytes at every address the cache gives equal the file's
bytes of that expert), and the same model read on first use at the smallest budget (bit for bit).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_ggml_runner import FORCED, _count_runs, _runner_logits

import moestream
from moestream.cache.size_classes import budget_requirements
from moestream.io.reader import IO_MODES

TYPES = {"gate": Q.Q8_0, "up": Q.Q4_0, "down": Q.Q8_0}


@pytest.fixture(scope="module")
def odd_gguf(tiny_gguf):
    _, path = tiny_gguf("qwen3_moe", ftype=Q.Q8_0, expert_type=lambda layer, kind: TYPES[kind])
    return path


def _file_bytes(ref) -> bytes:
    with open(ref.file, "rb") as f:
        f.seek(ref.offset)
        return f.read(ref.nbytes)


def test_odd_sized_experts_get_one_layout_and_the_file_bytes(odd_gguf):
    with moestream.load(str(odd_gguf), cache="64MiB", trunk="ggml", io_mode="direct") as engine:
        cache, emap = engine.cache, engine.emap
        sizes = {ref.nbytes for parts in emap.units.values() for refs in parts.values() for ref in refs}
        assert all(n % 4096 for n in sizes)  # the case this is about: no size a multiple of 4 KiB
        heads = {ref.offset % 4096 for parts in emap.units.values() for ref in parts["gate"]}
        assert len(heads) > 1  # read as they lie, the experts' bytes start at different offsets
        for layer in emap.layers:
            base, slot_bytes, _, offsets = cache.slot_arena(layer)
            for e in range(emap.num_experts):
                state = cache.state_of((layer, e))
                for kind, refs in emap.units[(layer, e)].items():
                    address = base + state.slot * slot_bytes + offsets[kind]
                    ((buffer, offset, _),) = cache.tensor_parts((layer, e), kind)
                    assert buffer.address + offset == address
                    got = bytes(buffer.view[offset : offset + refs[0].nbytes])
                    assert got == _file_bytes(refs[0]), (layer, e, kind)


def test_odd_sized_experts_run_as_one_graph_with_the_streamed_bits(odd_gguf, monkeypatch):
    runs = _count_runs(monkeypatch)
    with moestream.load(str(odd_gguf), cache="64MiB", trunk="ggml") as engine:
        assert "every expert cached, read at load" in engine.mode_line()
        runs[0] = 0
        whole = _runner_logits(engine)
        assert runs[0] == 1 + len(FORCED)  # the prefill and each token: one graph each
        minimum, _ = budget_requirements(engine.emap, engine.top_k)
        for io_mode in IO_MODES:
            engine.restream(cache=minimum, io_mode=io_mode, preload=False)  # streamed, moved as read
            assert torch.equal(_runner_logits(engine), whole), io_mode
            assert engine.cache.stats.misses > len(engine.emap.units)
        engine.restream(cache="64MiB", io_mode="direct", preload=False)  # cached after the first
        _runner_logits(engine)
        misses, calls = engine.cache.stats.misses, engine.runtime.layer_calls
        assert torch.equal(_runner_logits(engine), whole)  # all hits: each layer's experts in the next graph
        assert engine.cache.stats.misses == misses and engine.runtime.layer_calls > calls
