"""Logits processors of the engine against stock transformers' `generate` with the same settings
(repetition penalty, logit bias as a sequence bias, min-p) and against an independent implementation of
OpenAI's presence and frequency penalties; the model's generation_config.json sampling defaults."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers as T

import moestream
from moestream.engine.sampling import Sampler, SamplingParams, model_sampling_defaults

PROMPT = [5, 17, 33, 2, 41, 9]


@pytest.fixture(scope="module")
def pair(tiny_dir):
    path = tiny_dir("qwen3_moe")
    ref = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with moestream.load(str(path), cache="1MiB") as engine:
        yield engine, ref


def _stock(ref, n: int, **kwargs) -> list[int]:
    out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)
    return out[0, len(PROMPT) :].tolist()


def test_repetition_penalty_and_logit_bias_equal_stock_generate(pair):
    engine, ref = pair
    got = engine.generate(PROMPT, max_tokens=16, ignore_eos=True, repetition_penalty=1.8).tokens
    assert got == _stock(ref, 16, repetition_penalty=1.8)
    assert (
        got != engine.generate(PROMPT, max_tokens=16, ignore_eos=True).tokens
    )  # the penalty changed something
    bias = {7: 4.0, 40: -100.0, 41: 2.5}
    got = engine.generate(PROMPT, max_tokens=16, ignore_eos=True, logit_bias=bias).tokens
    assert got == _stock(ref, 16, sequence_bias={(t,): b for t, b in bias.items()})
    assert (
        40 not in got
        and engine.generate(PROMPT, max_tokens=8, ignore_eos=True, logit_bias={9: 100}).tokens == [9] * 8
    )


def test_presence_and_frequency_penalties_follow_openai(pair):
    engine, ref = pair
    presence, frequency = 0.7, 1.1
    # the oracle: stock logits, OpenAI's formula over the generated tokens only, argmax
    ids, out = list(PROMPT), []
    with torch.inference_mode():
        for _ in range(16):
            logits = ref(torch.tensor([ids])).logits[0, -1].double()
            for t in set(out):
                logits[t] -= frequency * out.count(t) + presence
            out.append(int(torch.argmax(logits)))
            ids.append(out[-1])
    got = engine.generate(
        PROMPT, max_tokens=16, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency
    ).tokens
    assert got == out


def test_min_p_and_seeded_warpers(pair):
    engine, _ = pair
    greedy = engine.generate(PROMPT, max_tokens=12, ignore_eos=True).tokens
    # min_p 1 keeps only the most likely token: sampling degenerates to greedy
    assert (
        engine.generate(PROMPT, max_tokens=12, ignore_eos=True, temperature=1.5, min_p=1.0, seed=3).tokens
        == greedy
    )
    a = engine.generate(PROMPT, max_tokens=12, ignore_eos=True, temperature=1.5, min_p=0.05, seed=3).tokens
    assert (
        a
        == engine.generate(PROMPT, max_tokens=12, ignore_eos=True, temperature=1.5, min_p=0.05, seed=3).tokens
    )
    assert a != greedy
    for bad in ({"min_p": 1.5}, {"repetition_penalty": 0}, {"presence_penalty": 3}, {"logit_bias": {5: 101}}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_generation_config_defaults(tiny_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(tiny_dir("qwen3_moe"), path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(
        json.dumps({**config, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "do_sample": True})
    )
    assert model_sampling_defaults(path) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    (path / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.warns(UserWarning, match="ignoring the sampling defaults"):
        assert model_sampling_defaults(path) == {}
    (path / "generation_config.json").unlink()
    assert model_sampling_defaults(path) == {}


def test_an_unseeded_request_leaves_the_callers_random_state_alone():
    """Before: an unseeded sampler seeded itself from torch.seed(), which reseeds torch's global generators
    (the caller's random numbers changed with every request) and cost 0.6 ms a request."""
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    samplers = [Sampler(SamplingParams(temperature=1.0)) for _ in range(3)]
    assert torch.equal(torch.rand(4), want)
    assert len({s.generator.initial_seed() for s in samplers}) == 3  # each its own non-deterministic seed
    seeded = [Sampler(SamplingParams(temperature=1.0, seed=7)) for _ in range(2)]
    assert {s.generator.initial_seed() for s in seeded} == {7}
