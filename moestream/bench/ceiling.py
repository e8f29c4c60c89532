"""The disk's read rate for expert misses, measured with the engine's own reader in a few seconds.

Random routed experts of the checkpoint are read whole, part by part, with the same aligned reads the
expert cache issues (`plan_parts`), through a `Reader` with the run's io mode, I/O threads and piece
size. Like a layer's misses, `depth` experts (top-k) are queued at once, so every thread has pieces
to read. No cache and no compute: what the disk gives this access pattern (the ceiling of miss-bound
decode; `benchmarks/io_ceiling.py` measures the same with bare `preadv` calls).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from moestream.cache.slots import PartRead, plan_parts, slot_bytes
from moestream.io.memory import AlignedBuffer
from moestream.io.reader import Reader, Request
from moestream.store.experts import ExpertMap


@dataclass(frozen=True)
class ReadRate:
    """Bytes read in `seconds` by `io_threads` threads in pieces of `piece` bytes (io mode `io_mode`)."""

    nbytes: int
    seconds: float
    io_mode: str
    io_threads: int
    piece: int
    measured: bool = True  # False: given by the user (`--read-rate`), not measured
    samples: tuple[float, ...] = ()  # bytes/s of each measurement combined into this one

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds

    @classmethod
    def combine(cls, parts: list[ReadRate]) -> ReadRate:
        """Several measurements as one: all their bytes over all their seconds."""
        first = parts[0]
        return cls(
            sum(p.nbytes for p in parts),
            sum(p.seconds for p in parts),
            first.io_mode,
            first.io_threads,
            first.piece,
            samples=tuple(p.bytes_per_s for p in parts),
        )

    def line(self) -> str:
        rate = f"{self.bytes_per_s / (1 << 30):.3f} GiB/s"
        if not self.measured:
            return f"{rate} (given)"
        each = ""
        if len(self.samples) > 1:
            each = f" in {len(self.samples)} samples of " + ", ".join(
                f"{x / (1 << 30):.3f}" for x in self.samples
            )
        return (
            f"{rate} ({self.nbytes / (1 << 30):.2f} GiB of random whole experts in {self.seconds:.1f} s"
            f"{each}; io {self.io_mode}, {self.io_threads} io threads, {self.piece >> 10} KiB pieces)"
        )


def measure_read_rate(
    emap: ExpertMap,
    seconds: float = 2.5,
    io_mode: str = "direct",
    io_threads: int = 4,
    piece: int = 128 << 10,
    depth: int = 8,
    seed: int = 0,
) -> ReadRate:
    """Read random whole experts of `emap` for about `seconds`, `depth` of them in flight at a time."""
    keys = sorted(emap.units)
    plans = {key: plan_parts(emap.kinds, emap.units[key]) for key in keys}
    slot = max(slot_bytes(emap.units[key]) for key in keys)
    buffer = AlignedBuffer(slot * depth)
    free = list(range(depth))
    cond = threading.Condition()
    done = {"bytes": 0, "error": None}
    reader = Reader(io_mode, io_threads)
    rng = random.Random(seed)
    try:
        began = time.perf_counter()
        deadline = began + seconds
        while time.perf_counter() < deadline:
            with cond:
                while not free and done["error"] is None:
                    cond.wait()
                if done["error"] is not None:
                    break
                index = free.pop()
            expert = plans[rng.choice(keys)]
            reader.submit(_expert_reads(reader, expert, buffer, index, slot, piece, cond, free, done))
        with cond:  # let the experts in flight finish: their bytes count, and so does their time
            while len(free) < depth:
                cond.wait()
        elapsed = time.perf_counter() - began
        if done["error"] is not None:
            raise done["error"]
        return ReadRate(done["bytes"], elapsed, reader.io_mode, io_threads, piece)
    finally:
        reader.close()
        buffer.free()


def _expert_reads(
    reader: Reader,
    plan: dict[str, list[PartRead]],
    buffer: AlignedBuffer,
    index: int,
    slot: int,
    piece: int,
    cond: threading.Condition,
    free: list[int],
    done: dict[str, Any],
) -> list[Request]:
    """One request per part of one expert into slot `index`; the last part to finish frees the slot."""
    parts = [part for reads in plan.values() for part in reads]
    left = [len(parts)]
    base = index * slot

    def finished(nbytes: int, error: BaseException | None) -> None:
        with cond:
            done["bytes"] += nbytes if error is None else 0
            if error is not None and done["error"] is None:
                done["error"] = error
            left[0] -= 1
            if left[0] == 0:
                free.append(index)
                cond.notify_all()

    return [
        Request(
            priority=(0, reader.next_seq()),
            seq=reader.next_seq(),
            file=reader.open(part.ref.file),
            offset=part.file_offset,
            length=part.length,
            needed=part.head + part.ref.nbytes,
            dest=buffer.view[base + part.region_offset : base + part.region_offset + part.length],
            dest_address=buffer.address + base + part.region_offset,
            piece=piece,
            on_done=lambda err, n=part.length: finished(n, err),
        )
        for part in parts
    ]
