"""--prefetch: the next layer's stale-gate experts are read ahead; outputs stay exact."""

from __future__ import annotations

import pytest
import torch
import transformers as T

import moestream
from moestream.cli import main

PROMPT = [5, 17, 33, 2, 99, 41, 7, 250]


@pytest.fixture
def every_guess(monkeypatch):
    """Read every stale-gate guess ahead: the tiny checkpoints' routers are transformers' random init,
    whose guesses are right about 40% of the time, so the measured-precision rule would read none."""
    import moestream.runtime.prefetch as gate

    monkeypatch.setattr(gate, "PRECISION_MIN", 0.0)


@pytest.mark.parametrize(
    "arch,policy",
    [
        ("qwen3_moe", "lru"),
        ("mixtral", "lru"),
        ("gpt_oss", "lru"),
        ("qwen3_5_moe", "lru"),
        ("qwen3_moe", "lfu"),
        ("gpt_oss", "lfu"),
        ("qwen3_moe", "predictive"),
        ("gpt_oss", "predictive"),
    ],
)
def test_prefetch_keeps_output_identical_to_stock(arch, policy, tiny_dir, every_guess):
    """(With LFU, a layer once found every victim held by in-flight prefetches and gave up: "waits for an
    expert slot that nothing will release"; budgets of 6 and 10 slots hit it.)"""
    path = tiny_dir(arch, experts=16, top_k=4)
    ref = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = ref.generate(torch.tensor([PROMPT]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    expected = expected[0, len(PROMPT) :].tolist()
    with moestream.load(str(path), cache="64MiB", prefetch=True) as engine:
        slot = engine.cache.slot_bytes
        for budget in (6 * slot, 10 * slot, 12 * slot, 32 * slot):
            engine.restream(cache=budget, prefetch=True, policy=policy, preload=False)
            gen = engine.generate(PROMPT, max_tokens=24, ignore_eos=True)
            assert gen.tokens == expected, (arch, budget)
            stats = engine.cache.stats
            assert stats.prefetches > 0 and 0 < stats.prefetch_used <= stats.prefetches


def test_prefetch_turns_demand_misses_into_hits_when_predictions_are_good(tmp_path):
    """On a synthetic checkpoint with realistic routing (where the stale gate is nearly always right: an
    upper bound, see docs/traces.md), read-ahead experts are the ones the next layer asks for: the demand
    path misses less and waits less, the bytes read and the output stay the same."""
    from moestream.synth import synthesize

    path = synthesize(
        tmp_path / "s",
        arch="qwen3_moe",
        layers=4,
        experts=16,
        top_k=4,
        hidden=256,
        moe_intermediate=128,
        dtype="fp32",
    )
    with moestream.load(str(path), cache="64MiB") as probe:
        budget = 12 * probe.cache.slot_bytes  # three layers' worth of top-4
    runs = {}
    for prefetch in (False, True):
        with moestream.load(str(path), cache=budget, prefetch=prefetch) as engine:
            runs[prefetch] = engine.generate(
                "The quick brown fox jumps over the lazy dog", max_tokens=24, ignore_eos=True
            )
    plain, ahead = runs[False].stats.decode, runs[True].stats.decode
    assert runs[True].tokens == runs[False].tokens
    assert ahead.prefetch_used >= 0.9 * ahead.prefetches > 0
    assert ahead.misses + ahead.prefetch_used == plain.misses  # every used prefetch was a miss before
    assert ahead.bytes_read == plain.bytes_read


def test_prefetch_flag_in_cli(tiny_dir, capsys, every_guess):
    path = tiny_dir("qwen3_moe")
    capsys.readouterr()  # the checkpoint writer's progress bar, when this test makes it
    assert (
        main(
            [
                "generate",
                str(path),
                "--prompt",
                "Hello",
                "--max-tokens",
                "6",
                "--ignore-eos",
                "--cache",
                "200KiB",
                "--prefetch",
            ]
        )
        == 0
    )
    err = [x for x in capsys.readouterr().err.splitlines() if not x.startswith("moestream: warning:")]
    assert "next-layer prefetch" in err[0] and "prefetched" in err[-1]  # mode line, stats line
