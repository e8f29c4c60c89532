"""Several requests at once through the engine (`parallel=N`, `engine/batch.py`): each request's tokens
beside others are its tokens alone.

Oracle: the same model loaded with parallel=1, each request run alone (`generate`). Rounds are observed
through the runner's own calls (what each round decoded and prefilled), never by timing; requests that
must overlap are started on events the others set.
"""

from __future__ import annotations

import threading

import pytest
from batch_helpers import arrive_together

import moestream
from moestream.engine import ggml_runner
from moestream.engine.sampling import SamplingParams
from moestream.errors import MoestreamError
from moestream.server.metrics import Metrics

PROMPTS = [
    [5, 17, 33, 2, 99, 41, 7],
    [250, 3, 12, 80],
    [9, 150, 77, 31, 200, 6, 18, 42, 1, 2, 3],
    [64, 7],
    [7],
]


def _params() -> list[SamplingParams]:
    """Each request its own sampling: greedy ones of different lengths, a seeded sampled one, penalties."""
    return [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, top_k=40, seed=7),
        SamplingParams(max_tokens=7, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.7, top_p=0.9, seed=3),
        SamplingParams(max_tokens=9, ignore_eos=True),
    ]


def _alone(path: str, prompts, params) -> list[list[int]]:
    with moestream.load(path, cache="64MiB", trunk="ggml") as engine:
        return [engine.generate(p, s).tokens for p, s in zip(prompts, params)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral"])
def test_generate_batch_gives_each_prompt_its_tokens_alone(arch, tiny_dir):
    path = str(tiny_dir(arch))
    want = _alone(path, PROMPTS, _params())
    with moestream.load(path, cache="64MiB", trunk="ggml", parallel=4) as engine:
        gens = engine.generate_batch(PROMPTS, _params())
        assert engine.batch.decode_rows > engine.batch.rounds  # several rows a decode step
        assert engine.batch.busy == 0
    assert [g.tokens for g in gens] == want
    assert [g.finish_reason for g in gens] == ["length"] * len(PROMPTS)
    assert [g.prompt_tokens for g in gens] == [len(p) for p in PROMPTS]


def test_generate_batch_with_parallel_1_runs_them_in_turn(tiny_dir):
    path = str(tiny_dir("qwen3_moe"))
    want = _alone(path, PROMPTS[:2], _params()[:2])
    with moestream.load(path, cache="64MiB", trunk="ggml") as engine:
        assert engine.batch is None
        assert [g.tokens for g in engine.generate_batch(PROMPTS[:2], _params()[:2])] == want
        with pytest.raises(MoestreamError, match="2 sampling params were given for 1 prompts"):
            engine.generate_batch(PROMPTS[:1], _params()[:2])


def test_text_prompts_stop_strings_and_a_streamed_budget(tiny_dir):
    """Text through the tokenizer, a stop string, and experts streamed from a cache of a few slots."""
    path = str(tiny_dir("qwen3_moe"))
    texts = ["hello there", "the sky is", "a b c d e f g"]
    with moestream.load(path, cache="64MiB", trunk="ggml") as engine:
        first = engine.generate(texts[1], max_tokens=12, ignore_eos=True).text
    stop = first[3:5]
    assert stop.strip()
    options = dict(max_tokens=12, ignore_eos=True, stop=[stop])
    with moestream.load(path, cache="64MiB", trunk="ggml") as engine:
        want = [engine.generate(t, **options) for t in texts]
    with moestream.load(path, cache="150KiB", trunk="ggml", parallel=3) as engine:
        got = engine.generate_batch(texts, **options)
        assert engine.counters().misses > 0
    assert [(g.text, g.tokens, g.finish_reason) for g in got] == [
        (w.text, w.tokens, w.finish_reason) for w in want
    ]
    assert got[1].finish_reason == "stop"


def _recorded(engine) -> list[tuple[str, int]]:
    """The runner's steps as they run: ("decode", rows) and ("prefill", tokens)."""
    runner, log = engine.runner, []
    decode, forward = runner.decode, runner.forward

    def logged_decode(seqs):
        log.append(("decode", len(seqs)))
        return decode(seqs)

    def logged_forward(ids, cache, greedy=False):
        log.append(("prefill" if len(ids) > 1 else "one", len(ids)))
        return forward(ids, cache, greedy)

    runner.decode, runner.forward = logged_decode, logged_forward
    return log


def test_a_new_prompt_is_prefilled_a_chunk_a_round_beside_the_running_stream(tiny_dir, monkeypatch):
    """A long prompt joins while another request decodes: it is fed a chunk a round, each round also
    decoding the running request (its stall bounded by one chunk), and both get their tokens alone."""
    monkeypatch.setattr(ggml_runner, "CHUNK", 5)
    path = str(tiny_dir("qwen3_moe"))
    long_prompt = list(range(10, 33))  # 23 tokens: 5 chunks
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = _alone(path, [PROMPTS[0], long_prompt], [params, params])
    with moestream.load(path, cache="64MiB", trunk="ggml", parallel=2) as engine:
        log = _recorded(engine)
        three, joined = threading.Event(), threading.Event()
        out = {}
        acquire = engine.batch.acquire

        def acquired(ids: list[int]) -> int:  # the long prompt's request holds its slot
            slot = acquire(ids)
            if engine.batch.busy == 2:
                joined.set()
            return slot

        engine.batch.acquire = acquired

        def first() -> None:
            for gen in engine.stream(PROMPTS[0], params):
                if len(gen.tokens) == 3:
                    three.set()
                    # the running request has 27 tokens left when the long prompt joins, more than its 5
                    # chunks' rounds (its own thread would otherwise decode on, alone, and might finish
                    # before the other joins on a busy machine)
                    assert joined.wait(60)
            out["first"] = gen.tokens

        thread = threading.Thread(target=first)
        thread.start()
        assert three.wait(60)
        second = engine.generate(long_prompt, params)
        thread.join(60)
    assert out["first"] == want[0] and second.tokens == want[1]
    chunks = [i for i, (kind, _) in enumerate(log) if kind == "prefill"][-5:]  # the long prompt's
    assert [log[i][1] for i in chunks] == [5, 5, 5, 5, 3]
    for i in chunks:  # each chunk of the new prompt right after a decode step of the running request
        assert log[i - 1] in (("one", 1), ("decode", 2)), log[i - 1 : i + 1]


@pytest.mark.parametrize(
    ("prompts", "first", "after"),
    [
        # 5 + 4 + 3 tokens: one chunk's tokens (12) hold the three, fed in the first round
        ([[5, 17, 33, 2, 99], [250, 3, 12, 80], [64, 7, 9]], 3, [("decode", 3)]),
        # 6 + 6 + 6: two in the first round, the third beside the first two's decode step
        (
            [[5, 17, 33, 2, 99, 41], [250, 3, 12, 80, 8, 8], [64, 7, 9, 150, 77, 31]],
            2,
            [("decode", 2), ("prefill", 6), ("decode", 3)],
        ),
    ],
)
def test_prompts_that_arrive_together_are_fed_in_one_round(tiny_dir, monkeypatch, prompts, first, after):
    """Requests that hold their slots before any forward (a barrier in `acquire`): the first round feeds
    as many of their prompts as one chunk's tokens hold, each in a forward of its own, before any decodes;
    each request still gets its tokens alone."""
    monkeypatch.setattr(ggml_runner, "CHUNK", 12)
    path = str(tiny_dir("qwen3_moe"))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = _alone(path, prompts, [params] * 3)
    with moestream.load(path, cache="64MiB", trunk="ggml", parallel=3) as engine:
        log = _recorded(engine)
        arrive_together(engine, 3)
        gens = engine.generate_batch(prompts, params)
        assert engine.batch.busy == 0
    assert [g.tokens for g in gens] == want
    assert [kind for kind, _ in log[:first]] == ["prefill"] * first
    assert sum(n for _, n in log[:first]) <= 12
    assert log[first : first + len(after)] == after


def test_a_rounds_steps_run_side_by_side_where_experts_stream(tiny_dir, monkeypatch):
    """Experts streamed through a cache of one layer's (8 slots of 2 layers x 8): three requests that hold
    their slots together are fed in one round side by side (`GgmlRunner.together`); each request gets its
    tokens alone, and the requests read fewer experts than with the round's steps one after the other
    (`lockstep` off)."""
    monkeypatch.setattr(ggml_runner, "CHUNK", 12)
    path = str(tiny_dir("qwen3_moe", top_k=4))
    prompts = [[5, 17, 33, 2], [250, 3, 12, 80], [64, 7, 9, 150]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = _alone(path, prompts, [params] * 3)
    got, misses = {}, {}
    for way in ("side by side", "in turn"):
        with moestream.load(path, cache="300KiB", trunk="ggml", parallel=3) as engine:
            if way == "in turn":
                monkeypatch.setattr(engine.runner, "lockstep", lambda: False)
            arrive_together(engine, 3)
            got[way] = [g.tokens for g in engine.generate_batch(prompts, params)]
            misses[way] = engine.counters().misses
            assert (engine.batch.together_rounds == 1) == (way == "side by side")
            body = Metrics(engine.counters, lambda: 0, batch=engine.batch).render().decode()
            assert f"moestream_side_by_side_rounds_total {float(way == 'side by side')}" in body
    assert got["side by side"] == got["in turn"] == want
    assert misses["side by side"] < misses["in turn"], misses


def test_a_cancelled_request_leaves_and_the_others_go_on(tiny_dir):
    path = str(tiny_dir("qwen3_moe"))
    params = SamplingParams(max_tokens=15, ignore_eos=True)
    want = _alone(path, PROMPTS[:3], [params] * 3)
    with moestream.load(path, cache="64MiB", trunk="ggml", parallel=3) as engine:
        stop = threading.Event()

        def cancelled_after_4():
            return stop.is_set()

        def run(i: int):
            if i == 1:
                for gen in engine.stream(PROMPTS[1], params, cancelled=cancelled_after_4):
                    if len(gen.tokens) == 4:
                        stop.set()
                return gen
            return engine.generate(PROMPTS[i], params)

        from moestream.engine.batch import run_all

        gens = run_all([lambda i=i: run(i) for i in range(3)], 3)
        assert engine.batch.busy == 0
    assert gens[1].finish_reason == "cancelled" and gens[1].tokens == want[1][:5]
    assert [gens[0].tokens, gens[2].tokens] == [want[0], want[2]]


def test_the_slots_prompt_caches_and_the_limits(tiny_dir):
    path = str(tiny_dir("qwen3_moe"))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with moestream.load(path, cache="64MiB", trunk="ggml", parallel=2) as engine:
        engine.generate_batch(PROMPTS[:2], params, cache_prompt=True)
        # a prompt that extends the second one goes to its slot and reuses its cached tokens
        again = engine.generate(PROMPTS[1] + [3, 4], params, cache_prompt=True)
        assert again.cached_tokens == len(PROMPTS[1])
        held = [engine.batch.acquire([]), engine.batch.acquire([])]
        with pytest.raises(MoestreamError, match="all 2 slots are in use: at most 2 requests run at once"):
            engine.generate(PROMPTS[0], params)
        engine.batch.release(held.pop())
        engine.streaming.suspect = True  # a shard changed and came back: the cache is to be rebuilt
        with pytest.raises(MoestreamError, match="a checkpoint file changed under a running request"):
            engine.generate(PROMPTS[0], params)  # not while another request reads the streaming
        engine.batch.release(held.pop())
        assert engine.generate(PROMPTS[0], params).tokens  # rebuilt, then run
        assert not engine.streaming.suspect
        with pytest.raises(MoestreamError, match="a routing replay runs one request at a time"):
            engine.replay_routing("unused.jsonl")
