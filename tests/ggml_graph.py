"""Run one ggml graph built by a test, once: the pieces of the layer graphs checked alone."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moestream import ggml
from moestream.ggml.net import Arena, Net


def run_once(build: Callable[[Net], int], out: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """`build(net)` -> the node whose result lands in `out` (contiguous), computed on `threads`."""
    kern = ggml.kernels(threads)
    net = Net(ggml.library())
    try:
        net.finish([net.fix(build(net), out.data_ptr())], threads, kern.pool)
        arena = Arena([net])  # the graph's scratch, alive while it runs
        with kern._lock:
            net.run()
        del arena
    finally:
        net.close()
    return out
