"""Dedicated I/O threads that read expert bytes into slot memory in pieces, most urgent first.

A `Request` is one contiguous aligned read (one part of one expert). Requests wait in a priority queue
(lower tuple = sooner); the threads take the most urgent request's next piece (128 KiB by default), so
several threads read consecutive pieces of one request at once and a request is finished before a
less urgent one starts. Each piece is one `preadv` into an aligned destination (io_mode "direct":
O_DIRECT, "pagecache": buffered) or one copy out of a read-only memory map of the file ("mmap": page
faults, like llama.cpp's default path). When the last piece of a request is done, its callback runs on
the I/O thread with None or the first error that failed one of its pieces.

Requests rather than pre-built pieces: building one Python object per 128 KiB piece cost the compute
thread about 3 ms per layer of a Qwen3-30B-shaped model (72 pieces per expert) with the disk idle.
"""

from __future__ import annotations

import errno
import fcntl
import heapq
import itertools
import logging
import mmap
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from moestream.errors import CheckpointChangedError, ExpertReadError
from moestream.io.memory import copy_mapped

log = logging.getLogger("moestream.io")
IO_MODES = ("direct", "pagecache", "mmap")
ALIGN = 4096
# An I/O thread whose read returned needs the GIL to queue its next read; with CPython's default 5 ms
# switch interval it can wait that long behind a compute thread running Python (the CUDA path, which
# mostly enqueues kernels), leaving the disk idle. 200 us keeps a read in flight per thread.
SWITCH_INTERVAL_S = float(os.environ.get("MOESTREAM_SWITCH_INTERVAL", "0.0002"))


