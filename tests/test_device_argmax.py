"""The greedy token computed in the step's graph on a backend (`LayerGraphs.greedy`), checked on ggml's
CPU backend (MOESTREAM_GGML_BACKEND=cpu, the device path CUDA runs): a greedy step copies back the token
alone and leaves the logits on the device until asked (`DeviceLogits`); the tokens are numpy's argmax of
the logits a step copies back otherwise, and the logits fetched on demand are those bits; where ggml's
argmax may not be numpy's (tied maxima, a NaN), the check sends the step back to numpy.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import moestream
from moestream import ggml
from moestream.engine import ggml_runner
from moestream.engine.logits import DeviceLogits
from moestream.engine.sampling import Sampler, SamplingParams
from moestream.ggml.backend import DeviceMemory, cpu_backend
from moestream.ggml.net import F32, Arena, Net
from moestream.graphs import layers
from moestream.graphs.layers import LayerGraphs, StepBuffers, argmax_chunk

PROMPT = [5, 17, 33, 2, 99, 41, 7, 250, 3, 12, 80, 64]
STEPS = 40  # decoded tokens: five attention spans of 8 positions


def _small_steps(monkeypatch) -> None:
    """Prefill chunks of 5 tokens and spans of 8 positions: the prompt crosses chunks, the decoding
    crosses spans (graph sets built and dropped)."""
    monkeypatch.setattr(ggml_runner, "DEVICE_CHUNK", 5)
    monkeypatch.setattr(ggml_runner, "SPAN_STEP", 8)
    monkeypatch.setattr(layers, "SPAN_STEP", 8)


def _decode(engine, greedy: bool) -> tuple[list[int], list[torch.Tensor]]:
    """The prompt, then STEPS greedy tokens fed one a step: (tokens, each step's logits [V] as the step
    returns them, or as fetched from the device)."""
    runner, tokens, seen = engine.runner, [], []
    logits, kv = runner(PROMPT, None, greedy)
    for _ in range(STEPS):
        if greedy:
            assert isinstance(logits, DeviceLogits)  # the graph's argmax, no tie or NaN to send back
            token = logits.token
            logits = logits.tensor()
        else:
            assert isinstance(logits, torch.Tensor)
            token = int(logits.numpy().argmax())
        tokens.append(token)
        seen.append(logits)
        logits, kv = runner([token], kv, greedy)
    return tokens, seen


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_the_graphs_argmax_gives_numpys_tokens_and_the_logits_on_demand(arch, tiny_dir, monkeypatch):
    """Over STEPS decoded tokens on the backend: the token the graph's argmax gives is numpy's argmax of
    the logits a step copies back unasked, the logits fetched on demand are those bits, and a request
    generates the CPU path's greedy tokens."""
    _small_steps(monkeypatch)
    path = tiny_dir(arch)
    want = moestream.load(str(path), cache="64MiB", trunk="ggml")
    with want:
        cpu = want.generate(PROMPT, max_tokens=STEPS, ignore_eos=True).tokens
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        assert "on ggml's cpu backend" in engine.mode_line()
        tokens, logits = _decode(engine, greedy=False)
        got, fetched = _decode(engine, greedy=True)
        assert got == tokens
        assert all(torch.equal(a, b) for a, b in zip(fetched, logits))
        assert engine.generate(PROMPT, max_tokens=STEPS, ignore_eos=True).tokens == cpu == tokens


