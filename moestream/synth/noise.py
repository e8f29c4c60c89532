"""Random weight bytes, cheap enough to write a checkpoint at disk speed.

Drawing fresh normals for every tensor of a multi-GiB checkpoint costs more than writing it. Instead
one seeded draw fills a base buffer of N(0, 1) samples whose length PERIOD is a prime number of
elements (about 8.4 M). Every chunk of every tensor (a chunk holds at most PERIOD elements and at
most 64 MiB) is a window of that buffer, scaled to the tensor's std and cast to its dtype, starting
at offset (start + k * step) mod PERIOD, where k counts the chunks written so far. So:

- values are genuine gaussian samples with the requested std (scaled copies are made once per
  (dtype, std) and then only sliced: a chunk costs no arithmetic and no copy);
- the window offsets of the first PERIOD chunks are all different (PERIOD is prime and 0 < step <
  PERIOD), so no two experts hold the same bytes and a cache that returns the wrong expert is caught;
- a chunk never repeats itself: a window is at most one period long. A reader that is off by any
  number of bytes, 4096-multiples included, reads values that differ from the expected ones, which
  a period of 2**k elements would hide;
- the output depends only on the seed and the order of the tensors, so a synth is reproducible.

Chunk k's window is a function of k alone, so a writer that knows how many chunks the tensors before
a tensor drew (`gaussian_chunks`, `byte_chunks`) can produce that tensor out of order (`at=k`), and
several tensors at once from threads: the GGUF writer regroups per-expert tensors this way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch

PERIOD = 8_388_593  # a prime: 2**23 - 15 elements
MAX_CHUNK_BYTES = 64 << 20
_GOLDEN = 0.6180339887498949  # spreads consecutive windows far apart in the base buffer


class NoiseSource:
    """Seeded source of gaussian and uniform-byte chunks, handed out as 1-D uint8 tensors."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self._normal = torch.randn(PERIOD, generator=gen, dtype=torch.float32)
        raw = torch.randint(0, 256, (PERIOD,), generator=gen, dtype=torch.uint8)
        self._bytes = torch.cat([raw, raw])  # doubled, so a window never wraps around
        self._scaled: dict[tuple[torch.dtype, float], torch.Tensor] = {}
        self._step = int(PERIOD * _GOLDEN) + seed % 997
        self._first = (seed * 2_654_435_761) % PERIOD
        self._lock = threading.Lock()
        self.chunks_drawn = 0

    def offset_of(self, k: int) -> int:
        """Start, in the base buffer, of the window of chunk number `k`."""
        return (self._first + k * self._step) % PERIOD

    def _offsets(self, at: int | None) -> Iterator[int]:
        """Window starts of consecutive chunks: from the running count, or from chunk `at` on."""
        k = at
        while True:
            if k is None:
                offset = self.offset_of(self.chunks_drawn)
                self.chunks_drawn += 1
                yield offset
            else:
                yield self.offset_of(k)
                k += 1

    def _scaled_buffer(self, std: float, dtype: torch.dtype) -> torch.Tensor:
        key = (dtype, float(std))
        with self._lock:  # writer threads may ask for the same buffer at once
            if key not in self._scaled:
                one = (self._normal * std).to(dtype)
                self._scaled[key] = torch.cat([one, one])
            return self._scaled[key]

    def gaussian(
        self, numel: int, std: float, dtype: torch.dtype, at: int | None = None
    ) -> Iterator[torch.Tensor]:
        """Bytes of `numel` N(0, std**2) values of `dtype`, in chunks of at most 64 MiB.

        `at`: start from chunk number `at` and leave the running count alone (random access).
        """
        buf = self._scaled_buffer(std, dtype)
        chunk = gaussian_chunk_elements(buf.element_size())
        remaining = numel
        offsets = self._offsets(at)
        while remaining > 0:
            n = min(chunk, remaining)
            start = next(offsets)
            yield buf[start : start + n].view(torch.uint8)
            remaining -= n

    def uniform_bytes(self, nbytes: int, at: int | None = None) -> Iterator[torch.Tensor]:
        """`nbytes` independent-looking uniform random bytes (for MXFP4 blocks and scales)."""
        remaining = nbytes
        offsets = self._offsets(at)
        while remaining > 0:
            n = min(PERIOD, remaining)
            start = next(offsets)
            yield self._bytes[start : start + n]
            remaining -= n


def gaussian_chunk_elements(itemsize: int) -> int:
    """Elements per chunk of `gaussian` for a dtype of `itemsize` bytes."""
    return min(PERIOD, MAX_CHUNK_BYTES // itemsize)


def gaussian_chunks(numel: int, itemsize: int) -> int:
    """How many chunks `gaussian` draws for `numel` values of `itemsize` bytes."""
    return -(-numel // gaussian_chunk_elements(itemsize))


def byte_chunks(nbytes: int) -> int:
    """How many chunks `uniform_bytes` draws for `nbytes` bytes."""
    return -(-nbytes // PERIOD)


def zeros(nbytes: int) -> Iterator[torch.Tensor]:
    """`nbytes` zero bytes in chunks of at most 64 MiB (biases and zero-initialised tensors)."""
    block = torch.zeros(min(nbytes, MAX_CHUNK_BYTES), dtype=torch.uint8)
    remaining = nbytes
    while remaining > 0:
        n = min(block.numel(), remaining)
        yield block[:n]
        remaining -= n


def tensor_bytes(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The raw bytes of a (small, in-memory) tensor as one chunk."""
    flat = tensor.detach().contiguous().reshape(-1)
    yield flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
