"""The trained fixture (learned routing, `../shared/fixtures/stdlib-moe-8x64`): streamed output equals
stock transformers, the simulator reproduces the engine's misses from the engine's own trace, and
`predict-eval` finds the stale-gate recall that stock transformers' own routers give."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers as T
from shared_data import FIXTURE, needs_fixture

import moestream
from moestream.cli import main
from moestream.trace import read_trace
from moestream.trace.simulator import simulate

pytestmark = needs_fixture

PROMPTS = ["def read_config(path):\n", "class Error(Exception):\n    pass\n\n\nclass"]
NEW_TOKENS = 20
TOP_K = 8


@pytest.fixture(scope="module")
def stock():
    """The fixture in stock transformers (fp32), its tokenizer, and its greedy continuations."""
    model = T.AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    tokenizer = T.AutoTokenizer.from_pretrained(FIXTURE)
    runs = []
    for text in PROMPTS:
        ids = tokenizer(text, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        runs.append((ids[0].tolist(), out[0, ids.shape[1] :].tolist()))
    return model, runs


@pytest.fixture(scope="module")
def slot_bytes() -> int:
    with moestream.load(str(FIXTURE), cache="64MiB", dtype="float32") as probe:
        return probe.cache.slot_bytes


@pytest.mark.parametrize("policy", ["lru", "lfu", "predictive"])
def test_streamed_fixture_equals_stock_and_the_simulator_replays_its_misses(
    policy, stock, slot_bytes, tmp_path
) -> None:
    """A quarter of the 512 experts: constant eviction on learned routing. The engine's greedy tokens
    are stock transformers' own, and replaying its trace reproduces its hits, misses and bytes."""
    _, runs = stock
    budget = 128 * slot_bytes
    trace_path = tmp_path / "fixture.parquet"
    with moestream.load(str(FIXTURE), cache=budget, dtype="float32", policy=policy) as engine:
        assert engine.cache.capacity == 128
        engine.start_trace(trace_path)
        for prompt, expected in runs:
            gen = engine.generate(prompt, max_tokens=NEW_TOKENS, ignore_eos=True)
            assert gen.tokens == expected
        engine.stop_trace()
        stats = engine.cache.stats
    trace = read_trace(trace_path)
    assert not trace.header.synthetic
    records, _, _ = simulate(trace, [policy], [budget])
    everything = [r for r in records if r["scope"] == "all"]
    assert sum(r["misses"] for r in everything) == stats.misses > 0
    assert sum(r["hits"] for r in everything) == stats.hits > 0
    assert sum(r["bytes_read"] for r in everything) == stats.miss_bytes


def stale_gate_oracle(model, sequences: list[list[int]]) -> tuple[int, int]:
    """(matched, rows): how many of layer L+1's top-8 are in the top-8 of layer L+1's router applied to
    layer L's router input, summed over tokens and layers 0..6, from stock transformers' own gates."""
    gates = [layer.mlp.gate for layer in model.model.layers]
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [
        gate.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, (args[0], out[2])))
        for i, gate in enumerate(gates)
    ]
    matched = rows = 0
    try:
        with torch.no_grad():
            for ids in sequences:
                model(torch.tensor([ids]))
                for layer in range(len(gates) - 1):
                    hidden = seen[layer][0].reshape(-1, gates[layer + 1].hidden_dim)
                    logits = F.linear(hidden, gates[layer + 1].weight)
                    guess = torch.topk(F.softmax(logits, dim=-1), TOP_K).indices
                    actual = seen[layer + 1][1]
                    matched += int((guess[:, :, None] == actual[:, None, :]).any(dim=1).sum())
                    rows += hidden.shape[0]
    finally:
        for hook in hooks:
            hook.remove()
    return matched, rows


def test_predict_eval_on_learned_routing_matches_stock_routers(stock, tmp_path, capsys) -> None:
    model, runs = stock
    trace_path = tmp_path / "fixture.parquet"
    # the transformers path: the oracle counts stock transformers' own routers on its own hidden states,
    # which the ggml graphs reproduce only within a tolerance (F16 keys and values)
    with moestream.load(str(FIXTURE), cache="64MiB", dtype="float32", trunk="eager") as engine:
        engine.start_trace(trace_path)
        for prompt, _ in runs:
            engine.generate(prompt, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert main(["predict-eval", str(trace_path), "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    top8 = [r for r in records if r["metric"] == "stale gate L+1, top-8 (k)"]
    matched, rows = sum(r["matched"] for r in top8), sum(r["rows"] for r in top8)
    # every forward the engine ran: the prompt, then each generated token but the last
    sequences = [prompt + generated[:-1] for prompt, generated in runs]
    assert (matched, rows) == stale_gate_oracle(model, sequences)
    assert all(not r["upper_bound"] for r in records)  # learned routing: not labelled an upper bound
    assert 0.5 < matched / (rows * TOP_K) < 0.9  # far from the ~99% of random-weight checkpoints
