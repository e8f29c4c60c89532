"""The trunk on a ggml backend (engine/trunk_release.py), checked on ggml's CPU backend: every weight of
the graphs copied to the device at load and the trunk's host copy given back but the routers'. Graph
sets built after that (a prefill of another length, spans past 256 positions, a restream) compute the
bits of a run that kept the host copy and copied each weight when first read; no given-back page is read
on the host; a weight left out of the copies raises where a graph reads it, and so does transformers'
forward over the given-back tensors."""

from __future__ import annotations

import mmap
import struct

import pytest
import torch

import moestream
from moestream.engine import loaded as loaded_module
from moestream.engine import trunk_release
from moestream.graphs.spec import spec_tensors
from moestream.model.loader import router_modules
from moestream.runtime.experts import apply_router


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory):
    """The tiny qwen3_moe trained for 1024 positions (spans past 256), as safetensors and as a Q8_0 GGUF
    whose output layer is the embedding (tied: one block tensor read by get_rows and the LM head)."""
    from tiny_gguf import Q, write_gguf
    from tiny_models import write_tiny

    root = tmp_path_factory.mktemp("long-tiny")
    hf = write_tiny("qwen3_moe", root / "hf", max_position_embeddings=1024)
    tied = write_tiny("qwen3_moe", root / "tied", max_position_embeddings=1024, tie_word_embeddings=True)
    return {"safetensors": hf, "tied Q8_0 GGUF": write_gguf(tied, root / "tied.gguf", ftype=Q.Q8_0)}


def _load(path):
    return moestream.load(str(path), cache="64MiB", trunk="ggml", ctx_size=1024, threads=1)


def _steps(engine) -> torch.Tensor:
    """Logits of steps whose graph sets are all built after load: a prefill of 300 tokens (a span of
    512), a token decoded after it, a request of 5 tokens (a span of 256) and its next token, then after
    a restream (every set closed) the 300 tokens again."""
    run = engine.runner
    prompt = [(7 * i) % 300 + 3 for i in range(300)]
    out = []
    logits, kv = run(prompt, None)
    out.append(logits)
    out.append(run([11], kv)[0])
    logits, kv = run([5, 17, 33, 2, 9], None)
    out += [logits, run([13], kv)[0]]
    engine.restream(cache="32MiB", preload=True)
    out.append(run(prompt, None)[0])
    return torch.stack(out)


def _present_pages(ranges: list[tuple[int, int]]) -> int | None:
    """Pages wholly inside `ranges` that are mapped in (a read maps even a given-back page in again);
    None where /proc/self/pagemap cannot be read."""
    size, present = mmap.PAGESIZE, 0
    try:
        pagemap = open("/proc/self/pagemap", "rb")
    except OSError:
        return None
    with pagemap:
        for start, end in ranges:
            first, last = -(-start // size), end // size
            if last > first:
                pagemap.seek(8 * first)
                entries = struct.unpack(f"{last - first}Q", pagemap.read(8 * (last - first)))
                present += sum(entry >> 63 for entry in entries)
    return present


@pytest.mark.parametrize("model", ["safetensors", "tied Q8_0 GGUF"])
def test_steps_after_the_trunk_is_given_back_are_the_bits_of_a_kept_trunk(model, long_tiny, monkeypatch):
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    path = long_tiny[model]
    with _load(path) as engine:
        on = engine.loaded.trunk_device
        assert on is not None and on.kind == "cpu" and on.released > 0
        assert "of its host copy given back (the routers' " in engine.mode_line()
        got = _steps(engine)
        given = engine.runner.memory._released
        assert given and _present_pages(given) in (0, None)  # nothing read the host copy
    with monkeypatch.context() as kept:
        kept.setattr(loaded_module, "upload_trunk", lambda *args: None)  # each weight copied when first read
        with _load(path) as engine:
            assert engine.loaded.trunk_device is None
            want = _steps(engine)
    assert torch.isfinite(want).all()
    assert torch.equal(got, want)


def test_a_weight_left_out_of_the_copies_raises_where_a_graph_reads_it(long_tiny, monkeypatch):
    """Layer 1's output projection not copied at load, its host pages given back with the rest: the first
    graph that reads it raises (copied then, it would have been zeros)."""
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    left_out = "layers[1].attention.o.ref"
    every = spec_tensors
    monkeypatch.setattr(
        trunk_release, "spec_tensors", lambda spec: [x for x in every(spec) if x[0] != left_out]
    )
    raises = pytest.raises(RuntimeError, match="given back at load, that were not copied to the device")
    with _load(long_tiny["safetensors"]) as engine, raises:
        engine.generate([5, 17, 33, 2], max_tokens=2, ignore_eos=True)


def test_the_routers_stay_on_the_host_and_transformers_forward_raises(long_tiny, monkeypatch):
    """The routers' tensors stay on the host, locked with the cache (the stale-gate lookahead runs them);
    every other trunk tensor of the model is a `Released` stand-in: its shape and dtype read, a
    computation over it raises (over the given-back pages it would have computed with zeros)."""
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    with _load(long_tiny["safetensors"]) as engine:
        model, trunk = engine.model, engine.loaded.trunk
        routers = router_modules(model)
        weights = [m.weight for m in routers.values()]
        assert trunk.locked == engine.options.lock_memory
        assert trunk.ranges == sorted((w.data_ptr(), w.nbytes) for w in weights)
        assert engine.loaded.trunk_device.kept == sum(w.nbytes for w in weights)
        given = engine.runner.memory._released
        assert not any(
            w.data_ptr() < end and start < w.data_ptr() + w.nbytes for w in weights for start, end in given
        )
        apply_router(routers[1], torch.randn(3, model.config.hidden_size))  # the lookahead's host product
        q = model.model.layers[0].self_attn.q_proj.weight
        assert isinstance(q, trunk_release.Released) and q.dtype == torch.float32 and q.shape[1] == 64
        with pytest.raises(RuntimeError, match="host copy was given back at load"):
            model(torch.tensor([[5, 17, 33]]))
