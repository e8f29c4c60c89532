"""ggml compute graphs built once per shape and run by swapping data pointers, on one paused threadpool.

A `Graph` owns a no_alloc ggml context holding its tensors' metadata, the planned `ggml_cplan`, the
plan's work buffer (where ggml quantizes the f32 activations to Q8_0/Q8_K) and the buffer of its
intermediates. Its inputs and output have no memory of their own: `run()` writes the caller's
addresses into their `data` fields and computes. Nothing is allocated per call.

`Kernels` holds the graphs of one thread count and the threadpool they run on. The pool is created
paused and paused again after every compute (ggml_graph_compute resumes a paused pool itself), so its
workers sleep on a condition variable instead of spinning while torch computes; `hold()` keeps it
awake across a burst of computes (one MoE layer's experts) and pauses it at the end.

A new kind of graph is one build function over `Builder` (see ops.py). Several experts in one call
(ggml_mul_mat_id) would add a 3-D weight input whose `data` is the first expert and whose nb[2] is
the distance between experts, plus an int32 ids input: it needs the experts' matrices at one stride,
e.g. slots of one size class holding each tensor's experts at the same offset inside the slot.
"""

from __future__ import annotations

import ctypes as C
import queue
import signal
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from moestream.ggml.lib import GgmlTensor, InitParams, Library, library

GRAPH_NODES = 16  # the largest graph (a SwiGLU expert) has 4 nodes and 4 leafs
F32, I32 = 0, 26  # GGML_TYPE_F32, GGML_TYPE_I32
MAX_GRAPHS = 128  # prefill sees many M per expert; least recently used graphs beyond this are freed


class Builder:
    """What a graph-building function gets: ggml tensor constructors bound to one context."""

    def __init__(self, lib: Library, ctx: int) -> None:
        self.lib, self.ctx = lib, ctx
        self.inputs: dict[str, int] = {}  # name -> ggml_tensor*, data supplied at each run
        self.scratch: list[int] = []  # intermediates, data in the graph's own buffer

    def input(self, name: str, type_id: int, ne0: int, ne1: int, ne2: int = 0) -> int:
        """A 2-D input (3-D with ne2): ne0 is the contiguous dimension (torch shape [ne1, ne0])."""
        base = self.lib.base
        if ne2:
            t = base.ggml_new_tensor_3d(self.ctx, type_id, ne0, ne1, ne2)
        else:
            t = base.ggml_new_tensor_2d(self.ctx, type_id, ne0, ne1)
        self.lib.base.ggml_set_name(t, name.encode())
        self.inputs[name] = t
        return t

    def op(self, fn: str, *args: int) -> int:
        """A node: ggml_<fn>(ctx, *args); its result lives in the graph's scratch buffer."""
        t = getattr(self.lib.base, f"ggml_{fn}")(self.ctx, *args)
        self.scratch.append(t)
        return t


