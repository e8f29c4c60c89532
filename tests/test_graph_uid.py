"""A device's whole-step graph carries a uid (`Net._renew_uid`), fresh at each placement, so that ggml's
CUDA backend compares its nodes once after they were placed and replays its CUDA graph unchecked after
(as llama.cpp's scheduler gives a reused graph); checked on ggml's CPU backend, the same path
(MOESTREAM_GGML_BACKEND=cpu), where ggml reads no uid. A library whose graph is laid out otherwise gets
none."""

from __future__ import annotations

import ctypes as C

import moestream
from moestream import ggml
from moestream.ggml.lib import GgmlGraph
from moestream.ggml.net import _FIRST_UID, F32, Net

PROMPT = [5, 17, 33, 2, 99, 41, 7, 250, 3, 12, 80, 64]


def _uid(net: Net) -> int:
    return GgmlGraph.from_address(net.gf).uid


def test_a_devices_step_graph_gets_a_fresh_uid_at_each_placement(tiny_dir, monkeypatch):
    """The decode set's whole graph has one of moestream's uids once placed, the same over steps, a new
    one when its set places its graphs again; a host (CPU path) graph has none; tokens are unchanged."""
    path = tiny_dir("qwen3_moe")
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as cpu:
        want = cpu.generate(PROMPT, max_tokens=8, ignore_eos=True).tokens
        (host,) = [gs for (t, *_), gs in cpu.runner._sets.items() if t == 1]
        assert host.whole is not None and _uid(host.whole[1]) == 0
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        assert engine.generate(PROMPT, max_tokens=8, ignore_eos=True).tokens == want
        (gs,) = [gs for (t, *_), gs in engine.runner._sets.items() if t == 1]
        net = gs.whole[1]
        first = _uid(net)
        assert first >= _FIRST_UID
        assert engine.generate(PROMPT, max_tokens=8, ignore_eos=True).tokens == want
        assert _uid(net) == first  # the same graph, placed once: replayed unchecked
        gs._place()  # placed again (as when the set builds another graph): its nodes may have moved
        assert _uid(net) > first
        assert engine.generate(PROMPT, max_tokens=8, ignore_eos=True).tokens == want


def test_a_graph_laid_out_otherwise_gets_no_uid():
    """Where the node array does not follow `GgmlGraph` (another ggml's struct), nothing is written."""
    lib = ggml.library()
    net = Net(lib, nodes=64)
    try:
        y = net.scale(net.scale(net.tensor(F32, [4, 1], 0x1000), 2.0), 3.0)
        net.gf = lib.base.ggml_new_graph_custom(net.ctx, 64, False)
        lib.base.ggml_build_forward_expand(net.gf, y)
        g = GgmlGraph.from_address(net.gf)
        net._renew_uid()
        assert g.uid >= _FIRST_UID
        g.uid, nodes = 0, g.nodes
        g.nodes = nodes + C.sizeof(C.c_void_p)  # as if the struct were a word longer
        net._renew_uid()
        assert g.uid == 0
        g.nodes = nodes
        net.nodes = 128  # a capacity other than the graph's
        net._renew_uid()
        assert g.uid == 0
    finally:
        net.close()
