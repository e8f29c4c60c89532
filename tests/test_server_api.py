"""The server through the real openai client: output equal to `moestream generate`, streams that join to
the whole text, llama-server timings, sampling controls, API key and metrics."""

from __future__ import annotations

import json

import openai
import pytest
from test_server_harness import shared_server

from moestream.cli import main

TIMINGS = [
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_dir):
    return shared_server(tiny_dir("qwen3_moe"))


def generate_json(capsys, server, prompt: str, tokens: int, *extra: str) -> dict:
    """The oracle: stock `moestream generate --json` on the very checkpoint the server serves."""
    capsys.readouterr()
    assert (
        main(
            [
                "generate",
                str(server.path),
                "--prompt",
                prompt,
                "--max-tokens",
                str(tokens),
                "--ignore-eos",
                "--cache",
                "1MiB",
                "--json",
                *extra,
            ]
        )
        == 0
    )
    return json.loads(capsys.readouterr().out)


def test_greedy_completion_equals_generate(server, capsys):
    expected = generate_json(capsys, server, "Hello world", 12)
    client = server.client()
    out = client.completions.create(
        model=server.model, prompt="Hello world", max_tokens=12, temperature=0, extra_body=IGNORE_EOS
    )
    assert out.choices[0].text == expected["text"] and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == expected["prompt_tokens"]
    assert out.usage.completion_tokens == len(expected["tokens"]) == 12
    ids = client.completions.create(
        model=server.model, prompt=[1, 2, 3], max_tokens=4, temperature=0, extra_body=IGNORE_EOS
    )
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 4


