"""`moestream serve --parallel N` (-np): requests run at once, their decode steps batched.

Oracles: each request's answer from the same live server with nothing beside it (sent one after
another), against the answers of 8 real `openai` clients sent at once (started together by a barrier);
the server's own counters say the decode steps had several rows. The worker's slots, queue and 503s are
checked with jobs whose threads say when they were taken (events, no timing).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from test_server_harness import LiveServer

import moestream
from moestream.engine.sampling import SamplingParams
from moestream.server.worker import Busy, Done, Job, Worker

CLIENTS = 8
PROMPTS = [
    f"{word} number {i} is"
    for i, word in enumerate(["red", "green", "blue", "cold", "warm", "dark", "soft", "loud"])
]


@pytest.fixture(scope="module")
def server(tiny_dir):
    path = tiny_dir("qwen3_moe")
    live = LiveServer(path, ["-np", str(CLIENTS), "-t", "1", "--cache", "150KiB", "--queue-size", "4"])
    yield live
    live.stop()


def _complete(server, i: int, **kwargs):
    return server.client().completions.create(
        model=server.model,
        prompt=PROMPTS[i],
        max_tokens=10 + 2 * i,
        temperature=0.8 if i % 3 == 1 else 0,  # some sampled (seeded), some greedy
        seed=i,
        extra_body={"ignore_eos": True},
        **kwargs,
    )


def test_eight_clients_at_once_each_get_their_answer_alone(server):
    health = server.http.get("/health").json()
    assert (health["slots"], health["slots_busy"], health["slots_idle"]) == (CLIENTS, 0, CLIENTS)
    assert server.metric("moestream_slots") == CLIENTS
    alone = [_complete(server, i) for i in range(CLIENTS)]
    steps, rows = server.metric("moestream_decode_steps_total"), server.metric("moestream_decode_rows_total")
    assert rows == steps  # one request at a time: a row a step

    barrier = threading.Barrier(CLIENTS)
    together: list = [None] * CLIENTS

    def client(i: int) -> None:
        barrier.wait(60)
        together[i] = _complete(server, i)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for a, b in zip(alone, together):
        assert b.choices[0].text == a.choices[0].text
        assert b.usage.completion_tokens == a.usage.completion_tokens
        assert b.usage.prompt_tokens == a.usage.prompt_tokens
        assert b.choices[0].finish_reason == "length"
    more_steps = server.metric("moestream_decode_steps_total") - steps
    more_rows = server.metric("moestream_decode_rows_total") - rows
    assert more_rows > more_steps  # decode steps of several rows
    server.wait_idle()


def test_a_client_that_hangs_up_leaves_the_batch_and_the_others_go_on(server):
    alone = [_complete(server, i) for i in (0, 2)]
    cancelled = server.metric("moestream_generations_total", finish_reason="cancelled")
    barrier = threading.Barrier(3)
    out: dict = {}

    def leaving() -> None:
        barrier.wait(60)
        stream = _complete(server, 5, stream=True)
        for n, _ in enumerate(stream):
            if n == 2:
                stream.close()  # hang up mid-answer
                return

    def staying(i: int) -> None:
        barrier.wait(60)
        out[i] = _complete(server, i)

    threads = [
        threading.Thread(target=leaving),
        *(threading.Thread(target=staying, args=(i,)) for i in (0, 2)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    server.wait_idle()
    assert [out[0].choices[0].text, out[2].choices[0].text] == [a.choices[0].text for a in alone]
    assert server.metric("moestream_generations_total", finish_reason="cancelled") == cancelled + 1


class _Taken(Worker):
    """A worker whose threads set `taken` when they take a job."""

    taken: list[threading.Event]

    def _generate(self, job: Job) -> None:
        self.taken.pop(0).set()
        super()._generate(job)


def test_n_jobs_run_at_once_then_the_queue_then_503(tiny_dir):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="1MiB", parallel=2) as engine:
        worker = _Taken(engine, queue_size=1)
        taken = [threading.Event() for _ in range(3)]
        worker.taken = list(taken)  # popped as the threads take jobs
        assert worker.slots == 2
        hold = threading.Event()
        stream = engine.stream

        def held_stream(*args, **kwargs):  # each job waits for `hold` before its first forward
            hold.wait(30)
            return stream(*args, **kwargs)

        engine.stream = held_stream
        worker.start()

        async def scenario() -> None:
            loop = asyncio.get_running_loop()
            jobs = [Job([5 + i, 6, 7], params, f"j{i}", loop) for i in range(4)]
            for i in range(2):  # each taken by a thread of its own (the queue holds one)
                worker.submit(jobs[i])
                await asyncio.to_thread(taken[i].wait, 30)
            assert worker.busy == 2 and worker.waiting == 0
            worker.submit(jobs[2])  # both slots busy: it waits
            assert worker.waiting == 1
            with pytest.raises(Busy):  # the queue of one is full
                worker.submit(jobs[3])
            hold.set()
            await _each_done(jobs[:3], 6)

        _drive(worker, scenario)


def test_jobs_for_idle_slots_are_not_counted_as_waiting(tiny_dir):
    """A job an idle slot will take is admitted however late its thread wakes: with the slots' threads
    not yet running (the widest such window), N slots and a queue of Q admit N + Q jobs, then 503; none
    of the first N counts as waiting."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="1MiB", parallel=2) as engine:
        worker = Worker(engine, queue_size=1)
        assert worker.slots == 2

        async def scenario() -> None:
            loop = asyncio.get_running_loop()
            jobs = [Job([5 + i, 6, 7], params, f"j{i}", loop) for i in range(4)]
            for i, job in enumerate(jobs[:3]):
                worker.submit(job)
                assert worker.waiting == max(0, i + 1 - worker.slots)
            with pytest.raises(Busy):
                worker.submit(jobs[3])
            worker.start()
            await _each_done(jobs[:3], 2)

        _drive(worker, scenario)


async def _each_done(jobs: list[Job], tokens: int) -> None:
    """Each job's events until its `Done`, which generated `tokens` tokens."""
    for job in jobs:
        while not isinstance(event := await asyncio.wait_for(job.events.get(), 30), Done):
            pass
        assert len(event.gen.tokens) == tokens


def _drive(worker: Worker, scenario) -> None:
    """`scenario()` run on an event loop of its own, the worker stopped after it however it ends."""
    try:
        asyncio.run(scenario())
    finally:
        worker.stop()
