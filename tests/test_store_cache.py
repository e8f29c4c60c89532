"""Store, slots, cache budget and the reader, on real files with O_DIRECT."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import warnings

import pytest
import torch
from safetensors.torch import save_file

import moestream
from moestream.cache.expert_cache import ExpertCache
from moestream.errors import CacheBudgetError, ExpertReadError
from moestream.io import memory
from moestream.io.reader import Reader
from moestream.runtime.weights import SlotTensors
from moestream.store.checkpoint import open_checkpoint
from moestream.store.experts import build_expert_map


def _odd_checkpoint(tmp_path):
    """Two experts whose tensors have lengths that are not multiples of 4096 and sit back to back."""
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for e in range(2):
        pre = f"model.layers.0.mlp.experts.{e}."
        tensors[pre + "gate_proj.weight"] = torch.randn(37, 53, generator=g)  # 7844 bytes
        tensors[pre + "up_proj.weight"] = torch.randn(37, 53, generator=g)
        tensors[pre + "down_proj.weight"] = torch.randn(53, 37, generator=g)
    save_file(tensors, tmp_path / "model.safetensors")
    return tensors


def _cache(tmp_path, budget_slots=2, io_mode="direct", threads=4):
    ckpt = open_checkpoint(tmp_path)
    emap = build_expert_map(ckpt.tensors, "swiglu", [0], 2)
    reader = Reader(io_mode, threads)
    slot = sum(
        ((p.nbytes + 4095) // 4096 * 4096 + 4096) for parts in emap.units[(0, 0)].values() for p in parts
    )
    cache = ExpertCache(emap, budget_slots * slot, reader, top_k=1, piece_bytes=4096, lock_memory=False)
    return cache, reader


def _read_layer(cache, experts):
    job = cache.open_layer(0, experts)
    views, got = SlotTensors(), {}
    pending = {(e, k) for e in experts for k in cache.emap.kinds}
    while pending:
        e, kind, err = job.next_event()
        assert err is None
        pending.discard((e, kind))
        ((buf, off, part),) = job.tensor_parts(e, kind)
        got[(e, kind)] = (
            views.bytes_of(buf)[off : off + part.ref.nbytes].view(torch.float32).view(part.ref.shape).clone()
        )
    for e in experts:
        job.release(e)
    return got


def test_unaligned_neighbours_read_with_o_direct_stay_intact(tmp_path):
    tensors = _odd_checkpoint(tmp_path)
    cache, reader = _cache(tmp_path, budget_slots=2, io_mode="direct")
    assert reader.fallback_reason is None
    got = _read_layer(cache, [0, 1])  # both experts in neighbouring slots, six unaligned tensors
    names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    for (e, kind), value in got.items():
        assert torch.equal(value, tensors[f"model.layers.0.mlp.experts.{e}.{names[kind]}.weight"]), (e, kind)
    reader.close()


def test_budget_below_one_layer_is_refused_with_the_minimum(tiny_dir):
    with pytest.raises(CacheBudgetError, match=r"at least 72\.0 KiB"):
        moestream.load(str(tiny_dir("qwen3_moe")), cache="71KiB")


def test_budget_below_working_set_warns_with_both_numbers(tiny_dir):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moestream.load(str(tiny_dir("qwen3_moe")), cache="100KiB").close()
    text = " ".join(str(w.message) for w in caught)
    assert "100.0 KiB" in text and "144.0 KiB" in text


def test_mlock_refusal_warns_and_runs_unlocked(tiny_dir, monkeypatch):
    def refuse(address, size):
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(memory._libc, "mlock", refuse)
    with pytest.warns(RuntimeWarning, match="could not lock"):
        engine = moestream.load(str(tiny_dir("qwen3_moe")), cache="1MiB")
    assert not engine.cache.locked
    assert len(engine.generate([5, 6, 7], max_tokens=4, ignore_eos=True).tokens) == 4
    engine.close()


def test_locked_by_default_where_allowed(tiny_dir):
    engine = moestream.load(str(tiny_dir("qwen3_moe")), cache="1MiB")
    assert engine.cache.locked == (os.geteuid() == 0 or engine.cache.locked)
    engine.close()


def test_pinned_experts_are_never_evicted(tmp_path):
    _odd_checkpoint(tmp_path)
    cache, reader = _cache(tmp_path, budget_slots=1, io_mode="pagecache")
    job = cache.open_layer(0, [0, 1])  # one slot, two experts: expert 1 must wait for expert 0's release
    seen = []
    while len(seen) < 3:
        seen.append(job.next_event())
    assert {e for e, _, _ in seen} == {0}
    assert job.events.empty() and job.pending == [1]
    job.release(0)
    while len(seen) < 6:
        seen.append(job.next_event())
    assert [e for e, _, _ in seen[3:]] == [1, 1, 1]
    job.release(1)
    reader.close()


def test_gate_is_read_before_up_before_down(tmp_path):
    _odd_checkpoint(tmp_path)
    order = []
    gate = threading.Event()

    class Recording(Reader):
        def _read(self, request, start):
            gate.wait()
            order.append(request.priority[1])  # kind rank
            return super()._read(request, start)

    ckpt = open_checkpoint(tmp_path)
    emap = build_expert_map(ckpt.tensors, "swiglu", [0], 2)
    reader = Recording("direct", 1)
    cache = ExpertCache(emap, 1 << 20, reader, top_k=1, piece_bytes=4096, lock_memory=False)
    job = cache.open_layer(0, [1, 0])
    gate.set()
    for _ in range(6):
        job.next_event()
    # the single I/O thread may grab one piece before the rest are queued; after that, strict kind order
    assert order[1:] == sorted(order[1:])
    reader.close()


def test_failed_read_names_file_and_offset_and_engine_stays_usable(tiny_dir, monkeypatch):
    engine = moestream.load(str(tiny_dir("qwen3_moe")), cache="1MiB", preload=False)
    real = Reader._read
    fail = {"on": True}

    def flaky(self, request, start):
        if fail["on"]:
            raise OSError(errno.EIO, "Input/output error")
        return real(self, request, start)

    monkeypatch.setattr(Reader, "_read", flaky)
    with pytest.raises(ExpertReadError, match=r"model\.safetensors at offset \d+ failed: Input/output error"):
        engine.generate([5, 6, 7], max_tokens=3)
    assert engine.cache.resident_keys() == set()  # nothing half-read is kept as a hit
    fail["on"] = False
    assert len(engine.generate([5, 6, 7], max_tokens=3, ignore_eos=True).tokens) == 3
    engine.close()


def test_a_hit_still_being_prefetched_gives_each_kind_once(tmp_path):
    """A layer that asks for an expert whose prefetch is still being read (a hit, every kind pending) hears
    each kind exactly once as it lands: `HeldExperts` (a GPU tier's copies) counts its events, and an
    event twice once ended its copies before the last kind landed."""
    import queue

    _odd_checkpoint(tmp_path)
    gate = threading.Event()

    class Held(Reader):
        def _read(self, request, start):
            gate.wait()
            return super()._read(request, start)

    ckpt = open_checkpoint(tmp_path)
    emap = build_expert_map(ckpt.tensors, "swiglu", [0], 2)
    reader = Held("direct", 2)
    cache = ExpertCache(emap, 1 << 20, reader, top_k=1, piece_bytes=4096, lock_memory=False)
    try:
        assert cache.prefetch(0, [1]) == 1
        job = cache.open_layer(0, [1])
        assert job.hits == [1] and not job.misses
        gate.set()
        events = [job.next_event()[:2] for _ in emap.kinds]
        assert sorted(events) == sorted((1, kind) for kind in emap.kinds)
        with pytest.raises(queue.Empty):  # nothing more comes: no kind twice
            job.events.get(timeout=0.5)
        job.release(1)
        assert cache.stats.prefetch_used == 1
    finally:
        reader.close()
