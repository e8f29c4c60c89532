"""Server parts without HTTP: llama-server timings arithmetic, the worker's queue and cancellation (with a
real tiny engine), and `moestream serve` argument errors. (Stream pieces: test_text_stream.py.)"""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

import moestream
from moestream.cli import build_parser, main
from moestream.engine.requests import Generation
from moestream.engine.sampling import SamplingParams
from moestream.engine.stats import GenerationStats, PhaseStats
from moestream.server.timings import timings, usage
from moestream.server.worker import Busy, Done, Job, Token, Worker


def test_timings_follow_llama_server_convention():
    # 5 prompt tokens in 50 ms (prefill includes the first token), then 3 more tokens in 30 ms
    stats = GenerationStats(PhaseStats(5, 0.050, 100, 3, 1, 0.004), PhaseStats(3, 0.030, 50, 6, 2, 0.002))
    gen = Generation("abcd", [1, 2, 3, 4], 5, stats, done=True)
    t = timings(gen)
    assert t["cache_n"] == 0 and t["prompt_n"] == 5 and t["predicted_n"] == 4
    assert t["prompt_ms"] == pytest.approx(50) and t["prompt_per_token_ms"] == pytest.approx(10)
    assert t["prompt_per_second"] == pytest.approx(100)
    assert t["predicted_ms"] == pytest.approx(30) and t["predicted_per_token_ms"] == pytest.approx(7.5)
    assert t["predicted_per_second"] == pytest.approx(4 / 0.030)
    assert 1000 * (t["predicted_n"] - 1) / t["predicted_ms"] == pytest.approx(
        stats.decode.tok_s
    )  # generate's figure
    assert usage(gen) == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    one = timings(Generation("a", [1], 5, GenerationStats(PhaseStats(5, 0.05), PhaseStats()), done=True))
    assert one["predicted_ms"] == 0 and one["predicted_per_second"] == 0  # no inf or NaN in JSON
    # 12 prompt tokens of which 9 came from the prompt cache: llama-server counts prompt_n = 3 computed
    cached = Generation(
        "ab",
        [1, 2],
        12,
        GenerationStats(PhaseStats(3, 0.030), PhaseStats(1, 0.01)),
        done=True,
        cached_tokens=9,
    )
    t = timings(cached)
    assert (t["cache_n"], t["prompt_n"]) == (9, 3) and t["prompt_per_second"] == pytest.approx(100)
    assert usage(cached)["prompt_tokens"] == 12


class _CancelAfter(Job):
    """Cancels itself from the worker thread right after emitting its n-th token: a deterministic
    disconnect."""

    n: int = 3

    def emit(self, event) -> None:
        super().emit(event)
        if isinstance(event, Token) and event.n_tokens == self.n:
            self.cancel()


class _Blocking(Job):
    """Holds the worker at its first token until `release` is set."""

    release: threading.Event

    def emit(self, event) -> None:
        super().emit(event)
        self.release.wait(30)


async def _events(job: Job) -> list:
    events = []
    while not events or not isinstance(events[-1], Done):
        events.append(await asyncio.wait_for(job.events.get(), 30))
    return events


def test_worker_stops_within_one_token_and_skips_gone_clients(tiny_dir):
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    finished: list[Generation] = []
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="1MiB") as engine:
        worker = Worker(engine, queue_size=1, on_done=finished.append)
        worker.start()

        async def scenario() -> None:
            loop = asyncio.get_running_loop()
            job = _CancelAfter([5, 6, 7], params, "a", loop)
            worker.submit(job)
            final = (await _events(job))[-1].gen
            assert final.finish_reason == "cancelled" and len(final.tokens) == 4  # token 4 was in flight

            blocker = _Blocking([5, 6, 7], params, "b", loop)
            blocker.release = threading.Event()
            gone, extra = Job([5, 6], params, "c", loop), Job([5], params, "d", loop)
            worker.submit(blocker)
            await asyncio.wait_for(blocker.events.get(), 30)  # running, held at its first token
            worker.submit(gone)  # fills the queue of one
            with pytest.raises(Busy) as busy:
                worker.submit(extra)
            assert busy.value.retry_after >= 1
            gone.cancel()
            blocker.cancel()
            blocker.release.set()
            await _events(blocker)
            while worker.waiting or worker.running:  # the worker drops the gone job
                await asyncio.sleep(0.005)
            follow = Job([9], SamplingParams(max_tokens=2, ignore_eos=True), "e", loop)
            worker.submit(follow)
            assert len((await _events(follow))[-1].gen.tokens) == 2
            assert gone.events.empty()

        try:
            asyncio.run(scenario())
        finally:
            worker.stop()
    assert [g.prompt_tokens for g in finished] == [3, 3, 1]  # the gone client's job never ran


def test_serve_arguments(tiny_dir, capsys):
    args = build_parser(["serve", "x"]).parse_args(["serve", "x"])
    assert args.host == "127.0.0.1" and args.port == 8080 and args.gpu_floor == "auto" and args.trace is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", str(tiny_dir("qwen3_moe")), "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["serve", str(tiny_dir("qwen3_moe")), "--max-body", "lots"]) == 2
    assert "--max-body: not a byte size" in capsys.readouterr().err


def test_serve_records_a_trace_and_closes_it_on_sigterm(tiny_dir, tmp_path):
    from test_server_harness import LiveServer

    from moestream.trace import read_trace

    path = tmp_path / "serve.parquet"
    server = LiveServer(
        tiny_dir("qwen3_moe"), ["--cache", "1MiB", "--trace", str(path), "--no-trace-predict"]
    )
    try:
        first = server.http.post(
            "/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 3, "ignore_eos": True}
        )
        second = server.http.post(
            "/v1/completions", json={"prompt": [9], "max_tokens": 2, "ignore_eos": True}
        )
    finally:
        server.stop()  # SIGTERM: the engine must still close the trace
    assert server.proc.returncode == 0
    trace = read_trace(path)
    assert trace.request_names == [first.json()["id"], second.json()["id"]]
    assert len(trace) == ((4 + 2) + (1 + 1)) * 2  # (prompt + fed-back tokens) x 2 MoE layers
    assert not trace.has_predictions
