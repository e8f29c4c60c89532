"""The expert cache's lock, which on the main thread also holds SIGINT and SIGTERM back while held."""

from __future__ import annotations

import _signal
import signal
import threading

_HELD_SIGNALS = {int(signal.SIGINT), int(signal.SIGTERM)}
# the C function: `signal.pthread_sigmask` makes an enum of each signal of the mask it returns, which
# cost more than the system call (a lock held and released: 3.3 us, 1.9 with the C function, on the
# 2-core dev VM; the ggml runner takes it once a decoded token); the mask saved is then a set of ints,
# which SIG_SETMASK takes as well
_sigmask = _signal.pthread_sigmask


class BookkeepingLock:
    """The cache's lock; on the main thread it also holds SIGINT and SIGTERM back while held. Python
    raises KeyboardInterrupt between any two bytecodes of the main thread, and one raised between two
    steps of the bookkeeping (a slot given before its reads were counted, a pin taken and not recorded)
    left the cache inconsistent: the next request failed (`KeyError` in a hit's kinds, found by a Ctrl-C
    test). Held back, the signal is delivered when the lock is released, between two whole changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._masks = threading.local()

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._masks.saved = _sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        saved = getattr(self._masks, "saved", None)
        if saved is not None:
            self._masks.saved = None
            _sigmask(signal.SIG_SETMASK, saved)
