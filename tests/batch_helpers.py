"""What the batch tests share: requests made to take their slots together (so that one round feeds all
their prompts, whatever order their threads run in)."""

from __future__ import annotations

import threading
from typing import Any


def arrive_together(engine: Any, n: int) -> None:
    """Each of the next `n` requests holds its slot until all `n` hold theirs (a barrier in
    `Batcher.acquire`): no round runs before every one has handed over its first forward."""
    barrier, acquire = threading.Barrier(n, timeout=60), engine.batch.acquire

    def acquired(ids: list[int]) -> int:
        slot = acquire(ids)
        barrier.wait()
        return slot

    engine.batch.acquire = acquired
