"""A plainly greedy request's next step started before its token is handed out (`ModelRunner.launch`,
`engine/loop.py`), checked on ggml's CPU backend (MOESTREAM_GGML_BACKEND=cpu, the device path CUDA runs):
the step of token t starts before the caller sees t and ends after it; the tokens are those of steps
called one by one (the CPU path's); a request that stops early (a stop string, EOS, the caller gone)
leaves the engine and its prompt cache as a cold run would find them.
"""

from __future__ import annotations

import moestream
from moestream.engine.ggml_runner import GgmlRunner

PROMPT = [5, 17, 33, 2, 99, 41, 7, 250, 3, 12, 80, 64]
TOKENS = 24


def _record(monkeypatch) -> list[tuple[str, int]]:
    """Each started step as ("launch", token) when it starts and ("end", token) when waited for."""
    events: list[tuple[str, int]] = []
    launch = GgmlRunner.launch

    def recorded(self, ids, cache, greedy=False):
        done = launch(self, ids, cache, greedy)
        if done is None:
            return None
        events.append(("launch", ids[0]))

        def end():
            out = done()
            events.append(("end", ids[0]))
            return out

        return end

    monkeypatch.setattr(GgmlRunner, "launch", recorded)
    return events


def test_the_next_step_starts_before_the_token_is_handed_out(tiny_dir, monkeypatch):
    """Over a greedy request: every token but the last has its step started before the caller gets it
    and ended after; the tokens are the CPU path's; a request that samples starts none."""
    path = tiny_dir("qwen3_moe")
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as cpu:
        want = cpu.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).tokens
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    events = _record(monkeypatch)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        got: list[int] = []
        for gen in engine.stream(PROMPT, max_tokens=TOKENS, ignore_eos=True):
            if len(gen.tokens) > len(got):
                got.append(gen.tokens[-1])
                events.append(("got", got[-1]))
        assert got == want
        expected: list[tuple[str, int]] = []
        for i, token in enumerate(want):
            last = i == len(want) - 1
            expected += [("got", token)] if last else [("launch", token), ("got", token), ("end", token)]
        assert events == expected
        events.clear()
        sampled = engine.generate(PROMPT, max_tokens=6, ignore_eos=True, temperature=0.7, seed=1)
        assert len(sampled.tokens) == 6 and events == []


def test_a_request_that_stops_early_leaves_what_a_cold_run_finds(tiny_dir, monkeypatch):
    """A stop string, EOS and a caller that leaves mid-stream each end the step started for the token
    after (it was fed: the kept prompt cache holds it); the next request, reusing that cache or not,
    gives the tokens of a fresh engine."""
    path = tiny_dir("qwen3_moe")
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    events = _record(monkeypatch)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as fresh:
        want = fresh.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).tokens
        text = fresh.tokenizer.decode(want[:8])
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        eos = want[5]  # the sixth token taken for EOS: the request ends there
        monkeypatch.setattr("moestream.engine.requests.eos_ids", lambda model, tokenizer: {eos})
        first = engine.generate(PROMPT, max_tokens=TOKENS, cache_prompt=True)
        assert first.tokens == want[:5] and first.finish_reason == "stop"
        assert events[-2:] == [("launch", eos), ("end", eos)]  # its step was started, and ended
        monkeypatch.undo()
        monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
        again = engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True, cache_prompt=True)
        assert again.cached_tokens == len(PROMPT) - 1  # the prompt reused but its last token (its logits)
        assert again.tokens == want
        stop = text[-3:]
        stopped = engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True, stop=[stop])
        assert stopped.finish_reason == "stop" and stop not in stopped.text
        stream = engine.stream(PROMPT, max_tokens=TOKENS, ignore_eos=True)
        for gen in stream:
            if len(gen.tokens) == 4:
                break
        stream.close()  # the caller gone: the step started for the fifth token ended
        assert engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).tokens == want