@dataclass(frozen=True)
class FileIdentity:
    """What says a file is still the one that was opened: a rewrite in place (overwritten, truncated, a
    `cp` over it) changes the size or the mtime of the open file; a replacement (a new file renamed over
    it) or a removal changes what the path names, not the open file."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class OpenFile:
    """One checkpoint file as a reader sees it."""

    path: str
    fd: int
    size: int
    direct: bool
    mapping: mmap.mmap | None = None
    map_address: int = 0
    identity: FileIdentity | None = None  # when the file was first opened (`CheckpointFiles`)

    def change(self) -> str | None:
        """How the bytes under the open descriptor differ from when the file was first opened (None:
        unchanged). What the path names now does not matter here: see `CheckpointFiles.replaced`."""
        now = os.fstat(self.fd)  # compared field by field: no FileIdentity made (a check per forward)
        was = self.identity
        if was is None:
            return None
        if now.st_size != was.size:
            return f"its size changed from {was.size} to {now.st_size} bytes"
        if now.st_mtime_ns != was.mtime_ns:
            return "it was modified"
        return None


@dataclass(frozen=True)
class _Held:
    fd: int
    identity: FileIdentity


class CheckpointFiles:
    """The checkpoint files as they were first opened, each held open by one read-only descriptor until
    `close`; a reader's descriptors are reopened from these (`reopen`), so that a reader built later
    (`Engine.restream`) reads the file the model was loaded from, not whatever the path names by then.

    A file replaced under the process (a new file renamed over it: how huggingface_hub and most download
    tools write) or removed keeps its bytes under the held descriptor: the process goes on reading exactly
    the bytes it loaded, and says once (a RuntimeWarning, and `notices`) that a restart loads the new file.
    """

    def __init__(self, paths: list[str] | tuple[str, ...] = ()) -> None:
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self.notices: dict[str, str] = {}  # path -> what was said about it, once
        try:
            for path in paths:
                self.hold(path)
        except BaseException:
            self.close()
            raise
        # a half-built engine's descriptors go back when it is collected, not at exit
        self._finalizer = weakref.finalize(self, _close_all, self._held)

    def hold(self, path: str) -> _Held:
        """Open `path` (once) and remember what it is."""
        with self._lock:
            held = self._held.get(path)
            if held is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as exc:
                    raise ExpertReadError(f"cannot open {path}: {exc.strerror}") from None
                held = self._held[path] = _Held(fd, FileIdentity.of(os.fstat(fd)))
            return held

    def identity(self, path: str) -> FileIdentity:
        return self.hold(path).identity

    def reopen(self, path: str, direct: bool) -> int:
        """A new descriptor of the held file (the same open file: a duplicate, with O_DIRECT set or
        cleared as asked).

        Raises:
            OSError: EINVAL where the file system refuses O_DIRECT.
        """
        fd = os.dup(self.hold(path).fd)
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            wanted = flags | os.O_DIRECT if direct else flags & ~os.O_DIRECT
            if wanted != flags:
                fcntl.fcntl(fd, fcntl.F_SETFL, wanted)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def replaced(self, path: str) -> str | None:
        """What became of the path since the file was first opened, when it no longer names that file
        (another file in its place, or none); said once per file, as a RuntimeWarning, and kept in
        `notices`. None while the path still names the held file."""
        held = self._held.get(path)
        if held is None or path in self.notices:
            return None
        try:
            st = os.stat(path)
            same = (st.st_dev, st.st_ino) == (held.identity.device, held.identity.inode)
            now = None if same else "replaced"
        except FileNotFoundError:
            now = "removed"
        except OSError:
            return None  # cannot be examined now: nothing to say about the file that is held
        if now is None:
            return None
        if now == "replaced":
            what = "was replaced on disk (another file is in its place)"
            after = "a restart loads the new file"
        else:
            what = "was removed from disk"
            after = "a restart will not find it"
        notice = (
            f"checkpoint file {path} {what} since it was opened; moestream goes on computing with the file "
            f"it opened, whose bytes are unchanged: {after}"
        )
        with self._lock:
            if path in self.notices:
                return None
            self.notices[path] = notice
        warnings.warn(notice, RuntimeWarning, stacklevel=2)
        return notice

    def close(self) -> None:
        _close_all(self._held)


def _close_all(held: dict[str, _Held]) -> None:
    for entry in held.values():
        try:
            os.close(entry.fd)
        except OSError:
            pass
    held.clear()


@dataclass(order=True)
class Request:
    """A read of `length` bytes at `offset` into `dest` (an aligned memoryview of that length), done in
    pieces of `piece` bytes. Only the first `needed` bytes must arrive: an aligned read may run past
    the end of the file."""

    priority: tuple
    seq: int
    file: OpenFile = field(compare=False)
    offset: int = field(compare=False)
    length: int = field(compare=False)
    needed: int = field(compare=False)
    dest: memoryview = field(compare=False)
    dest_address: int = field(compare=False)
    piece: int = field(compare=False)
    on_done: Callable[[BaseException | None], None] = field(compare=False)
    # owned by the reader (under its lock)
    cursor: int = field(default=0, compare=False)  # start of the next piece to hand out
    in_flight: int = field(default=0, compare=False)
    error: BaseException | None = field(default=None, compare=False)


class Reader:
    """Owns the checkpoint's file descriptors and the I/O threads."""

    def __init__(self, io_mode: str = "direct", threads: int = 4) -> None:
        if io_mode not in IO_MODES:
            raise ValueError(f"io_mode must be one of {', '.join(IO_MODES)}, got {io_mode!r}")
        if threads < 1:
            raise ValueError(f"io_threads must be at least 1, got {threads}")
        self.io_mode = io_mode
        self.fallback_reason: str | None = None
        # the files as first opened; an engine gives its own (`use_files`), held from load to close
        self.files = CheckpointFiles()
        self._owns_files = True
        self._files: dict[str, OpenFile] = {}
        self._heap: list[Request] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        if SWITCH_INTERVAL_S > 0:
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.bytes_read = 0  # bytes asked of the file system (aligned lengths)
        # how busy the disk is, for the prefetch gate: bytes queued and not handed to a thread yet,
        # pieces being read, and the time with neither (idle), all under `_cond`
        self._pending = 0
        self._reading = 0
        self._idle_s = 0.0
        self._idle_since: float | None = time.perf_counter()
        self._threads = [
            threading.Thread(target=self._run, name=f"moestream-io-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def use_files(self, files: CheckpointFiles) -> None:
        """Read the files as `files` holds them (an engine's, held from load to close) instead of the
        reader's own; before anything is opened."""
        if self._files:
            raise RuntimeError("use_files comes before the first open")
        self.files.close()
        self.files, self._owns_files = files, False

    def open(self, path: str) -> OpenFile:
        """Open (once) a checkpoint file for this reader's io mode: the file `files` holds."""
        if path in self._files:
            return self._files[path]
        direct = self.io_mode == "direct"
        try:
            fd = self.files.reopen(path, direct)
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                fd, direct = self._fall_back_to_pagecache(path), False
            else:
                raise ExpertReadError(f"cannot open {path}: {exc.strerror}") from None
        st = os.fstat(fd)
        # the identity of the file when first opened: one rewritten since is refused by `check_files`
        identity = self.files.identity(path)
        handle = OpenFile(path=path, fd=fd, size=st.st_size, direct=direct, identity=identity)
        if self.io_mode == "mmap" and handle.size:
            handle.mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            handle.map_address = np.frombuffer(handle.mapping, dtype=np.uint8).ctypes.data
        self._files[path] = handle
        return handle

    def _fall_back_to_pagecache(self, path: str) -> int:
        self.fallback_reason = f"the file system holding {path} refuses O_DIRECT"
        warnings.warn(
            f"{self.fallback_reason}; reading it through the page cache instead", RuntimeWarning, stacklevel=3
        )
        self.io_mode = "pagecache"
        return self.files.reopen(path, False)

    def check_files(self) -> None:
        """Refuse to go on reading a checkpoint file whose bytes changed under the open descriptor since
        it was opened (overwritten in place, truncated, a `cp` over it): they would no longer be the
        weights the model was built with. A file replaced by rename or removed is only said, once
        (`CheckpointFiles.replaced`): the open descriptor still reads the bytes that were loaded.

        Raises:
            CheckpointChangedError: naming the first changed file and how it changed.
        """
        for handle in list(self._files.values()):
            change = handle.change()
            if change is not None:
                raise CheckpointChangedError(_changed_message(handle.path, change))
            self.files.replaced(handle.path)

    def submit(self, requests: list[Request]) -> None:
        """Queue requests; each one's callback fires exactly once."""
        if not requests:
            return
        with self._cond:
            if self._closed:
                raise ExpertReadError("the reader is closed (the engine was closed)")
            pieces = 0
            for request in requests:
                heapq.heappush(self._heap, request)
                pieces += -(-request.length // request.piece)
                self._pending += request.length - request.cursor
            if self._idle_since is not None:
                self._idle_s += time.perf_counter() - self._idle_since
                self._idle_since = None
            self._cond.notify(min(pieces, len(self._threads)))

    def pending_bytes(self) -> int:
        """Bytes queued that no I/O thread has started on yet."""
        with self._cond:
            return self._pending

    def idle_seconds(self) -> float:
        """Seconds so far with nothing queued and nothing being read."""
        with self._cond:
            idle = self._idle_s
            if self._idle_since is not None:
                idle += time.perf_counter() - self._idle_since
            return idle

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
        if self._owns_files:
            self.files.close()

    def _run(self) -> None:
        # Ctrl-C and SIGTERM are for the main thread, whose handlers Python runs: a process-directed
        # signal the kernel handed to this thread would not wake the main thread from a blocking read
        # (a chat prompt waiting in readline)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        while True:
            with self._cond:
                while not self._heap and not self._closed:
                    self._cond.wait()
                if not self._heap:
                    return
                request = self._heap[0]
                start = request.cursor
                request.cursor += request.piece
                if request.cursor >= request.length:
                    heapq.heappop(self._heap)
                request.in_flight += 1
                self._pending -= min(request.piece, request.length - start)
                self._reading += 1
            error: BaseException | None = None
            got = 0
            try:
                got = self._read(request, start)
            except (ExpertReadError, CheckpointChangedError) as exc:
                error = exc
            except OSError as exc:
                error = ExpertReadError(
                    f"reading {request.file.path} at offset {request.offset + start} failed: {exc.strerror}"
                )
            except Exception as exc:  # never let a bug kill the thread: the layer would wait forever
                error = ExpertReadError(
                    f"reading {request.file.path} at offset {request.offset + start} failed: {exc!r}"
                )
            if error is not None:
                error = self._explain(request.file, error)
            with self._cond:
                self.bytes_read += got
                request.in_flight -= 1
                self._reading -= 1
                if not self._reading and not self._heap:
                    self._idle_since = time.perf_counter()
                if error is not None and request.error is None:
                    request.error = error
                finished = request.in_flight == 0 and request.cursor >= request.length
            if finished:
                try:
                    request.on_done(request.error)
                except Exception:  # a callback's bug must not end the thread: later reads would never run
                    log.exception("a read's completion callback failed")

    @staticmethod
    def _explain(handle: OpenFile, error: BaseException) -> BaseException:
        """A read that failed because the file changed under the process says so, naming the file."""
        try:
            change = handle.change()
        except OSError:
            return error
        return error if change is None else CheckpointChangedError(_changed_message(handle.path, change))

    def _read(self, request: Request, start: int) -> int:
        """Read the piece of `request` that starts `start` bytes into it. Returns the bytes read."""
        handle = request.file
        length = min(request.piece, request.length - start)
        offset = request.offset + start
        if handle.mapping is not None:
            got = max(0, min(length, handle.size - offset))
            # touching a mapped page past the file's current end is SIGBUS, which kills the process
            # with no message: a file shrunk since it was mapped is an error before the copy, and one
            # that shrinks during it ends the copy short (copy_mapped: through the kernel, not a fault)
            now = os.fstat(handle.fd).st_size
            if now < offset + got:
                raise CheckpointChangedError(
                    _changed_message(handle.path, f"its size changed from {handle.size} to {now} bytes")
                )
            got = copy_mapped(request.dest_address + start, handle.map_address + offset, got)
        else:
            got = 0
            while got < length:
                want = length - got
                n = os.preadv(handle.fd, [request.dest[start + got : start + length]], offset + got)
                got += n
                # a short O_DIRECT read means end of file; retrying would use an unaligned offset
                if n == 0 or (handle.direct and n < want):
                    break
        wanted = min(length, request.needed - start)
        if got < wanted:
            raise ExpertReadError(
                f"short read from {handle.path} at offset {offset}: got {got} of {wanted} bytes "
                "(the file is truncated or changed since it was opened)"
            )
        return got


def _changed_message(path: str, change: str) -> str:
    return (
        f"checkpoint file {path} changed since it was opened ({change}); the weights in memory no "
        "longer match it, so moestream stops rather than compute with a mix: restart once the checkpoint "
        "is complete"
    )
