"""One request's parsing on recorded-shape streams (llama-server's OpenAI and native endpoints), with a
disk counter that advances per read, so the prefill/decode byte split is known exactly."""

from __future__ import annotations

import json

import httpx
import pytest

from moestream.bench.client import NATIVE, run_request
from moestream.errors import MoestreamError

TIMINGS = {
    "prompt_n": 21,
    "prompt_ms": 3500.0,
    "prompt_per_token_ms": 166.7,
    "prompt_per_second": 6.0,
    "predicted_n": 5,
    "predicted_ms": 2000.0,
    "predicted_per_token_ms": 400.0,
    "predicted_per_second": 2.5,
}


def _sse(chunks: list[dict]) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def _client(body: bytes, seen: list) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return httpx.Client(base_url="http://x", transport=httpx.MockTransport(handler))


def _counter(steps: list[int]):
    values = iter(steps)
    return lambda: next(values)


def test_openai_stream_from_llama_server():
    chunks = [
        {"choices": [{"text": "", "index": 0, "finish_reason": None}]},  # no text yet: not the first token
        {"choices": [{"text": "Hel", "index": 0, "finish_reason": None}]},
        {"choices": [{"text": "lo", "index": 0, "finish_reason": None}]},
        {"choices": [{"text": " w", "index": 0, "finish_reason": "length"}], "timings": TIMINGS},
    ]
    seen: list = []
    # counter reads: before the request, at the first text, after the stream
    r = run_request(
        _client(_sse(chunks), seen), 3, "prompt", "en", 5, read_counter=_counter([1000, 5000, 12000])
    )
    path, body = seen[0]
    assert path == "/v1/completions"
    assert body == {
        "prompt": "prompt",
        "temperature": 0,
        "stream": True,
        "cache_prompt": False,
        "ignore_eos": True,
        "seed": 0,
        "max_tokens": 5,
    }
    assert (r.index, r.text, r.finish_reason) == (3, "Hello w", "length")
    assert (r.prompt_n, r.predicted_n, r.decode_tok_s, r.prefill_tok_s) == (21, 5, 2.5, 6.0)
    assert (r.device_bytes_prefill, r.device_bytes_decode, r.device_bytes) == (4000, 7000, 11000)
    assert r.ms_per_token == 500.0  # 2000 ms over tokens 2..5
    assert r.mib_per_token == pytest.approx(7000 / (1 << 20) / 4)
    assert r.moe is None


def test_native_endpoint_chunks():
    chunks = [
        {"content": "가", "stop": False},
        {"content": "나", "stop": False},
        {"content": "", "stop": True, "stop_type": "limit", "timings": TIMINGS},
    ]
    seen: list = []
    r = run_request(_client(_sse(chunks), seen), 0, "p", "ko", 5, endpoint=NATIVE, ignore_eos=False)
    assert seen[0][0] == "/completion" and seen[0][1]["n_predict"] == 5 and "max_tokens" not in seen[0][1]
    assert seen[0][1]["ignore_eos"] is False
    assert (r.text, r.finish_reason, r.device_bytes) == ("가나", "limit", None)


def test_missing_timings_and_server_errors_are_one_sentence():
    seen: list = []
    with pytest.raises(MoestreamError, match="no llama-server 'timings'"):
        run_request(_client(_sse([{"choices": [{"text": "x"}]}]), seen), 0, "p", "", 4)
    with pytest.raises(MoestreamError, match="failed mid-request: boom"):
        run_request(_client(_sse([{"error": {"message": "boom"}}]), seen), 0, "p", "", 4)

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "bad"}})

    with pytest.raises(MoestreamError, match="answered 400 to request 2"):
        run_request(httpx.Client(base_url="http://x", transport=httpx.MockTransport(refuse)), 1, "p", "", 4)
