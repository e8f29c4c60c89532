"""Dedicated I/O threads that read pieces of expert bytes into slot memory, most urgent first.

Pieces come from a priority queue (lower tuple = sooner). Each piece is one `preadv` into an aligned
destination (io_mode "direct": O_DIRECT, "pagecache": buffered) or one copy out of a read-only memory
map of the file ("mmap": page faults, like llama.cpp's default path). When a piece is done, its callback
runs on the I/O thread with None or the error that failed it.
"""
from __future__ import annotations

import errno
import heapq
import itertools
import mmap
import os
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from moestream.errors import ExpertReadError
from moestream.io.memory import memmove

IO_MODES = ("direct", "pagecache", "mmap")
ALIGN = 4096
# An I/O thread whose read returned needs the GIL to queue its next read; with CPython's default 5 ms
# switch interval it can wait that long behind a compute thread running Python (the CUDA path, which
# mostly enqueues kernels), leaving the disk idle. 200 us keeps a read in flight per thread.
SWITCH_INTERVAL_S = float(os.environ.get("MOESTREAM_SWITCH_INTERVAL", "0.0002"))


@dataclass
class OpenFile:
    """One checkpoint file as a reader sees it."""

    path: str
    fd: int
    size: int
    direct: bool
    mapping: mmap.mmap | None = None
    map_address: int = 0


@dataclass(order=True)
class Piece:
    """A read of `length` bytes at `offset` into `dest` (an aligned memoryview of that length).

    Only the first `needed` bytes must arrive: an aligned read may run past the end of the file.
    """

    priority: tuple
    seq: int
    file: OpenFile = field(compare=False)
    offset: int = field(compare=False)
    length: int = field(compare=False)
    needed: int = field(compare=False)
    dest: memoryview = field(compare=False)
    dest_address: int = field(compare=False)
    on_done: Callable[[BaseException | None], None] = field(compare=False)


class Reader:
    """Owns the checkpoint's file descriptors and the I/O threads."""

    def __init__(self, io_mode: str = "direct", threads: int = 4) -> None:
        if io_mode not in IO_MODES:
            raise ValueError(f"io_mode must be one of {', '.join(IO_MODES)}, got {io_mode!r}")
        if threads < 1:
            raise ValueError(f"io_threads must be at least 1, got {threads}")
        self.io_mode = io_mode
        self.fallback_reason: str | None = None
        self._files: dict[str, OpenFile] = {}
        self._heap: list[Piece] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        if SWITCH_INTERVAL_S > 0:
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.bytes_read = 0  # bytes asked of the file system (aligned lengths)
        self._threads = [
            threading.Thread(target=self._run, name=f"moestream-io-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def open(self, path: str) -> OpenFile:
        """Open (once) a checkpoint file for this reader's io mode."""
        if path in self._files:
            return self._files[path]
        direct = self.io_mode == "direct"
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                fd, direct = self._fall_back_to_pagecache(path), False
            else:
                raise ExpertReadError(f"cannot open {path}: {exc.strerror}") from None
        handle = OpenFile(path=path, fd=fd, size=os.fstat(fd).st_size, direct=direct)
        if self.io_mode == "mmap" and handle.size:
            handle.mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            handle.map_address = np.frombuffer(handle.mapping, dtype=np.uint8).ctypes.data
        self._files[path] = handle
        return handle

    def _fall_back_to_pagecache(self, path: str) -> int:
        self.fallback_reason = f"the file system holding {path} refuses O_DIRECT"
        warnings.warn(f"{self.fallback_reason}; reading it through the page cache instead", RuntimeWarning, stacklevel=3)
        self.io_mode = "pagecache"
        return os.open(path, os.O_RDONLY)

    def submit(self, pieces: list[Piece]) -> None:
        """Queue pieces; each one's callback fires exactly once."""
        with self._cond:
            for piece in pieces:
                heapq.heappush(self._heap, piece)
            self._cond.notify(len(pieces))

    def next_seq(self) -> int:
        return next(self._seq)

    def close(self) -> None:
        """Stop the threads (after the queue drains) and close the files."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        for handle in self._files.values():
            if handle.mapping is not None:
                handle.mapping = None  # the numpy view keeps the map alive until collected
            os.close(handle.fd)
        self._files.clear()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._closed:
                    self._cond.wait()
                if not self._heap:
                    return
                piece = heapq.heappop(self._heap)
            error: BaseException | None = None
            try:
                self._read(piece)
            except ExpertReadError as exc:
                error = exc
            except OSError as exc:
                error = ExpertReadError(f"reading {piece.file.path} at offset {piece.offset} failed: {exc.strerror}")
            piece.on_done(error)

    def _read(self, piece: Piece) -> None:
        handle = piece.file
        if handle.mapping is not None:
            got = max(0, min(piece.length, handle.size - piece.offset))
            memmove(piece.dest_address, handle.map_address + piece.offset, got)
        else:
            got = 0
            while got < piece.length:
                want = piece.length - got
                n = os.preadv(handle.fd, [piece.dest[got:]], piece.offset + got)
                got += n
                # a short O_DIRECT read means end of file; retrying would use an unaligned offset
                if n == 0 or (handle.direct and n < want):
                    break
        with self._cond:
            self.bytes_read += got
        if got < piece.needed:
            raise ExpertReadError(
                f"short read from {handle.path} at offset {piece.offset}: got {got} of {piece.needed} bytes "
                "(the file is truncated or changed since it was opened)"
            )
