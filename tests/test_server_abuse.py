"""The server under abuse, over real sockets on 127.0.0.1: megabyte prompts beside small requests,
half-open and idle connections, a connection flood, slow bodies, form posts, foreign Host headers, and
/health of an engine that cannot serve. Every wait is bounded (the server's request timeout is 3 s)."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server_harness import KEY, LiveServer, long_context_copy

import moestream
from moestream.errors import MoestreamError
from moestream.server.errors import APIError
from moestream.server.guard import LoopbackHost, is_loopback_host
from moestream.server.prompts import LONG, Prompts

ARGS = ["--cache", "1MiB", "--api-key", KEY, "--queue-size", "4", "--max-body", "5MiB", "--threads", "1"]
# 3 s: four 4 MiB bodies at once must arrive within it on a loaded 2-core machine (1 s did not, on four
# test workers beside other work)
LIMITS = ["--request-timeout", "3", "--max-connections", "8"]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tiny_dir):
    live = LiveServer(long_context_copy(tiny_dir("qwen3_moe")), [*ARGS, *LIMITS])
    yield live
    live.stop()


def _address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _closed(sock: socket.socket, within: float) -> bool:
    """Whether the server closes `sock` (EOF, after any answer it sends) within `within` seconds."""
    sock.settimeout(within)
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            if sock.recv(65536) == b"":
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return False


def _reconnect(server) -> None:
    """A new client: the old one's pooled keep-alive connections would count against the cap."""
    server.http.close()
    server.http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def _post(server, body: dict, **kwargs) -> httpx.Response:
    return server.http.post("/v1/completions", json=body, **kwargs)


def test_megabyte_prompts_are_refused_on_their_count_without_stalling_or_keeping_memory(server):
    """Before: four 4 MiB prompts were tokenized whole on the one tokenizer thread: every small request
    waited 13-20 s behind them, and the server kept ~500 MiB more per prompt, never returned."""
    text = ("lorem ipsum dolor sit amet " * 150_000)[:4_000_000]
    small = _post(server, {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert small.status_code == 200
    rss = server.rss_mib()
    answers: list[httpx.Response] = []
    with ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(_post, server, {"prompt": text, "max_tokens": 1}, timeout=120) for _ in range(4)
        ]
        beside = [_post(server, {"prompt": "Hello", "max_tokens": 2, "temperature": 0}) for _ in range(3)]
        answers = [f.result() for f in futures]
    for res in answers:
        error = res.json()["error"]
        assert res.status_code == 400 and error["code"] == "context_length_exceeded", res.text[:300]
        assert error["message"].startswith("the prompt has more than 4096 tokens (counted over its first ~")
    assert [b.json()["choices"][0]["text"] for b in beside] == [small.json()["choices"][0]["text"]] * 3
    assert server.rss_mib() - rss < 150  # bounded work: pieces of 16K characters, trimmed afterwards


def test_a_post_that_is_not_json_gets_415(server):
    """Before: any Content-Type was parsed as JSON, so a web page's form or text/plain POST (which needs
    no CORS preflight) could drive a local server that has no key."""
    body = b'{"prompt": "Hello", "max_tokens": 2, "temperature": 0}'
    for kind in ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x", None):
        headers = {"content-type": kind} if kind else {}
        res = server.http.post("/v1/completions", content=body, headers=headers)
        assert res.status_code == 415 and res.json()["error"]["code"] == "unsupported_media_type", kind
    res = server.http.post(
        "/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"}
    )
    assert res.status_code == 200


def test_on_loopback_a_host_that_is_not_a_loopback_name_gets_400(server):
    """Before: any Host was served, so a page whose own domain resolves to 127.0.0.1 (DNS rebinding)
    reached the server from the browser."""
    port = _address(server)[1]
    for host in ("evil.example", f"evil.example:{port}", "192.168.1.5", "localhost.evil.example"):
        res = server.http.get("/v1/models", headers={"host": host})
        assert res.status_code == 400 and res.json()["error"]["code"] == "invalid_host", host
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]", f"app.localhost:{port}", "127.1.2.3"):
        assert server.http.get("/v1/models", headers={"host": host}).status_code == 200, host
    with socket.create_connection(_address(server), timeout=5) as sock:  # HTTP/1.0 sends no Host
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 200")


def test_is_loopback_host_and_the_middleware_off_when_not_on_loopback():
    assert all(map(is_loopback_host, ["localhost", "LOCALHOST:80", "127.0.0.1", "[::1]:8080", "a.localhost"]))
    assert not any(map(is_loopback_host, ["example.com", "10.0.0.1:80", "[::2]", "", "localhost.example"]))
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])

    scope = {"type": "http", "path": "/x", "headers": [(b"host", b"example.com")]}
    asyncio.run(LoopbackHost(app, enabled=False)(scope, None, None))
    assert seen == ["/x"]


