"""Read/compute overlap under hostile timing: pieces complete in random order after random delays."""

from __future__ import annotations

import random
import time
from typing import ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import moestream
from moestream.io.reader import Reader


class JitteryReader(Reader):
    """A real reader whose pieces land after random delays, hence in random order across 8 threads."""

    def __init__(self, *args, seed: int = 0, **kwargs):
        self._rng = random.Random(seed)
        super().__init__(*args, **kwargs)

    def _read(self, request, start):
        time.sleep(self._rng.random() * 0.0005)
        return super()._read(request, start)


def _resident_experts(sd, layer, hidden, index, weights):
    """Independent computation from the full weights: ascending expert order, same ops."""
    out = torch.zeros_like(hidden)
    for e in sorted(set(index.flatten().tolist())):
        tokens, positions = torch.where(index == e)
        pre = f"model.layers.{layer}.mlp.experts.{e}."
        x = hidden[tokens]
        h = F.silu(F.linear(x, sd[pre + "gate_proj.weight"])) * F.linear(x, sd[pre + "up_proj.weight"])
        y = F.linear(h, sd[pre + "down_proj.weight"]) * weights[tokens, positions, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def test_thousand_forwards_identical_under_random_completion(tiny_dir):
    path = tiny_dir("qwen3_moe", experts=16, top_k=4)
    engine = moestream.load(
        str(path),
        cache=5 * 36 * 1024,
        io_mode="direct",  # 5 slots: constant eviction
        make_reader=lambda mode, threads: JitteryReader(mode, 8),
        trunk="eager",  # the runtime's torch formats, which the resident reference computes with
    )
    gen = torch.Generator().manual_seed(0)
    misses_before = engine.cache.stats.misses
    sd = load_file(path / "model.safetensors")
    try:
        for i in range(1000):
            layer = i % 2
            tokens = 1 + (i % 7)
            hidden = torch.randn(tokens, 64, generator=gen)
            index = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(tokens)])
            weights = torch.rand(tokens, 4, generator=gen)
            got = engine.runtime.forward(layer, hidden, index, weights)
            assert torch.equal(got, _resident_experts(sd, layer, hidden, index, weights)), i
    finally:
        engine.close()
    assert engine.cache.stats.misses - misses_before > 1000  # the cache really was streaming


def test_stalled_experts_retry_until_done(tiny_dir):
    """A tier that holds at most 2 experts at a time (like a tiny GPU tier) must make the runtime stall and
    retry experts without skipping or repeating any: same output as the resident computation."""
    from moestream.runtime.experts import ExpertRuntime
    from moestream.runtime.families import SwiGLU
    from moestream.runtime.tiers import HostTier

    class TwoSlots(HostTier):
        held: ClassVar[set] = set()

        def prepare(self, job, expert, kinds):
            if kinds == ("gate",) and (job.layer, expert) not in self.held:
                if len(self.held) >= 2:
                    return False
                self.held.add((job.layer, expert))
            return True

        def release(self, layer, expert, job, failed):
            self.held.discard((layer, expert))

    path = tiny_dir("qwen3_moe", experts=16, top_k=4)
    engine = moestream.load(
        str(path),
        cache=8 * 36 * 1024,
        io_mode="direct",
        make_reader=lambda mode, threads: JitteryReader(mode, 8, seed=5),
    )
    tier = TwoSlots(engine.cache)
    runtime = ExpertRuntime(engine.cache, tier, SwiGLU(torch.nn.functional.silu))
    sd = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    try:
        for i in range(200):
            tokens = 1 + (i % 5)
            hidden = torch.randn(tokens, 64, generator=gen)
            index = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(tokens)])
            weights = torch.rand(tokens, 4, generator=gen)
            got = runtime.forward(i % 2, hidden, index, weights)
            assert torch.equal(got, _resident_experts(sd, i % 2, hidden, index, weights)), i
            assert not tier.held
    finally:
        engine.close()
