"""Bad input, overload and disconnects against a live server: every malformed request gets a 4xx with an
OpenAI-style error body, the server survives them all and then answers a valid request correctly."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from test_server_harness import CONTEXT, shared_server

from moestream.cli import main

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
JSON = {"content-type": "application/json"}
USER = [{"role": "user", "content": "hi"}]
# (path, body: raw bytes or a JSON value, expected status, expected param or None)
RAW_BAD_JSON = [
    b"",
    b"{",
    b"[1",
    b"nope",
    b"{'prompt': 'x'}",
    b"\xff\xfe\x00",
    b'{"prompt": NaN}',
    b'{"prompt": "\\ud800"}',
    b'{"model": "\\udc00", "messages": []}',
    b'{"prompt": "x", "max_tokens": Infinity}',
    b"[" * 20000 + b"]" * 20000,
    b'{"prompt": "x",}',
]
NOT_OBJECTS = [[], 1, None, "prompt", [{"prompt": "x"}]]
COMPLETION_CASES = [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": [999999]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [7] * (CONTEXT + 4)}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
]
SHARED_CASES = [  # fields of both endpoints
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 5.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": CONTEXT}, "max_tokens"),
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": "x"}, "seed"),
    ({"seed": 2**70}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"stop": 5}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"n": 2}, "n"),
    ({"n": "1"}, "n"),
    ({"model": 7}, "model"),
    ({"ignore_eos": "no"}, "ignore_eos"),
    ({"response_format": {"type": "xml"}}, "response_format"),
]
UNKNOWN_MODELS = ["gpt-4", "/etc/passwd", "../../../etc/hosts", "", "x" * 5000]
CHAT_CASES = [
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
                }
            ]
        },
        "messages.0.content",
    ),
    ({"messages": [USER[0], 5]}, "messages.1"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools.0.function"),
    ({"messages": USER, "logprobs": 5}, "logprobs"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": USER, "tool_choice": "sometimes"}, "tool_choice"),
    (
        {
            "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}},
        },
        "response_format",
    ),
    ({"messages": USER, "json_schema": {"$ref": "#/nowhere"}}, "json_schema"),
    ({"messages": [{"role": "user", "content": "word " * 4200}]}, "messages"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_tokens"),
]


def malformed() -> list[tuple[str, bytes, int, str | None]]:
    """One of every kind of bad request, as (path, body, status, param)."""
    cases = [(p, raw, 400, None) for p in (COMPLETIONS, CHAT) for raw in RAW_BAD_JSON]
    cases += [(p, json.dumps(v).encode(), 400, None) for p in (COMPLETIONS, CHAT) for v in NOT_OBJECTS]
    cases += [(COMPLETIONS, json.dumps(body).encode(), 400, param) for body, param in COMPLETION_CASES]
    cases += [(CHAT, json.dumps(body).encode(), 400, param) for body, param in CHAT_CASES]
    for body, param in SHARED_CASES:
        cases.append((COMPLETIONS, json.dumps({"prompt": "x", **body}).encode(), 400, param))
        cases.append((CHAT, json.dumps({"messages": USER, **body}).encode(), 400, param))
    for name in UNKNOWN_MODELS:
        cases.append((COMPLETIONS, json.dumps({"model": name, "prompt": "x"}).encode(), 404, "model"))
        cases.append((CHAT, json.dumps({"model": name, "messages": USER}).encode(), 404, "model"))
    big = json.dumps({"prompt": "x" * (70 << 10)}).encode()
    cases += [(COMPLETIONS, big, 413, None), (CHAT, big, 413, None)]
    return cases


@pytest.fixture(scope="module")
def server(tiny_dir):
    return shared_server(tiny_dir("qwen3_moe"))


def _check_error(res: httpx.Response, status: int, param: str | None, what: str) -> None:
    assert res.status_code == status, (what, res.status_code, res.text[:300])
    error = res.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, what
    assert (
        isinstance(error["message"], str)
        and 0 < len(error["message"]) < 400
        and "Traceback" not in error["message"]
    )
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, (what, error)


def test_malformed_requests_then_a_valid_one(server, capsys):
    cases = malformed()
    sent = 0
    while sent < 240:  # every kind at least once, in all well over 200 requests
        for path, body, status, param in cases:
            res = server.http.post(path, content=body, headers=JSON)
            _check_error(res, status, param, f"{path} {body[:80]!r}")
            sent += 1
    for method, path, status in (
        ("GET", COMPLETIONS, 405),
        ("DELETE", "/v1/models", 405),
        ("GET", "/v1/nope", 404),
        ("GET", "/../../etc/passwd", 404),
    ):
        _check_error(server.http.request(method, path), status, None, path)
    # a chunked upload declares no length: the limit still holds
    res = server.http.post(
        COMPLETIONS,
        content=iter([b'{"prompt": "', b"x" * (40 << 10), b"x" * (40 << 10), b'"}']),
        headers=JSON,
    )
    _check_error(res, 413, None, "chunked")
    assert server.metric("moestream_requests_total", status="400") >= sent * 0.8

    capsys.readouterr()
    assert (
        main(
            [
                "generate",
                str(server.path),
                "--prompt",
                "Hello world",
                "--max-tokens",
                "12",
                "--ignore-eos",
                "--cache",
                "1MiB",
                "--json",
            ]
        )
        == 0
    )
    expected = json.loads(capsys.readouterr().out)["text"]
    res = server.http.post(
        COMPLETIONS,
        json={
            "model": server.model,
            "prompt": "Hello world",
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert res.status_code == 200 and res.json()["choices"][0]["text"] == expected


def _generated(server) -> float:
    return server.metric("moestream_generated_tokens_total")


def test_disconnect_stops_the_generation(server):
    server.wait_idle()
    cancelled, tokens = (
        server.metric("moestream_generations_total", finish_reason="cancelled"),
        _generated(server),
    )
    body = {
        "prompt": "Hello",
        "max_tokens": CONTEXT - 10,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with server.http.stream("POST", COMPLETIONS, json=body) as res:
        chunks = 0
        for line in res.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 3:
                break
    server.wait_idle(timeout=5)  # the whole run would take many seconds
    assert server.metric("moestream_generations_total", finish_reason="cancelled") == cancelled + 1
    assert _generated(server) - tokens < 100
    # a non-streamed request whose client gives up is stopped too
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        server.http.post(COMPLETIONS, json={**body, "stream": False}, timeout=0.3)
    server.wait_idle(timeout=5)
    assert server.metric("moestream_generations_total", finish_reason="cancelled") == cancelled + 2
    assert time.monotonic() - start < 5


def test_full_queue_answers_503_with_retry_after(server):
    server.wait_idle()
    generations = server.metric("moestream_generations_total")
    body = {
        "prompt": "Hello",
        "max_tokens": CONTEXT - 10,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    streams = []
    try:
        for _ in range(5):  # one running and four waiting fill --queue-size 4
            streams.append(server.http.stream("POST", COMPLETIONS, json=body))
            streams[-1].__enter__()
        health = server.http.get("/health").json()
        assert health["running"] and health["waiting"] == 4
        res = server.http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2})
        assert res.status_code == 503 and int(res.headers["Retry-After"]) >= 1
        assert res.json()["error"]["code"] == "server_busy" and res.json()["error"]["type"] == "server_error"
    finally:
        for stream in reversed(streams[1:]):  # the waiting ones first, so that none of them starts
            stream.__exit__(None, None, None)
        time.sleep(0.3)
        streams[0].__exit__(None, None, None)
    server.wait_idle(timeout=10)
    assert (
        server.metric("moestream_generations_total") == generations + 1
    )  # queued jobs of gone clients never ran
    assert server.http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2}).status_code == 200
