"""`HeldExperts`: some of one layer's routed experts held in the expert cache's host slots for a copy out
of them (a GPU tier's misses): hits pinned at once, misses given slots and read from disk by the cache's
reader, each (expert, kind) said once as its bytes land, so a copy of the gate can start while the up and
down are still read. The cache does the acquiring, pinning, reading and readiness (`open_layer`, one
`LayerJob`); this only turns its events into the graphs' kinds and host slots.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import TracebackType

from moestream.cache.expert_cache import ExpertCache
from moestream.cache.records import LayerJob


class HeldExperts:
    """One layer job of the cache, for copies out of its slots. A context manager: leaving it gives back
    every slot still held (after a failure, as the cache abandons a job: reads in flight keep theirs)."""

    def __init__(self, cache: ExpertCache, job: LayerJob, kinds: dict[str, tuple[str, ...]]) -> None:
        """`kinds`: the cache's kind -> the graphs' kinds it holds (gpt-oss's gate_up: gate and up)."""
        self.cache, self.job, self.kinds = cache, job, kinds
        self._events = len(job.hits + job.misses) * len(kinds)

    @property
    def waiting(self) -> bool:
        """Whether misses wait for a slot that only a `release` can free (the cache is smaller than the
        layer's misses): release each expert as soon as its copies are done."""
        return bool(self.job.pending)

    def landed(self) -> Iterator[tuple[int, tuple[str, ...], int]]:
        """(expert, the graphs' kinds whose bytes are now in its slot, that slot in its size class), once
        per kind of each expert: hits first, then each miss's kinds as they land (gate before up before
        down). Blocks while reads run.

        Raises:
            ExpertReadError: a read failed (the job is abandoned when the context is left).
        """
        while self._events:
            expert, kind, error = self.job.next_event()
            self._events -= 1
            if error is not None:
                raise error
            yield expert, self.kinds[kind], self.cache.state_of((self.job.layer, expert)).slot

    def release(self, expert: int) -> None:
        """Done copying out of `expert`'s slot: evictable again (a waiting miss may take it)."""
        self.job.release(expert)

    def close(self) -> None:
        """Release every expert still held."""
        for expert in sorted(self.job.held):
            self.job.release(expert)

    def __enter__(self) -> HeldExperts:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
        else:
            self.cache.abandon(self.job)