def test_greedy_chat_equals_generate_chat(server, capsys):
    expected = generate_json(capsys, server, "Hi there", 10, "--chat")
    out = server.client().chat.completions.create(
        model=server.model,
        temperature=0,
        max_tokens=10,
        messages=[{"role": "user", "content": "Hi there"}],
        extra_body=IGNORE_EOS,
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected["text"]
    assert out.usage.prompt_tokens == expected["prompt_tokens"]


def _stream(client, chat: bool, **kwargs) -> tuple[str, list]:
    if chat:
        chunks = list(
            client.chat.completions.create(
                messages=[{"role": "user", "content": "Tell me"}], stream=True, **kwargs
            )
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks
    chunks = list(client.completions.create(prompt="The quick brown", stream=True, **kwargs))
    return "".join(c.choices[0].text for c in chunks), chunks


def _whole(client, chat: bool, **kwargs):
    if chat:
        out = client.chat.completions.create(messages=[{"role": "user", "content": "Tell me"}], **kwargs)
        return out.choices[0].message.content, out
    out = client.completions.create(prompt="The quick brown", **kwargs)
    return out.choices[0].text, out


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_joins_to_the_whole_text(server, chat):
    client = server.client()
    greedy = dict(model=server.model, max_tokens=40, temperature=0, extra_body=IGNORE_EOS)
    whole, out = _whole(client, chat, **greedy)
    joined, chunks = _stream(client, chat, **greedy)
    assert joined == whole and len(whole) > 10
    assert [c.model_extra.get("timings") is not None for c in chunks].count(True) == 1
    assert chunks[-1].model_extra["timings"]["predicted_n"] == out.usage.completion_tokens == 40
    assert chunks[-1].choices[0].finish_reason == "length"
    # a stop string in the middle: the stream must hold back its partial prefix, never send it
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    cut, _ = _whole(client, chat, stop=[stop], **greedy)
    joined_cut, cut_chunks = _stream(client, chat, stop=stop, **greedy)
    assert cut == joined_cut == whole[: whole.find(stop)]
    assert cut_chunks[-1].choices[0].finish_reason == "stop"
    # seeded sampling is reproducible across both modes
    sampled = dict(
        model=server.model, max_tokens=24, temperature=1.3, top_p=0.95, seed=11, extra_body=IGNORE_EOS
    )
    assert _whole(client, chat, **sampled)[0] == _stream(client, chat, **sampled)[0]


def _check_timings(t: dict, prompt_tokens: int, completion_tokens: int, cached: int = 0) -> None:
    assert list(t) == TIMINGS
    assert t["cache_n"] == cached and t["prompt_n"] == prompt_tokens - cached
    assert t["predicted_n"] == completion_tokens
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0
    assert t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"])
    assert t["prompt_per_second"] == pytest.approx(1000 * t["prompt_n"] / t["prompt_ms"])
    assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / t["predicted_n"])
    assert t["predicted_per_second"] == pytest.approx(1000 * t["predicted_n"] / t["predicted_ms"])


def test_timings_and_moe_objects(server):
    res = server.http.post(
        "/v1/completions",
        json={
            "prompt": "Streaming weights",
            "max_tokens": 9,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,
        },
    )
    body = res.json()
    _check_timings(body["timings"], body["usage"]["prompt_tokens"], 9)
    moe = body["moe"]
    assert set(moe) == {"bytes_read", "hits", "misses", "hit_rate", "read_wait_ms"}
    assert moe["hits"] + moe["misses"] > 0 and moe["hit_rate"] == pytest.approx(
        moe["hits"] / (moe["hits"] + moe["misses"])
    )
    chunks = list(
        server.client().completions.create(
            model=server.model,
            prompt="Streaming weights",
            max_tokens=9,
            temperature=0,
            stream=True,
            extra_body=IGNORE_EOS,
        )
    )
    # the same prompt again: the prompt cache holds all of it, and the last token is computed for its logits
    prompt_tokens = body["usage"]["prompt_tokens"]
    _check_timings(chunks[-1].model_extra["timings"], prompt_tokens, 9, cached=prompt_tokens - 1)
    assert set(chunks[-1].model_extra["moe"]) == set(moe)


def test_sampling_controls(server):
    client = server.client()

    def text(top_k: int = 0, **kw) -> str:
        return (
            client.completions.create(
                model=server.model,
                prompt="Mixture of",
                max_tokens=16,
                extra_body={**IGNORE_EOS, "top_k": top_k},
                **kw,
            )
            .choices[0]
            .text
        )

    greedy = text(temperature=0)
    a, b, c = text(temperature=1.5, seed=7), text(temperature=1.5, seed=7), text(temperature=1.5, seed=8)
    assert a == b and a != c and a != greedy
    assert text(temperature=1.0, seed=3, top_k=1) == greedy
    assert text(temperature=1.0, top_p=1e-6, seed=3) == greedy
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.completions.create(model=server.model, prompt="x", n=2)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x"}], n=3)


def test_models_health_api_key_and_metrics(server):
    assert [m.id for m in server.client().models.list()] == [server.model]
    bare = server.http.get("/health", headers={"Authorization": ""})
    assert bare.status_code == 200 and bare.json()["status"] == "ok"
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
        res = server.http.post("/v1/completions", json={"prompt": "x"}, headers=headers)
        assert res.status_code == 401 and res.json()["error"]["code"] == "invalid_api_key"
        assert server.http.get("/metrics", headers=headers).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()

    before = {
        name: server.metric(name)
        for name in (
            "moestream_generated_tokens_total",
            "moestream_prompt_tokens_total",
            "moestream_expert_cache_hits_total",
        )
    }
    ok = server.metric("moestream_requests_total", endpoint="chat", status="200")
    ttft = server.metric("moestream_time_to_first_token_seconds_count", endpoint="chat")
    out = server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        extra_body=IGNORE_EOS,
    )
    assert server.metric("moestream_generated_tokens_total") - before["moestream_generated_tokens_total"] == 5
    assert (
        server.metric("moestream_prompt_tokens_total") - before["moestream_prompt_tokens_total"]
        == out.usage.prompt_tokens
    )
    assert server.metric("moestream_expert_cache_hits_total") > before["moestream_expert_cache_hits_total"]
    assert server.metric("moestream_requests_total", endpoint="chat", status="200") == ok + 1
    assert server.metric("moestream_time_to_first_token_seconds_count", endpoint="chat") == ttft + 1
    for name in (
        "moestream_request_latency_seconds_bucket",
        "moestream_expert_bytes_read_total",
        "moestream_expert_cache_misses_total",
        "moestream_expert_read_wait_seconds_total",
    ):
        assert f"\n{name}" in server.http.get("/metrics").text
