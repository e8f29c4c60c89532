"""Page-aligned anonymous memory, optionally locked so the kernel never swaps or reclaims it."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import warnings

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
# memmove through ctypes releases the GIL, so mmap-mode readers copy in parallel with compute
memmove = ctypes.memmove


class _IOVec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


try:
    _process_vm_readv = _libc.process_vm_readv
    _process_vm_readv.argtypes = (
        ctypes.c_int,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    )
    _process_vm_readv.restype = ctypes.c_ssize_t
except AttributeError:  # not Linux, or a libc without it
    _process_vm_readv = None


class AlignedBuffer:
    """One anonymous mapping (page aligned, hence O_DIRECT aligned) that slots are carved from."""

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"buffer size must be positive, got {nbytes}")
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self._map)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.locked = False

    def lock(self) -> bool:
        """mlock the whole buffer. Returns False (and warns once) where RLIMIT_MEMLOCK forbids it."""
        if lock_range(self.address, self.nbytes):
            self.locked = True
            return True
        err = ctypes.get_errno()
        warnings.warn(
            f"could not lock {self.nbytes >> 20} MiB of expert cache in memory ({os.strerror(err)}); "
            "running unlocked, so the kernel may swap it out (raise `ulimit -l` or grant CAP_IPC_LOCK)",
            RuntimeWarning,
            stacklevel=2,
        )
        return False

    def unlock(self) -> None:
        if self.locked:
            unlock_range(self.address, self.nbytes)
            self.locked = False

    def free(self) -> None:
        """Give the memory back now: unlock it and drop its pages (the range reads as zeros afterwards),
        then unmap it, unless views of it are still alive (they unmap it when they go)."""
        self.unlock()
        if self._map.closed:
            return
        self._map.madvise(mmap.MADV_DONTNEED)
        try:
            self.view.release()
            self._map.close()
        except BufferError:  # a torch or numpy view still exports it; its pages are gone already
            pass


def lock_range(address: int, nbytes: int) -> bool:
    """mlock bytes the process already holds (the kernel rounds to whole pages). False where refused."""
    return _libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) == 0


def unlock_range(address: int, nbytes: int) -> None:
    _libc.munlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes))


def drop_pages(address: int, nbytes: int) -> int:
    """Give back the pages wholly inside `nbytes` at `address` (anonymous memory the process keeps
    allocated: they read as zeros afterwards; the partial pages at either end, which other allocations
    may share, are left). The range must not be locked. Returns the bytes given back.

    Raises:
        OSError: the kernel refused (a locked page, a range not mapped).
    """
    start = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (address + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= start:
        return 0
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED):
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_DONTNEED) of {end - start} bytes: {os.strerror(err)}")
    return end - start


def copy_mapped(dest: int, source: int, nbytes: int) -> int:
    """Copy `nbytes` out of a file mapping at `source` to `dest` through the kernel (process_vm_readv
    on this process), which returns an error where touching the page itself would be SIGBUS: a page past
    the end of a file truncated since it was mapped kills the process on a plain copy, whatever was
    checked before it. Returns the bytes copied, fewer than `nbytes` when the mapping ends short of them.
    Where the kernel refuses the call (an old kernel or a seccomp filter) the copy is a plain memmove.
    Releases the GIL, as memmove does."""
    global _process_vm_readv
    got, pid = 0, os.getpid()
    while got < nbytes and _process_vm_readv is not None:
        local = _IOVec(dest + got, nbytes - got)
        remote = _IOVec(source + got, nbytes - got)
        n = _process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n > 0:
            got += n
            continue
        err = ctypes.get_errno()
        if n == 0 or err == errno.EFAULT:  # the mapping has no page there any more: the file shrank
            return got
        if err == errno.EINTR:
            continue
        _process_vm_readv = None  # ENOSYS, EPERM: a plain copy from now on
    if got < nbytes:
        memmove(dest + got, source + got, nbytes - got)
    return nbytes
