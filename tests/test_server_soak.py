"""A bounded soak: 330 short requests (sequential, concurrent, streamed, cancelled) against one live
server, with no errors, every generation accounted for, and resident memory growth under 50 MiB."""

from __future__ import annotations

import itertools
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_server_harness import shared_server

RSS_GROWTH_LIMIT_MIB = 50
PROMPTS = ["Hello", "The quick brown fox", "Mixture of experts", "안녕하세요", "0123456789"]


@pytest.fixture(scope="module")
def server(tiny_dir):
    return shared_server(tiny_dir("qwen3_moe"))


def one_request(server, client, i: int) -> int:
    """Request number i, of a kind chosen by i; returns its completion tokens."""
    rng = random.Random(i)
    max_tokens = rng.randint(1, 6)
    sampling = {"temperature": 0.0} if i % 3 else {"temperature": 0.9, "seed": i, "top_p": 0.9}
    kwargs = dict(
        model=server.model, max_tokens=max_tokens, stop=["\n\n"] if i % 5 == 0 else None, **sampling
    )
    chat, stream = i % 2 == 0, i % 4 >= 2
    prompt = PROMPTS[i % len(PROMPTS)]
    if chat:
        messages = [{"role": "user", "content": prompt}]
        if stream:
            chunks = list(client.chat.completions.create(messages=messages, stream=True, **kwargs))
            last = chunks[-1]
            assert last.choices[0].finish_reason in ("length", "stop")
            return last.usage.completion_tokens
        out = client.chat.completions.create(messages=messages, **kwargs)
    elif stream:
        chunks = list(client.completions.create(prompt=prompt, stream=True, **kwargs))
        return chunks[-1].model_extra["timings"]["predicted_n"]
    else:
        out = client.completions.create(prompt=prompt, **kwargs)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens <= max_tokens
    return out.usage.completion_tokens


def cancelled_stream(server, i: int) -> None:
    """A client that reads one or two chunks of a long stream and hangs up. The stream is most of the
    context: 200 tokens of the tiny model under the graphs could end (finish_reason "length") before the
    server saw the hang-up (39 of 40 cancelled, twice in 17 runs on a loaded machine)."""
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 3500, "ignore_eos": True, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as res:
        assert res.status_code == 200
        chunks = 0
        for line in res.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 1 + i % 2:
                break


def test_soak(server):
    client = server.client()
    counter = itertools.count()
    for _ in range(30):  # warm-up: allocator pools, tokenizer caches, lazily built objects
        one_request(server, client, next(counter))
    server.wait_idle()
    rss_before = server.rss_mib()
    generations = server.metric("moestream_generations_total")
    cancelled = server.metric("moestream_generations_total", finish_reason="cancelled")

    for _ in range(180):
        one_request(server, client, next(counter))
    with ThreadPoolExecutor(4) as pool:  # at most 1 running + 3 waiting: within --queue-size 4
        tokens = list(pool.map(lambda i: one_request(server, client, i), [next(counter) for _ in range(80)]))
    assert all(1 <= t <= 6 for t in tokens)
    for i in range(40):
        cancelled_stream(server, i)
        if i % 10 == 9:
            one_request(server, client, next(counter))  # served normally right after hang-ups
    server.wait_idle()

    assert server.http.get("/health").json()["status"] == "ok"
    assert server.metric("moestream_generations_total") - generations == 180 + 80 + 40 + 4
    assert server.metric("moestream_generations_total", finish_reason="cancelled") - cancelled == 40
    growth = server.rss_mib() - rss_before
    print(f"soak: resident memory {rss_before:.1f} -> {rss_before + growth:.1f} MiB")
    assert growth < RSS_GROWTH_LIMIT_MIB, f"resident memory grew by {growth:.1f} MiB"
