"""ggml's repacked CPU kernels for block-quantized weights (MOESTREAM_GGML_REPACK=1, experimental).

ggml's CPU backend has an "extra" buffer type, `CPU_REPACK`: a tensor placed in such a buffer gets, from
the buffer's init_tensor, the kernels of its type's interleaved layout (`ggml_repack_get_optimal_repack_
type`: Q4_K as `q4_K_8x8` on AVX2, Q4_0, IQ4_NL, ...; none for the rest, Q6_K among them), and its
set_tensor writes the blocks in that layout; ggml_mul_mat(_id) whose weights carry that buffer and
those kernels (`tensor->buffer`, `tensor->extra`) runs them (`ggml_cpu_extra_compute_forward`). llama.cpp
puts its CPU weights there by default (`--no-repack` turns it off).

`Repacker` finds the buffer type through the CPU backend's registry, allocates such buffers and repacks
one matrix at a time into them; a graph's leaf over repacked bytes is then marked with `mark`. Measured
on 2 cores (BENCHMARKS, `benchmarks/repack_probe.py`): a MoE layer's products 1.06x faster at 1 token,
1.39x at 4, slower at a 256-token chunk (0.68x)."""

from __future__ import annotations

import contextlib
import ctypes as C
import os
from collections.abc import Iterator

from moestream.ggml.lib import GgmlTensor, GgmlUnavailableError, Library

REPACK_ENV = "MOESTREAM_GGML_REPACK"


def repack_wanted() -> bool:
    """MOESTREAM_GGML_REPACK: "1" repacks what the CPU path's decode steps compute (experimental), "0" or
    unset does not; another value is refused."""
    value = os.environ.get(REPACK_ENV, "")
    if value not in ("", "0", "1"):
        raise GgmlUnavailableError(f"{REPACK_ENV}={value!r}: say 1 (repack) or 0")
    return value == "1"


class Repacker:
    """ggml's CPU_REPACK buffer type of `lib`, and the buffers allocated from it (freed by `close`)."""

    def __init__(self, lib: Library) -> None:
        self.lib = lib
        base, cpu = lib.base, lib.cpu
        cpu.ggml_backend_cpu_reg.restype = C.c_void_p
        cpu.ggml_backend_cpu_reg.argtypes = []
        base.ggml_backend_reg_dev_get.restype = C.c_void_p
        base.ggml_backend_reg_dev_get.argtypes = [C.c_void_p, C.c_size_t]
        base.ggml_backend_reg_get_proc_address.restype = C.c_void_p
        base.ggml_backend_reg_get_proc_address.argtypes = [C.c_void_p, C.c_char_p]
        reg = cpu.ggml_backend_cpu_reg()
        get = base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        self.buft = None
        if get:
            bufts = C.CFUNCTYPE(C.POINTER(C.c_void_p), C.c_void_p)(get)(base.ggml_backend_reg_dev_get(reg, 0))
            i = 0
            while bufts[i]:
                if _text(base.ggml_backend_buft_name(bufts[i])) == "CPU_REPACK":
                    self.buft = bufts[i]
                    break
                i += 1
        if self.buft is None:
            raise GgmlUnavailableError(
                f"{REPACK_ENV}=1: this ggml's CPU backend has no repacked kernels (CPU_REPACK); unset it"
            )
        self._buffers: list[int] = []

    def alloc(self, nbytes: int) -> tuple[int, int]:
        """A CPU_REPACK buffer of `nbytes`: (its handle, its base address)."""
        handle = self.lib.base.ggml_backend_buft_alloc_buffer(self.buft, nbytes)
        if not handle:
            raise MemoryError(f"ggml could not allocate a repack buffer of {nbytes} bytes")
        self._buffers.append(handle)
        return handle, self.lib.base.ggml_backend_buffer_get_base(handle)

    def repack(self, tensor: int, buffer: int, address: int, source: int) -> int:
        """The matrix leaf `tensor` (no data yet; its type and shape) placed at `address` in `buffer` and
        written there from the blocks as stored at `source`, in its type's repacked layout; returns its
        kernels (`extra`), or 0 where its type has none (nothing written, the leaf left unplaced)."""
        b = self.lib.base
        b.ggml_backend_tensor_alloc(buffer, tensor, address)
        t = GgmlTensor.from_address(tensor)
        extra = t.extra or 0
        if extra:
            b.ggml_backend_tensor_set(tensor, source, 0, b.ggml_nbytes(tensor))
        t.data, t.buffer, t.extra = None, None, None  # the leaf free for the next matrix
        return extra

    def copy(self, leaf: int, sources: list[int]) -> tuple[int, int, int, int] | None:
        """The matrices at `sources` (each of `leaf`'s type and shape, blocks as stored) repacked back to
        back into one new buffer: (its handle, its base, one matrix's bytes, their kernels); None, and
        nothing kept, where the type has no repacked kernels."""
        size = self.lib.base.ggml_nbytes(leaf)
        handle, base = self.alloc(len(sources) * size)
        extra = 0
        for i, source in enumerate(sources):
            extra = self.repack(leaf, handle, base + i * size, source)
            if not extra:
                break
        if not extra:
            self.free(handle)
            return None
        return handle, base, size, extra

    def has_kernels(self, type_id: int) -> bool:
        """Whether ggml's CPU backend here has repacked kernels for matrices of `type_id` (a zero matrix of
        8 rows of 4096 columns, the shape every repacked layout takes, repacked into a buffer freed
        after)."""
        from moestream.ggml.net import Net

        net = Net(self.lib, nodes=2)
        try:
            leaf = net.tensor(type_id, [4096, 8])
            zeros = bytes(self.lib.base.ggml_nbytes(leaf))
            handle, base = self.alloc(len(zeros))
            try:
                return bool(self.repack(leaf, handle, base, C.cast(C.c_char_p(zeros), C.c_void_p).value))
            finally:
                self.free(handle)
        finally:
            net.close()

    def free(self, handle: int) -> None:
        """One buffer of `alloc` freed."""
        self._buffers.remove(handle)
        self.lib.base.ggml_backend_buffer_free(handle)

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """ggml's log silenced inside (its repack says a debug line for every matrix written), then
        back to ggml's own."""
        self.lib.base.ggml_log_set.argtypes = [C.c_void_p, C.c_void_p]
        self.lib.base.ggml_log_set.restype = None
        self.lib.base.ggml_log_set(C.cast(_SILENT, C.c_void_p), None)
        try:
            yield
        finally:
            self.lib.base.ggml_log_set(None, None)

    @staticmethod
    def mark(tensor: int, buffer: int, extra: int) -> None:
        """A graph's leaf over repacked bytes: computed by those kernels."""
        t = GgmlTensor.from_address(tensor)
        t.buffer, t.extra = buffer, extra

    def close(self) -> None:
        for handle in self._buffers:
            self.lib.base.ggml_backend_buffer_free(handle)
        self._buffers = []


_SILENT = C.CFUNCTYPE(None, C.c_int, C.c_char_p, C.c_void_p)(lambda level, text, data: None)


def _text(name: object) -> str:
    return name.decode() if isinstance(name, bytes) else C.cast(name, C.c_char_p).value.decode()
