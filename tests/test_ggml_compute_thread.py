"""An OpenMP build of ggml (llama.cpp's default) computes every graph on one thread, whichever thread asks
(`ggml.graphs.ComputeThread`): each thread that opens an OpenMP parallel region gets a team of its own,
and a second team halved the first's speed on the GPU machine's 16 cores. The wheel's and `make
native`'s builds use ggml's own pool; the test marks the loaded library as OpenMP to take that path."""

from __future__ import annotations

import dataclasses
import threading

import pytest

import moestream
from moestream.ggml import graphs
from moestream.ggml import lib as ggml_lib
from moestream.power.testing import write_fake_elf

PROMPT = [5, 17, 33, 2, 99, 41, 7, 250, 3, 12, 80, 64]


def test_an_openmp_builds_graphs_are_computed_by_one_thread(tiny_dir, monkeypatch):
    path = tiny_dir("qwen3_moe")
    with moestream.load(str(path), trunk="ggml") as engine:  # the build's own way: the reference
        want = engine.generate(PROMPT, max_tokens=6, ignore_eos=True).tokens
    monkeypatch.setattr(ggml_lib, "_LIB", dataclasses.replace(ggml_lib.library(), openmp=True))
    monkeypatch.setattr(graphs, "_KERNELS", None)  # a pool over the library marked so
    seen = set()
    run = graphs.ComputeThread.run

    def spied(self, fn):
        def compute():
            seen.add(threading.current_thread().name)
            return fn()

        return run(self, compute)

    monkeypatch.setattr(graphs.ComputeThread, "run", spied)
    try:
        with moestream.load(str(path), trunk="ggml") as engine:
            here = engine.generate(PROMPT, max_tokens=6, ignore_eos=True).tokens
            there = []
            t = threading.Thread(
                target=lambda: there.append(engine.generate(PROMPT, max_tokens=6, ignore_eos=True))
            )
            t.start()
            t.join()
    finally:
        if graphs._KERNELS is not None:
            graphs._KERNELS.close()
    assert here == want and there[0].tokens == want
    assert seen == {"moestream-ggml"}


def test_the_compute_thread_hands_back_an_error_and_keeps_serving():
    worker = graphs.ComputeThread()

    def fails():
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        worker.run(fails)
    assert worker.run(lambda: 7) == 7
    assert worker.run(lambda: worker.run(lambda: 3)) == 3  # from the thread itself: at once


def test_openmp_is_read_from_the_cpu_librarys_own_needed_list(tmp_path):
    """A native libggml-cpu beside llama.cpp's libggml-base (which links libgomp itself) is not an
    OpenMP build: the check reads libggml-cpu's DT_NEEDED, not what a handle's lookup reaches."""
    names = ["libggml-base.so.0", "libgomp.so.1", "libm.so.6", "libc.so.6"]
    write_fake_elf(tmp_path / "omp.so", [], needed=names)
    write_fake_elf(tmp_path / "pool.so", ["ggml_graph_compute"], needed=["libggml-base.so.0", "libc.so.6"])
    write_fake_elf(tmp_path / "none.so", ["ggml_graph_compute"])
    (tmp_path / "text").write_text("not an ELF file")
    assert ggml_lib.elf_needed(tmp_path / "omp.so") == names
    assert ggml_lib.elf_needed(tmp_path / "pool.so") == ["libggml-base.so.0", "libc.so.6"]
    assert ggml_lib.elf_needed(tmp_path / "none.so") == []
    assert ggml_lib.elf_needed(tmp_path / "text") == []
    # the library loaded here: its CPU library names the base it binds to, and the flag agrees with it
    lib = ggml_lib.library()
    needed = ggml_lib.elf_needed(lib.folder / "libggml-cpu.so")
    assert "libggml-base.so.0" in needed and "libc.so.6" in needed
    assert lib.openmp == any(n.startswith("libgomp") for n in needed)
