"""A GPU tier over a host cache smaller than the experts (`--gpu-tier` with a bounded `--cache`): a device
miss that the host cache lacks is read from disk into a host slot by the cache's reader, then copied to
its device slot (upload) or computed by the CPU (host). Checked on ggml's CPU backend (the device path
CUDA runs): the logits and greedy tokens equal the in-place CPU graphs' over a cache holding every expert,
bit for bit, at several host cache and tier sizes, both io modes, both ways, on a safetensors model, two
gpt-oss ones (gate and up the halves of one kind; MXFP4 blocks rewritten by the cache as they land) and
a Q4_K_M-style GGUF (Q6_K and Q4_K downs).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gpu_tier import GREEDY, PROMPT, _run, _sizes

import moestream
from moestream.cache.size_classes import budget_requirements


def _q4_k_m(layer: int, kind: str) -> Q:
    return Q.Q6_K if kind == "down" and layer == 0 else Q.Q4_K


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    """A Q4_K_M-style GGUF: Q4_K experts but layer 0's down, Q6_K (two size classes), trunk Q8_0."""
    from tiny_gguf import perturb_vectors, write_gguf
    from tiny_models import write_tiny

    root = tmp_path_factory.mktemp("q4_k_m")
    hf = write_tiny("qwen3_moe", root / "hf", hidden_size=256, moe_intermediate_size=256)
    perturb_vectors(hf)
    return write_gguf(hf, root / "model.gguf", ftype=Q.Q8_0, expert_type=_q4_k_m)


def _model(which: str, tiny_dir, q4_k_m):
    return q4_k_m if which == "q4_k_m" else tiny_dir(which)


def _host_caches(path) -> tuple[int, int, int]:
    """(the smallest host cache, one holding about half the experts, one holding every one)."""
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        small, _ = budget_requirements(engine.emap, engine.top_k)
        every = engine.cache.allocated_bytes
    return small, (small + every) // 2, every


@pytest.mark.parametrize("misses", ["upload", "host", "split"])
@pytest.mark.parametrize("which", ["qwen3_moe", "gpt_oss", "gpt_oss_mxfp4", "q4_k_m"])
def test_a_gpu_tier_over_a_small_host_cache_gives_the_in_place_bits(
    which, misses, tiny_dir, q4_k_m, monkeypatch
):
    path = _model(which, tiny_dir, q4_k_m)
    want, want_tokens, _ = _run(path, monkeypatch, "")  # the CPU graphs, every expert cached
    least, middle, _, plans = _sizes(path, monkeypatch)
    if which == "q4_k_m":
        assert len(plans) == 2
    small, half, _ = _host_caches(path)
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", misses)
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    for cache in (small, half):
        for tier in (least, middle):
            for io_mode in ("direct", "pagecache"):
                with moestream.load(
                    str(path), cache=cache, trunk="ggml", gpu_tier=tier, io_mode=io_mode
                ) as engine:
                    from test_ggml_runner import _runner_logits

                    got = _runner_logits(engine, PROMPT)
                    gen = engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True)
                    assert torch.equal(got, want), (which, cache, tier, io_mode)
                    assert gen.tokens == want_tokens
                    assert engine.counters().bytes_read > 0  # misses came from the disk


def test_bytes_read_per_token_under_a_small_cache_and_none_once_it_holds_every_expert(tiny_dir, monkeypatch):
    """Under the smallest host cache every decoded token reads experts from disk; a cache holding every
    expert reads nothing after warm-up (at load), the tier's misses all copied from it."""
    path = tiny_dir("qwen3_moe")
    least, *_ = _sizes(path, monkeypatch)
    small, _, every = _host_caches(path)
    for misses in ("upload", "host", "split"):
        monkeypatch.setenv("MOESTREAM_TIER_MISSES", misses)
        with moestream.load(str(path), cache=small, trunk="ggml", gpu_tier=least) as engine:
            d = engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True).stats.decode
            assert d.bytes_read > 0 and d.misses > 0 and d.device_misses > 0, misses
        with moestream.load(str(path), cache=every, trunk="ggml", gpu_tier=least) as engine:
            engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True)
            gen = engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True)
            assert gen.stats.prefill.bytes_read == 0 and gen.stats.decode.bytes_read == 0
            assert gen.stats.decode.misses == 0 and gen.stats.decode.device_misses > 0, misses


@pytest.mark.parametrize("misses", ["upload", "host", "split"])
@pytest.mark.parametrize("at", [1, 30, 60])  # a prefill layer computed on the host; decoded misses
def test_a_read_failing_under_the_tier_ends_that_request_and_the_next_gives_the_same_tokens(
    at, misses, tiny_dir, monkeypatch
):
    """A read of a device miss that the host cache lacks fails (EIO): that request ends with the read's
    error, no host slot stays pinned, no device slot keeps bytes it never got, and the next request gives
    the in-place tokens."""
    import errno

    from test_faults_schedule import Fault, assert_nothing_held

    from moestream.errors import MoestreamError

    path = tiny_dir("qwen3_moe")
    _, want_tokens, _ = _run(path, monkeypatch, "")
    least, *_ = _sizes(path, monkeypatch)
    small, *_ = _host_caches(path)
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", misses)
    with moestream.load(str(path), cache=small, trunk="ggml", gpu_tier=least) as engine:
        fault = Fault(engine.reader, "_read", at, OSError(errno.EIO, "Input/output error"))
        with pytest.raises(MoestreamError):
            engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True)
        fault.remove()
        assert fault.fired
        assert_nothing_held(engine)
        assert engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True).tokens == want_tokens


@pytest.mark.parametrize("misses", ["upload", "host", "split"])
def test_chunks_and_a_restream_to_a_smaller_host_cache(misses, tiny_dir, monkeypatch):
    """Prefill chunks (a chunk's layer beyond the smallest tier computed from the host, reading what the
    host cache lacks) and restreams between a cache holding every expert and the smallest one: the tier
    made again over the new host slots each time, the in-place bits throughout."""
    from test_ggml_runner import _runner_logits, _small_steps

    from moestream.engine import ggml_runner

    _small_steps(monkeypatch)
    monkeypatch.setattr(ggml_runner, "DEVICE_CHUNK", 5)
    path = tiny_dir("qwen3_moe")
    want, _, _ = _run(path, monkeypatch, "")
    least, *_ = _sizes(path, monkeypatch)
    small, _, every = _host_caches(path)
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", misses)
    with moestream.load(str(path), cache=every, trunk="ggml", gpu_tier=least) as engine:
        assert torch.equal(_runner_logits(engine, PROMPT), want)
        engine.restream(cache=small, io_mode="pagecache")
        assert torch.equal(_runner_logits(engine, PROMPT), want)
        assert engine.counters().bytes_read > 0  # this streaming's own reads: from disk, not the old slots
        engine.restream(cache=every, preload=True)
        assert torch.equal(_runner_logits(engine, PROMPT), want)