def test_a_greedy_step_copies_back_its_token_alone(tiny_dir, monkeypatch):
    """A decoded token's step copies 12 bytes a chunk of its logits back (each chunk's argmax, maximum
    and check) when the caller takes the argmax alone, the logits alone (4 V) otherwise; the host's
    logits buffer is not written until they are asked for, and once a later step has run, asking
    raises (the engine runs on). A plainly greedy request's steps are asked so by the engine."""
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="64MiB", trunk="ggml") as engine:
        runner = engine.runner
        memory = runner.memory
        copied: list[int] = []
        download = memory.download
        monkeypatch.setattr(memory, "download", lambda r, o, n: copied.append(n) or download(r, o, n))
        _, kv = runner(PROMPT, None)
        _, kv = runner([7], kv)  # the decode set built
        (host,) = [gs.buf.logits for (t, *_), gs in runner._sets.items() if t == 1]
        vocab = runner.spec.vocab
        chunks = vocab // argmax_chunk(vocab)
        assert chunks > 1  # the tiny model's vocabulary is in chunks, as a real one's
        per_step = {}
        for greedy in (False, True, False, True):
            with torch.inference_mode():
                host.fill_(float("nan"))  # the host's copy: a sentinel the step may overwrite
            copied.clear()
            out, kv = runner([7], kv, greedy)
            per_step[greedy] = sum(copied)
            assert torch.isnan(host).all() == greedy  # a greedy step does not copy the logits back
            if greedy:
                logits = out.tensor()
                assert not torch.isnan(logits).any() and out.token == int(logits.numpy().argmax())
                assert sum(copied) == 12 * chunks + 4 * vocab  # fetched on demand: the logits now
            else:
                assert not torch.isnan(out).any()
        assert per_step == {False: 4 * vocab, True: 12 * chunks}
        left, kv = runner([7], kv, True)
        runner([8], kv)
        with pytest.raises(RuntimeError, match="overwritten by the next step"):
            left.tensor()
        # a request that samples plainly greedy never copies the logits back; one that samples does
        for sampling, logits_copied in (({}, False), ({"temperature": 0.7, "seed": 1}, True)):
            copied.clear()
            assert len(engine.generate(PROMPT, max_tokens=6, ignore_eos=True, **sampling).tokens) == 6
            assert (4 * vocab in copied) == logits_copied, sampling


def test_a_step_whose_argmax_may_not_be_numpys_returns_its_logits(tiny_dir, monkeypatch):
    """Where the check fails (tied maxima, a NaN), the greedy step copies the logits back and returns
    them: the sampler's numpy argmax decides, as without the graph's argmax."""
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="64MiB", trunk="ggml") as engine:
        want, _ = engine.runner(PROMPT, None)
        monkeypatch.setattr(StepBuffers, "greedy_token", lambda self: None)
        got, _ = engine.runner(PROMPT, None, True)
        assert isinstance(got, torch.Tensor) and torch.equal(got, want)


