"""The prefetch gate: score classes, the measured precision that makes a guess confident, and the
idle-time probe of `--prefetch auto`, against a fake disk and clock."""

from __future__ import annotations

import pytest

import moestream.runtime.prefetch as P
from moestream.runtime.prefetch import PrefetchGate, score_class


class FakeDisk:
    def __init__(self) -> None:
        self.idle, self.pending = 0.0, 0

    def idle_seconds(self) -> float:
        return self.idle

    def pending_bytes(self) -> int:
        return self.pending


def test_score_classes_are_doublings_of_the_uniform_score() -> None:
    n = 64  # uniform score 1/64
    assert [score_class(s / n, n) for s in (0.5, 0.99, 1.0, 1.9, 2.0, 3.9, 4.0, 7.9, 8.0, 40.0)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
        4,
        4,
    ]


def test_a_class_becomes_confident_once_its_measured_precision_is_high_enough() -> None:
    gate = PrefetchGate("on", FakeDisk(), layers_per_token=2, queue_full_bytes=1)
    high, low = 10 / 64, 0.5 / 64  # score classes 4 and 0
    for _ in range(20):
        # layer 1's guess for layer 2: expert 5 with a high score (always right), 9 with a low one (never)
        assert gate.choose(2, 64, [[(5, high), (9, low)]]) in ([], [5])
        gate.observe(2, [[5, 7]])
    assert gate.precision(4) == (1 + 20) / (2 + 20) and gate.precision(0) == 1 / (2 + 20)
    assert gate.choose(2, 64, [[(5, high), (9, low)], [(6, high), (5, high)]]) == [5, 6]
    # a guess is scored only against the layer it was made for, and only once
    gate.observe(3, [[9]])
    gate.observe(2, [[9], [9]])
    gate.observe(2, [[9], [9]])
    assert gate.precision(4) == (1 + 20) / (2 + 23) and gate.precision(0) == (1 + 1) / (2 + 21)


def test_on_always_allows_and_auto_follows_the_idle_probe() -> None:
    disk, now = FakeDisk(), [0.0]
    on = PrefetchGate("on", disk, layers_per_token=2, queue_full_bytes=100)
    disk.pending = 1000
    assert all(on.allow() for _ in range(40))
    disk.pending = 0
    auto = PrefetchGate("auto", disk, layers_per_token=2, queue_full_bytes=100, clock=lambda: now[0])

    def token(idle: float, seconds: float = 1.0) -> list[bool]:
        out = [auto.allow(), auto.allow()]  # its two layers
        now[0] += seconds
        disk.idle += idle * seconds
        return out

    assert token(idle=0.2) == [False, False]  # token 0 is a probe: the disk idled 20% of it
    assert token(idle=0.0) == [True, True] and auto.idle_share == pytest.approx(0.2)
    assert all(token(idle=0.0) == [True, True] for _ in range(P.PROBE_EVERY - 2))
    assert token(idle=0.01) == [False, False]  # the next probe: 1% idle, below IDLE_MIN
    assert all(token(idle=0.5) == [False, False] for _ in range(P.PROBE_EVERY - 1))
    assert not auto.enabled and auto.idle_share == pytest.approx(0.01)
    assert token(idle=0.3) == [False, False]
    disk.pending = 100  # a full queue: skip, even when the probe says the disk idles
    assert token(idle=0.0) == [False, False] and auto.enabled and auto.skipped_busy == 2
    disk.pending = 99
    assert token(idle=0.0) == [True, True]


def test_modes_and_errors() -> None:
    with pytest.raises(ValueError, match="on or auto"):
        PrefetchGate("off", FakeDisk(), 1, 1)
    assert P.MODES == ("off", "on", "auto")


def test_the_reader_counts_its_idle_time_and_queue(tiny_dir) -> None:
    import time

    import moestream

    path = tiny_dir("qwen3_moe", experts=16, top_k=4)
    with moestream.load(str(path), cache="64MiB", preload=False) as engine:  # read while it runs
        reader = engine.reader
        start, idle0 = time.perf_counter(), reader.idle_seconds()
        engine.generate([5, 17, 33], max_tokens=4, ignore_eos=True)
        wall, idle = time.perf_counter() - start, reader.idle_seconds() - idle0
        assert reader.bytes_read > 0 and reader.pending_bytes() == 0
        assert 0 < idle < wall  # it read for part of the time, idled for the rest
        time.sleep(0.05)
        assert reader.idle_seconds() - idle0 >= idle + 0.05  # nothing queued: idle keeps counting