class Graph:
    """One planned ggml graph; `run(**addresses)` sets the inputs' and the output's data and computes."""

    def __init__(
        self,
        lib: Library,
        pool: int,
        n_threads: int,
        build: Callable[[Builder], int | list[int]],
        solo_pool: int | None = None,
        nodes: int = 0,
    ) -> None:
        self.lib = lib
        nodes = max(nodes, GRAPH_NODES)
        mem = 4 * nodes * lib.base.ggml_tensor_overhead() + lib.base.ggml_graph_overhead_custom(nodes, False)
        self.ctx = lib.base.ggml_init(InitParams(mem, None, True))
        b = Builder(lib, self.ctx)
        built = build(b)
        outs = built if isinstance(built, list) else [built]  # several: "out0", "out1", ...
        self.gf = lib.base.ggml_new_graph_custom(self.ctx, nodes, False)
        for out in outs:
            b.scratch.remove(out)  # the outputs are the caller's memory, like the inputs
            lib.base.ggml_build_forward_expand(self.gf, out)
        sizes = [(lib.base.ggml_nbytes(t) + 63) // 64 * 64 for t in b.scratch]
        self._scratch = torch.empty(max(sum(sizes), 1), dtype=torch.uint8)
        offset = self._scratch.data_ptr()
        for t, size in zip(b.scratch, sizes):
            GgmlTensor.from_address(t).data = offset
            offset += size
        self._slots = {name: GgmlTensor.from_address(t) for name, t in b.inputs.items()}
        names = (
            ["out"]
            if len(outs) == 1 and not isinstance(built, list)
            else [f"out{i}" for i in range(len(outs))]
        )
        self._slots.update((name, GgmlTensor.from_address(out)) for name, out in zip(names, outs))
        self.plan = lib.cpu.ggml_graph_plan(self.gf, n_threads, pool)
        if self.plan.n_threads == 1 and solo_pool:  # single-task ops (get_rows): leave the workers asleep
            pool = solo_pool
            self.plan = lib.cpu.ggml_graph_plan(self.gf, 1, pool)
        if self.plan.n_threads > n_threads or self.plan.threadpool != pool:
            raise RuntimeError("ggml_graph_plan returned a plan for more threads or another pool")
        self.pool = pool
        self._work = torch.empty(max(self.plan.work_size, 1), dtype=torch.uint8)
        self.plan.work_data = self._work.data_ptr()
        self._plan_ref = C.byref(self.plan)

    def run(self, /, **addresses: int) -> None:
        """Point every input and `out` at the given addresses and compute (the caller holds the lock)."""
        for name, address in addresses.items():
            self._slots[name].data = address
        compute_graph(self.lib, self.gf, self._plan_ref)

    def close(self) -> None:
        self.ctx = free_context(self.lib, self.ctx)


def compute_graph(lib: Library, gf: int, plan_ref: object) -> None:
    """ggml_graph_compute of a planned graph; a failure status is an error. An OpenMP build's graphs are
    computed by one thread (`ComputeThread`), whichever thread asks."""
    if lib.openmp:
        status = COMPUTE_THREAD.run(lambda: lib.cpu.ggml_graph_compute(gf, plan_ref))
    else:
        status = lib.cpu.ggml_graph_compute(gf, plan_ref)
    if status != 0:
        raise RuntimeError(f"ggml_graph_compute failed with status {status}")


class ComputeThread:
    """The one thread that computes every graph of an OpenMP build of ggml (llama.cpp's default build,
    e.g. `MOESTREAM_GGML_LIB` at llama.cpp's folder; the wheel's and `make native`'s use ggml's own
    pool, where any thread may compute).

    Each thread that starts an OpenMP parallel region gets a team of its own, and a second team makes
    the first's graphs slow too: on the GPU machine's 16 cores (2026-12-06, llama.cpp's CPU library of
    `../shared/h200`) the same decode loop ran 86 tok/s from the thread that had computed the load's
    graphs and 41 from any other (4 with OMP_WAIT_POLICY=active), while the engine computes from each
    request's thread. A call hands its compute here and waits for it (one compute at a time, as the
    pool's lock has it anyway); from this thread it runs at once."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def run(self, fn: Callable[[], int]) -> int:
        """fn() on the compute thread; its result, or its exception raised here."""
        if threading.current_thread() is self._thread:
            return fn()
        with self._start:
            if self._thread is None:
                # like the pool's workers: Ctrl-C and SIGTERM reach the main thread (see io/reader.py)
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
                try:
                    self._thread = threading.Thread(target=self._serve, name="moestream-ggml", daemon=True)
                    self._thread.start()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        done, box = threading.Event(), []
        self._jobs.put((fn, box, done))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _serve(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed back to the caller
                box.append((False, exc))
            done.set()


COMPUTE_THREAD = ComputeThread()


def free_context(lib: Library, ctx: int | None) -> None:
    """Free a ggml context (once: returns None for the caller to keep)."""
    if ctx:
        lib.base.ggml_free(ctx)


class Kernels:
    """The graphs of one thread count and their threadpool; one compute at a time (a lock)."""

    def __init__(self, n_threads: int, lib: Library | None = None) -> None:
        self.lib = lib or library()
        self.n_threads = n_threads
        params = self.lib.base.ggml_threadpool_params_default(n_threads)
        params.paused = True
        # the workers inherit this mask: Ctrl-C and SIGTERM reach the main thread (see io/reader.py)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            self.pool = self.lib.cpu.ggml_threadpool_new(C.byref(params))
            # A pool of the calling thread alone, for graphs whose ops ggml runs single-task: waking the
            # main pool's workers for those only makes them compete with the one thread that works.
            params1 = self.lib.base.ggml_threadpool_params_default(1)
            self.solo = self.lib.cpu.ggml_threadpool_new(C.byref(params1)) if n_threads > 1 else None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if not self.pool or (n_threads > 1 and not self.solo):
            raise RuntimeError(f"ggml_threadpool_new({n_threads}) failed")
        self._graphs: OrderedDict[tuple, Graph] = OrderedDict()
        self._lock = threading.RLock()
        self._held = 0

    def compute(
        self, key: tuple, build: Callable[[Builder], int | list[int]], /, nodes: int = 0, **addresses: int
    ) -> None:
        """Run the graph cached under key (built by `build` the first time, with room for `nodes` nodes)
        on these data pointers, then pause the pool unless a hold() is open. Lookup and compute share one
        lock, so a graph is never freed (least recently used beyond MAX_GRAPHS) while another thread is
        about to run it."""
        with self._lock:
            g = self._graphs.get(key)
            if g is None:
                g = self._graphs[key] = Graph(self.lib, self.pool, self.n_threads, build, self.solo, nodes)
                while len(self._graphs) > MAX_GRAPHS:
                    self._graphs.pop(next(iter(self._graphs))).close()
            else:
                self._graphs.move_to_end(key)
            try:
                g.run(**addresses)
            finally:
                if not self._held and g.pool == self.pool:
                    self.lib.cpu.ggml_threadpool_pause(self.pool)

    def idle(self) -> None:
        """After a graph run on the pool outside `compute` (a `Net`'s): its workers paused unless a
        hold() is open (polling, they take cores another pool computes on: ggml's CPU backend's)."""
        with self._lock:
            if not self._held:
                self.lib.cpu.ggml_threadpool_pause(self.pool)

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Keep the pool's workers polling between computes inside this block; pause them on exit."""
        with self._lock:
            self._held += 1
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1
                if not self._held:
                    self.lib.cpu.ggml_threadpool_pause(self.pool)

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    def close(self) -> None:
        with self._lock:
            for g in self._graphs.values():
                g.close()
            self._graphs.clear()
            for pool in (self.pool, self.solo):
                if pool:
                    self.lib.cpu.ggml_threadpool_free(pool)
            self.pool = self.solo = None


_KERNELS: Kernels | None = None
_KERNELS_LOCK = threading.Lock()
_THREADS: int | None = None


def set_threads(n: int | None) -> None:
    """The compute threads of ggml's pool from now on (None: torch's thread count, the default)."""
    global _THREADS
    _THREADS = n


def compute_threads() -> int:
    """The threads a ggml compute runs on: `set_threads`'s count, else torch's."""
    return _THREADS or torch.get_num_threads()


def kernels(n_threads: int | None = None) -> Kernels:
    """The process-wide Kernels for n_threads (default: `compute_threads()`); a new count replaces it."""
    global _KERNELS
    n = n_threads or compute_threads()
    k = _KERNELS
    if k is not None and k.n_threads == n:
        return k
    with _KERNELS_LOCK:
        if _KERNELS is None or _KERNELS.n_threads != n:
            if _KERNELS is not None:
                _KERNELS.close()
            _KERNELS = Kernels(n)
        return _KERNELS
