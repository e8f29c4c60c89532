"""One benchmark request against an OpenAI-compatible server that reports llama-server's `timings`
(`moestream serve` and llama.cpp's `llama-server` both do), with the disk's read counter sampled
before the request, at the first streamed text (the end of prefill) and after the last chunk.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from moestream.errors import MoestreamError

MiB = 1 << 20


@dataclass
class RequestResult:
    """What one request measured. Speeds are the server's own; bytes come from the block device."""

    index: int
    lang: str
    prompt: str
    text: str
    prompt_n: int
    predicted_n: int
    prompt_ms: float
    predicted_ms: float
    decode_tok_s: float  # llama-server's predicted_per_second = predicted_n / predicted_ms
    prefill_tok_s: float  # prompt_per_second
    wall_s: float
    device_bytes_prefill: int | None = None  # read before the first streamed text arrived
    device_bytes_decode: int | None = None  # read after it, to the end of the request
    moe: dict[str, Any] | None = None  # moestream's own counters, when the server is moestream
    finish_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def device_bytes(self) -> int | None:
        if self.device_bytes_prefill is None or self.device_bytes_decode is None:
            return None
        return self.device_bytes_prefill + self.device_bytes_decode

    @property
    def ms_per_token(self) -> float:
        """Decode time per token: predicted_ms spans tokens 2..N, i.e. N - 1 token steps."""
        return self.predicted_ms / max(1, self.predicted_n - 1)

    @property
    def mib_per_token(self) -> float | None:
        """MiB read from the disk per decode step (after the first token)."""
        if self.device_bytes_decode is None:
            return None
        return self.device_bytes_decode / MiB / max(1, self.predicted_n - 1)


OPENAI, NATIVE = "/v1/completions", "/completion"  # NATIVE: llama-server's own endpoint


def request_body(
    prompt: str, max_tokens: int, ignore_eos: bool, model: str | None, endpoint: str = OPENAI
) -> dict[str, Any]:
    """Greedy, prompt cache off (`cache_prompt`, which moestream and llama-server both honour), so that
    every request computes its whole prompt."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "temperature": 0,
        "stream": True,
        "cache_prompt": False,
        "ignore_eos": ignore_eos,
        "seed": 0,
    }
    body["n_predict" if endpoint == NATIVE else "max_tokens"] = max_tokens
    if model:
        body["model"] = model
    return body


def _chunk_text(chunk: dict[str, Any]) -> tuple[str, str | None]:
    """(text delta, finish reason) of an OpenAI completion chunk or a llama-server native one."""
    if "choices" in chunk:
        choice = (chunk["choices"] or [{}])[0]
        return choice.get("text") or "", choice.get("finish_reason")
    return chunk.get("content") or "", chunk.get("stop_type") if chunk.get("stop") else None


def run_request(
    client: httpx.Client,
    index: int,
    prompt: str,
    lang: str,
    max_tokens: int,
    *,
    ignore_eos: bool = True,
    model: str | None = None,
    endpoint: str = OPENAI,
    read_counter: Callable[[], int] | None = None,
) -> RequestResult:
    """Stream one completion and return its measurements.

    Raises:
        MoestreamError: the server answered with an error, or its last chunk carried no `timings`.
    """
    counter = read_counter or (lambda: 0)
    start_bytes, start = counter(), time.perf_counter()
    first_bytes: int | None = None
    pieces: list[str] = []
    final: dict[str, Any] = {}
    body = request_body(prompt, max_tokens, ignore_eos, model, endpoint)
    with client.stream("POST", endpoint, json=body) as response:
        if response.status_code != 200:
            response.read()
            raise MoestreamError(
                f"the server answered {response.status_code} to request {index + 1}: {response.text[:200]}"
            )
        for chunk in _events(response):
            text, finish = _chunk_text(chunk)
            if text and first_bytes is None:
                first_bytes = counter()
            pieces.append(text)
            if "timings" in chunk:
                final = chunk
                final["finish_reason"] = finish
    end_bytes, wall = counter(), time.perf_counter() - start
    return _result(
        index,
        lang,
        prompt,
        "".join(pieces),
        final,
        wall,
        (start_bytes, first_bytes if first_bytes is not None else end_bytes, end_bytes),
        read_counter is not None,
    )


def _events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream, up to `data: [DONE]`."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise MoestreamError(
                f"the server failed mid-request: {chunk['error'].get('message', chunk['error'])}"
            )
        yield chunk


def _result(
    index: int,
    lang: str,
    prompt: str,
    text: str,
    final: dict[str, Any],
    wall: float,
    marks: tuple[int, int, int],
    counted: bool,
) -> RequestResult:
    timings = final.get("timings")
    if not timings:
        raise MoestreamError(
            "the server's last chunk carried no llama-server 'timings' object; "
            "the harness needs `moestream serve` or llama.cpp's llama-server"
        )
    start, first, end = marks
    return RequestResult(
        index=index,
        lang=lang,
        prompt=prompt,
        text=text,
        prompt_n=int(timings["prompt_n"]),
        predicted_n=int(timings["predicted_n"]),
        prompt_ms=float(timings["prompt_ms"]),
        predicted_ms=float(timings["predicted_ms"]),
        decode_tok_s=float(timings["predicted_per_second"]),
        prefill_tok_s=float(timings["prompt_per_second"]),
        wall_s=wall,
        device_bytes_prefill=first - start if counted else None,
        device_bytes_decode=end - first if counted else None,
        moe=final.get("moe"),
        finish_reason=final.get("finish_reason"),
    )


def request_dict(r: RequestResult) -> dict[str, Any]:
    """A request as stored in results.json, with the derived per-token figures."""
    return {
        **asdict(r),
        "device_bytes": r.device_bytes,
        "ms_per_token": r.ms_per_token,
        "mib_per_token": r.mib_per_token,
    }