def test_half_open_and_idle_connections_are_closed_after_the_request_timeout(server):
    """Before: 40 connections that never sent a whole request head stayed open forever."""
    _reconnect(server)
    socks = [socket.create_connection(_address(server)) for _ in range(4)]
    for sock in socks[2:]:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # a head never finished
    with socket.create_connection(_address(server)) as idle:  # one request, then nothing
        idle.sendall(
            f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
        )
        assert idle.recv(100).startswith(b"HTTP/1.1 200")
        assert _closed(idle, within=8)
    assert all(_closed(sock, within=8) for sock in socks)
    for sock in socks:
        sock.close()
    assert _post(server, {"prompt": "Hello", "max_tokens": 2, "temperature": 0}).status_code == 200


def test_a_body_that_does_not_arrive_in_time_gets_408(server):
    with socket.create_connection(_address(server)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n".encode()
            + b'{"prompt": '
        )
        sock.settimeout(8)
        answer = sock.recv(4096)
        while b"}}" not in answer:
            answer += sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 3 s" in answer


def test_connections_past_the_cap_get_503_at_once(server):
    server.http.close()  # its keep-alive connections would count
    time.sleep(0.2)  # for the server to see them go
    socks = [socket.create_connection(_address(server)) for _ in range(11)]
    first: dict[int, bytes] = {}  # socket -> the first bytes it got (b"": closed)
    try:
        deadline = time.monotonic() + 8  # past the 3 s request timeout: the held ones are closed too
        while len(first) < len(socks) and time.monotonic() < deadline:
            waiting = [s for i, s in enumerate(socks) if i not in first]
            for sock in select.select(waiting, [], [], 0.1)[0]:
                first[socks.index(sock)] = sock.recv(4096)
    finally:
        for sock in socks:
            sock.close()
    refused = sorted(i for i, data in first.items() if data)
    assert refused and refused == list(range(refused[0], 11)) and refused[0] <= 8, first
    assert all(first[i].startswith(b"HTTP/1.1 503") and b"too_many_connections" in first[i] for i in refused)
    assert all(first.get(i) == b"" for i in range(refused[0]))  # held, then closed: no request came
    _reconnect(server)
    deadline = time.monotonic() + 5  # the closed ones leave the server's set as it notices
    while time.monotonic() < deadline:
        res = server.http.get("/health")
        if res.status_code == 200:
            break
        time.sleep(0.05)
    assert res.status_code == 200


def test_long_prompts_are_counted_exactly_and_held_to_the_queue_room(tiny_dir):
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="1MiB") as engine:
        prompts = Prompts(engine, room=lambda: 0)
        try:
            prompts.context = 10**7  # room for any count: the long text is tokenized whole in the end
            text = " ".join(f"word{i % 997} and more" for i in range(12_000))
            assert len(text) > LONG
            tok = prompts.tokenizer
            assert prompts._encode(prompts._long_tokenizer, text) == tok.encode(
                text, add_special_tokens=False
            )
            with pytest.raises(APIError) as info:  # no room in the queue: a long prompt is not started
                asyncio.run(prompts.completion(text))
            assert info.value.status == 503 and info.value.code == "server_busy"
            assert asyncio.run(prompts.completion("short")) == tok.encode("short", add_special_tokens=False)
        finally:
            prompts.close()


def test_health_reports_an_engine_that_cannot_serve(tiny_dir):
    """A live server (uvicorn on 127.0.0.1 in this process): 200 while the engine serves, 503 with the
    reason once a restream left it without a streaming setup, and once it is closed."""
    import uvicorn

    from moestream.server.app import ServerOptions, create_app

    engine = moestream.load(str(tiny_dir("qwen3_moe")), cache="1MiB", io_mode="pagecache")
    sock = socket.create_server(("127.0.0.1", 0))
    app = create_app(engine, ServerOptions(model_id="tiny", loopback_only=True))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="error", log_config=None))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            deadline = time.monotonic() + 30
            while not uv.started and time.monotonic() < deadline:
                time.sleep(0.02)
            assert http.get("/health").json()["status"] == "ok"

            def failing_reader(mode, threads):
                raise MoestreamError("no reader today")

            engine.loaded.make_reader = failing_reader
            with pytest.raises(MoestreamError, match="no reader today"):
                engine.restream(cache="2MiB")
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "unavailable"
            assert "could not be rebuilt (no reader today)" in health.json()["reason"]
            res = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
            assert res.status_code == 503 and res.json()["error"]["code"] == "engine_unavailable"
            engine.close()
            assert http.get("/health").json()["reason"] == "the engine is closed"
    finally:
        uv.should_exit = True
        thread.join(10)
        engine.close()


def test_a_tiny_temperature_is_greedy_as_in_vllm(server):
    """Before: 500 (every logit divided by 1e-40 overflowed). vLLM and SGLang take a temperature below
    1e-5 as greedy, llama-server accepts any positive one: so 200 and the greedy tokens, not a 400."""
    greedy = _post(server, {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    for tiny in (1e-40, 5e-324):
        res = _post(
            server, {"prompt": "Hello", "max_tokens": 6, "temperature": tiny, "seed": 3, "ignore_eos": True}
        )
        assert res.status_code == 200, res.text[:300]
        assert res.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