def _greedy_graph(values: torch.Tensor) -> tuple[list[int], int | None]:
    """`LayerGraphs.greedy` over logits `values` [V] on ggml's CPU backend (the logits a fixed result, as
    the LM head's): (ggml's argmax of each chunk, the token the step gives or None)."""
    V = values.numel()
    buf = StepBuffers.__new__(StepBuffers)
    buf.logits = torch.zeros(V)
    buf.argmax = torch.full((3, V // argmax_chunk(V)), -7, dtype=torch.int32)
    x = values.clone()
    build = LayerGraphs.__new__(LayerGraphs)
    build.spec, build.buf = SimpleNamespace(vocab=V), buf
    backend = cpu_backend(1)
    memory = DeviceMemory(backend)
    kern = ggml.kernels(1)
    net = Net(ggml.library(), memory=memory)
    try:
        memory.register(x, "io", "x")
        memory.register(buf.logits, "io", "logits")
        memory.register(buf.argmax, "io", "argmax")
        logits = net.fix(net.scale(net.tensor(F32, [V, 1], x.data_ptr()), 1.0), buf.logits.data_ptr())
        net.finish([logits, *build.greedy(net, logits)], 1, kern.pool)
        arena = Arena([net], memory)
        net.run(fetch=False)
        arena.close()
        return buf.argmax[0].tolist(), buf.greedy_token()
    finally:
        net.close()
        memory.close()
        backend.close()


def _cpu_argmax(values: torch.Tensor) -> int:
    """ggml's CPU argmax as ggml-cpu/vec.h writes it (ggml_vec_argmax_f32)."""
    best, idx = float("-inf"), 0
    for i, x in enumerate(values.tolist()):
        best = best if best > x else x
        if best == x:
            idx = i
    return idx


@pytest.mark.parametrize("V", [5000, 5003])
def test_the_graphs_argmax_is_taken_only_where_it_is_numpys(V):
    """ggml's CPU argmax picks the last of tied maxima (numpy the first) and, past a NaN, a logit after
    it (numpy the NaN): the check gives the token only for a unique maximum and no NaN (an infinite one
    too, ties below it), and the sampler then takes numpy's argmax of the logits. 5000 logits go in 40
    chunks of 125, a prime 5003 in one; a tie at the top of a chunk that does not hold the maximum also
    sends the step to numpy (the check is each chunk's)."""
    C = argmax_chunk(V)
    want = (40, 125) if V == 5000 else (1, V)
    assert want == (V // C, C)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(V, generator=g)
    top = float(base.max()) + 1.0
    names = ("unique", "tied", "tied in a chunk", "tied below", "tied in another chunk", "nan", "inf")
    cases = {name: base.clone() for name in names}
    cases["unique"][1234] = top
    cases["tied"][3], cases["tied"][700] = top, top
    cases["tied in a chunk"][[3, 70]] = top
    cases["tied below"][[5, 9, 4000]] = torch.tensor([top, top - 0.5, top - 0.5])
    cases["tied in another chunk"][[5, 4000, 4010]] = torch.tensor([top, top - 0.5, top - 0.5])
    cases["nan"][10], cases["nan"][20] = top, float("nan")
    cases["inf"][4321] = float("inf")
    cases["all -inf"] = torch.full((V,), float("-inf"))
    unique = {"unique": 1234, "tied below": 5, "inf": 4321}
    if C == V:  # one chunk: its check is the whole vocabulary's
        unique["tied in another chunk"] = 5
    for name, values in cases.items():
        argmaxes, got = _greedy_graph(values)
        assert argmaxes == [_cpu_argmax(chunk) for chunk in values.split(C)], name
        assert got == unique.get(name), name
        numpys = int(values.numpy().argmax())
        sampler = Sampler(SamplingParams())
        assert sampler.plain
        assert sampler(DeviceLogits(got, values.clone) if got is not None else values) == numpys, name


def test_a_greedy_request_alone_in_a_batchs_rounds_copies_back_its_token(tiny_dir, monkeypatch):
    """With several slots (`--parallel`), a plainly greedy request decoding alone in its rounds runs the
    step it runs alone, its argmax asked (its prompt's too): the logits are not copied back, the tokens
    are the CPU path's;
    two at once copy their rows' logits back ([2, V]) and give each its tokens alone."""
    path = tiny_dir("qwen3_moe")
    prompts = [PROMPT, PROMPT[::-1]]
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as cpu:
        want = [cpu.generate(p, max_tokens=12, ignore_eos=True).tokens for p in prompts]
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    with moestream.load(str(path), cache="64MiB", trunk="ggml", parallel=2) as engine:
        assert engine.batch is not None
        memory, vocab = engine.runner.memory, engine.runner.spec.vocab
        copied: list[int] = []
        download = memory.download
        monkeypatch.setattr(memory, "download", lambda r, o, n: copied.append(n) or download(r, o, n))
        assert engine.generate(prompts[0], max_tokens=12, ignore_eos=True).tokens == want[0]
        chunks = vocab // argmax_chunk(vocab)
        # the prompt's step and 11 decoded: their argmax, no logits
        assert copied.count(12 * chunks) == 12 and 4 * vocab not in copied
        rows, steps = engine.batch.decode_rows, engine.batch.decode_steps
        copied.clear()
        both = engine.generate_batch(prompts, max_tokens=12, ignore_eos=True)
        assert [g.tokens for g in both] == want
        # rounds of two rows (as many as ran: the threads' timing decides) copy their logits back
        pairs = (engine.batch.decode_rows - rows) - (engine.batch.decode_steps - steps)
        assert copied.count(2 * 4 * vocab) == pairs
