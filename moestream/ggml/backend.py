"""ggml's backends: a device (CUDA, or the CPU through the same API) computing moestream's graphs over
memory in the device's own buffers.

The graph builders address host memory: torch tensors of weights, the KV cache and the step's buffers,
which the CPU computes in place (`ggml/net.py`). On a backend, `DeviceMemory` places each of those host
regions in a buffer of the device and hands the graphs the device's address instead (`translate`):

- a region registered as `io` (the step's inputs and outputs) is copied to the device before each
  compute where the graph reads it, and back after it where the graph writes it (`Net.run`);
- `device` regions exist on the device alone (the KV cache; expert stacks, `alloc`);
- any other host address the builders hand over is a weight: copied once, when first seen, or all
  at once by `upload_weights` (the trunk at load, whose host copy is then given back, `release_host`:
  a graph that reads a given-back range outside what was copied raises instead of copying pages that
  read as zeros).
  Host ranges that must never be taken for weights (the expert cache's slots, whose contents change)
  are `forbid`den: translating one raises.

Every region gets a zeroed tail past its bytes: ggml's CUDA kernels read quantized rows in blocks of
512 columns (MATRIX_ROW_PADDING), past the end of a matrix whose width is not a multiple of that.

`cuda_backend()` says in one sentence what is missing when ggml's CUDA backend cannot run (no library,
no GPU); `cpu_backend()` is the same API over the CPU, which the tests use to check this path here.
"""

from __future__ import annotations

import bisect
import ctypes as C
import os
from dataclasses import dataclass, field

import torch

from moestream.ggml.lib import (
    GgmlTensor,
    GgmlUnavailableError,
    InitParams,
    Library,
    cuda_library,
    library,
)

STATUS = {-2: "allocation failed", -1: "failed", 1: "aborted"}  # enum ggml_status, success 0
USAGE_WEIGHTS = 1  # GGML_BACKEND_BUFFER_USAGE_WEIGHTS: the scheduler places an op by its weights'
TAIL = 4096  # zeroed bytes after each region (see the module doc)
I8 = 24  # GGML_TYPE_I8: a region seen as bytes, for ggml_backend_tensor_set/get


@dataclass
class Backend:
    """One ggml backend: its handle, the buffer type of its memory and what it is, for the mode line."""

    lib: Library
    handle: int  # ggml_backend_t
    buft: int  # its device's buffer type
    kind: str  # "cuda" | "cpu"
    description: str
    device: int = 0

    def compute(self, graph: int) -> None:
        """Compute `graph` and wait for it."""
        status = self.lib.base.ggml_backend_graph_compute(self.handle, graph)
        if status:
            raise RuntimeError(f"ggml's {self.kind} backend: graph compute {STATUS.get(status, status)}")

    def compute_async(self, graph: int) -> None:
        status = self.lib.base.ggml_backend_graph_compute_async(self.handle, graph)
        if status:
            raise RuntimeError(f"ggml's {self.kind} backend: graph compute {STATUS.get(status, status)}")

    def synchronize(self) -> None:
        self.lib.base.ggml_backend_synchronize(self.handle)

    def supports(self, node: int) -> bool:
        return bool(self.lib.base.ggml_backend_supports_op(self.handle, node))

    def alloc(self, nbytes: int, weights: bool = False) -> Buffer:
        """A zeroed buffer of the device of `nbytes` (at least 1)."""
        b = self.lib.base
        handle = b.ggml_backend_buft_alloc_buffer(self.buft, max(1, nbytes))
        if not handle:
            raise MemoryError(f"ggml's {self.kind} backend could not allocate {nbytes} bytes")
        b.ggml_backend_buffer_clear(handle, 0)
        if weights:
            b.ggml_backend_buffer_set_usage(handle, USAGE_WEIGHTS)
        return Buffer(self.lib, handle, b.ggml_backend_buffer_get_base(handle), nbytes)

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device (CUDA), or (0, 0) where ggml does not say."""
        if self.kind != "cuda":
            return 0, 0
        free, total = C.c_size_t(), C.c_size_t()
        cuda_library().ggml_backend_cuda_get_device_memory(self.device, C.byref(free), C.byref(total))
        return free.value, total.value

    def close(self) -> None:
        if self.handle:
            self.lib.base.ggml_backend_free(self.handle)
            self.handle = 0


@dataclass
class Buffer:
    """One allocation in a backend's buffer type."""

    lib: Library
    handle: int  # ggml_backend_buffer_t
    base: int
    size: int

    def free(self) -> None:
        if self.handle:
            self.lib.base.ggml_backend_buffer_free(self.handle)
            self.handle = 0


def cuda_graphs() -> tuple[bool, str]:
    """Whether ggml's CUDA backend replays a step's kernels as CUDA graphs (once per process: ggml reads
    GGML_CUDA_DISABLE_GRAPHS when it first computes), and why not. On by default, for every family: the
    Gated DeltaNet ones (Qwen3-Next, Qwen3.5) too since their replayed steps gave the launched ones'
    logits, to the digit, and tokens on an H100 (2026-12-07, `benchmarks/ggml_cuda.py check`; on the H200
    on 12-04 they had parted at the second step: which change since set them right is not known).
    MOESTREAM_CUDA_GRAPHS=0 turns them off."""
    asked = os.environ.get("MOESTREAM_CUDA_GRAPHS", "").strip()
    if asked not in ("", "0", "1"):
        raise GgmlUnavailableError(f"MOESTREAM_CUDA_GRAPHS={asked!r}: say 0 or 1")
    if os.environ.get("GGML_CUDA_DISABLE_GRAPHS") is not None:
        return False, "GGML_CUDA_DISABLE_GRAPHS is set"
    if asked == "0":
        os.environ["GGML_CUDA_DISABLE_GRAPHS"] = "1"
        return False, "MOESTREAM_CUDA_GRAPHS=0"
    return True, ""


def cuda_backend(device: int = 0) -> Backend:
    """ggml's CUDA backend on GPU `device`, its CUDA graphs as `cuda_graphs` says. Raises
    GgmlUnavailableError in one sentence: no library (and how to get one), or no GPU that it can see."""
    lib = library()
    graphs, why = cuda_graphs()
    cuda = cuda_library()
    count = cuda.ggml_backend_cuda_get_device_count()
    if count == 0:
        raise GgmlUnavailableError(
            "ggml's CUDA backend sees no GPU (no NVIDIA GPU here, or no driver): the CPU path needs "
            "neither (--device cpu)."
        )
    if count <= device:
        raise GgmlUnavailableError(f"ggml's CUDA backend sees {count} GPUs, not GPU {device}.")
    handle = cuda.ggml_backend_cuda_init(device)
    if not handle:
        raise GgmlUnavailableError(f"ggml's CUDA backend could not start on GPU {device}.")
    text = C.create_string_buffer(256)
    cuda.ggml_backend_cuda_get_device_description(device, text, 256)
    buft = cuda.ggml_backend_cuda_buffer_type(device)
    name = text.value.decode(errors="replace")
    name += ", CUDA graphs" if graphs else f", no CUDA graphs: {why}"
    return Backend(lib, handle, buft, "cuda", name, device)


def cuda_unavailable(device: int = 0) -> str | None:
    """Why ggml's CUDA backend cannot run on GPU `device` here, in a few words for the mode line (no ggml,
    no CUDA library and how to build one, no GPU it sees), or None where it can: `--device cuda`'s probe
    (`engine/gpu_path.py`). Nothing is started but the library's own device count."""
    try:
        lib = library()
    except GgmlUnavailableError as exc:
        return f"no usable ggml ({str(exc).rstrip('.')})"
    if not (lib.folder / "libggml-cuda.so").exists():
        return "ggml's CUDA library not found; `make native CUDA=1` builds it"
    try:
        count = cuda_library().ggml_backend_cuda_get_device_count()
    except GgmlUnavailableError as exc:
        return f"ggml's CUDA library does not load ({exc.__cause__ or exc})"
    if count == 0:
        return "ggml's CUDA backend sees no GPU"
    if count <= device:
        return f"ggml's CUDA backend sees {count} GPUs, not GPU {device}"
    return None


# enum ggml_backend_dev_type (ggml-backend.h), in its order
DEVICE_TYPES = ("cpu", "gpu", "igpu", "accel", "meta")


def device_type(reg: int, index: int) -> str | None:
    """The type ggml's backend registry `reg` gives its device `index` ("cpu", "gpu", "igpu": an integrated
    GPU, whose memory is the host's, "accel", "meta"); None where it has no such device."""
    base = library().base
    if not reg or index >= base.ggml_backend_reg_dev_count(reg):
        return None
    kind = base.ggml_backend_dev_type(base.ggml_backend_reg_dev_get(reg, index))
    return DEVICE_TYPES[kind] if 0 <= kind < len(DEVICE_TYPES) else f"type {kind}"


def cuda_device_type(device: int = 0) -> str | None:
    """What ggml's CUDA backend says GPU `device` is ("gpu", or "igpu" for an integrated one such as a
    Jetson's: the CUDA device's `integrated` property), or None where that backend cannot run here
    (`cuda_unavailable`). Asks the CUDA runtime for the device's properties; starts no backend, and
    leaves torch's CUDA uninitialized."""
    if cuda_unavailable(device) is not None:
        return None
    return device_type(cuda_library().ggml_backend_cuda_reg(), device)


def cpu_backend(threads: int) -> Backend:
    """ggml's CPU backend with `threads` threads of its own: the backend API over host memory."""
    lib = library()
    handle = lib.cpu.ggml_backend_cpu_init()
    if not handle:
        raise GgmlUnavailableError("ggml's CPU backend could not start")
    lib.cpu.ggml_backend_cpu_set_n_threads(handle, threads)
    return Backend(lib, handle, lib.base.ggml_backend_cpu_buffer_type(), "cpu", "CPU", 0)


@dataclass
class Region:
    """A host range and its place on the device (host 0: a device-only region made by `alloc`)."""

    host: int
    nbytes: int
    buffer: Buffer
    role: str  # "weight" | "io" | "device"
    tensor: int = 0  # an I8 tensor over the device bytes, for ggml_backend_tensor_set/get
    name: str = ""
    ctx: int = 0  # the ggml context holding `tensor`

    @property
    def device(self) -> int:
        return self.buffer.base

    def free(self, lib: Library) -> None:
        self.buffer.free()
        if self.ctx:
            lib.base.ggml_free(self.ctx)
            self.ctx = 0


@dataclass
class DeviceMemory:
    """Host regions the graph builders address, placed in one backend's buffers (see the module doc)."""

    backend: Backend
    regions: dict[int, Region] = field(default_factory=dict)  # by id, in the order made
    _by_host: list[tuple[int, int]] = field(default_factory=list)  # (host start, id), sorted
    _by_device: list[tuple[int, int]] = field(default_factory=list)
    _next: int = 0
    _forbidden: list[tuple[int, int, str]] = field(default_factory=list)  # (start, end, what)
    _pinned: list[tuple[int, int]] = field(default_factory=list)  # host ranges `pin_host` registered
    _released: list[tuple[int, int]] = field(default_factory=list)  # (start, end), sorted: `release_host`
    # what keeps the host addresses of weights and released ranges allocated (no new tensor takes them)
    _held: list[object] = field(default_factory=list)
    # (free, total) bytes of the device when this was made, before anything was placed (`Backend.memory`)
    before: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.before = self.backend.memory()

    @property
    def lib(self) -> Library:
        return self.backend.lib

    # --- regions -------------------------------------------------------------------------------

    def register(self, t: torch.Tensor, role: str, name: str = "") -> Region:
        """Place the host tensor `t` on the device: "io" (synced around each compute that touches it),
        "device" (never copied: the KV cache), "weight" (copied now)."""
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("a region must be a contiguous host tensor")
        return self._add(t.data_ptr(), t.nbytes, role, name)

    def alloc(self, nbytes: int, name: str = "") -> Region:
        """Device memory of no host region (expert stacks): address it by `Region.device`."""
        return self._add(0, nbytes, "device", name)

    def forbid(self, start: int, nbytes: int, what: str) -> None:
        """Host bytes that must never be taken for a weight (they change): translating them raises."""
        if (start, start + nbytes, what) not in self._forbidden:
            self._forbidden.append((start, start + nbytes, what))

    def upload_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy the host tensors (name, tensor) to the device now, as weights: one region per run of
        overlapping ranges (a view inside another tensor is found in its region). Their storages are
        held until `close`. Returns the bytes placed.

        Raises:
            ValueError: a tensor off the host, or a range that overlaps a region placed before.
        """
        names: dict[int, str] = {}  # a range's start -> the first tensor's name there (the region's)
        for name, t in reversed(tensors):
            if t.device.type != "cpu":
                raise ValueError(f"{name}: a weight to copy must be a host tensor")
            if t.numel():
                names[t.data_ptr()] = name
                self._held.append(t.untyped_storage())
        ranges = merged_ranges([(t.data_ptr(), t.data_ptr() + t.nbytes) for _, t in tensors if t.numel()])
        for start, end in ranges:
            if self._overlaps(start, end):
                raise ValueError(f"{names[start]}: its host range overlaps one already on the device")
            self._add(start, end - start, "weight", names[start])
        return sum(end - start for start, end in ranges)

    def release_host(self, ranges: list[tuple[int, int]], holders: list[object]) -> None:
        """Host bytes [start, end) given back (`io.memory.drop_pages`; ranges apart from each other): a
        graph that reads them outside the regions placed before raises. `holders` keep them allocated
        until `close`."""
        for r in ranges:
            bisect.insort(self._released, r)
        self._held.extend(holders)

    def _overlaps(self, start: int, end: int) -> bool:
        """Whether host bytes [start, end) meet a region's (the last one starting before `end`)."""
        k = bisect.bisect_left(self._by_host, (end, -1))
        if k == 0:
            return False
        region = self.regions[self._by_host[k - 1][1]]
        return region.host + max(1, region.nbytes) > start

    def _add(self, host: int, nbytes: int, role: str, name: str) -> Region:
        if host and self._find(self._by_host, host, lambda r: r.host) is not None:
            raise ValueError(f"host range at {host:#x} is already on the device")
        b = self.lib.base
        buffer = self.backend.alloc(nbytes + TAIL, weights=role in ("weight", "device"))
        region = Region(host, nbytes, buffer, role, name=name)
        region.ctx = b.ggml_init(InitParams(2 * b.ggml_tensor_overhead(), None, True))
        t = b.ggml_new_tensor_1d(region.ctx, I8, max(1, nbytes)) if region.ctx else 0
        if not t or b.ggml_backend_tensor_alloc(buffer.handle, t, region.device):
            region.free(self.lib)
            raise RuntimeError(f"ggml could not place a {nbytes}-byte region on the {self.backend.kind}")
        region.tensor = t
        if role == "weight" and nbytes:
            self.lib.base.ggml_backend_tensor_set(t, host, 0, nbytes)
        key, self._next = self._next, self._next + 1
        self.regions[key] = region
        if host:
            bisect.insort(self._by_host, (host, key))
        bisect.insort(self._by_device, (region.device, key))
        return region

    def drop(self, t: torch.Tensor) -> None:
        """Free the device copy of the registered host tensor `t` (a graph set closed)."""
        k = bisect.bisect_left(self._by_host, (t.data_ptr(), -1))
        if k == len(self._by_host) or self._by_host[k][0] != t.data_ptr():
            raise KeyError("that tensor is not on the device")
        self.release(self.regions[self._by_host[k][1]])

    def release(self, region: Region) -> None:
        """Free a region (a device-only one from `alloc`, or a registered host tensor's)."""
        key = next(k for k, r in self.regions.items() if r is region)
        del self.regions[key]
        if region.host:
            self._by_host.remove((region.host, key))
        self._by_device.remove((region.device, key))
        region.free(self.lib)

    def _find(self, table: list[tuple[int, int]], address: int, start) -> Region | None:
        k = bisect.bisect_right(table, (address, self._next)) - 1
        if k < 0:
            return None
        region = self.regions[table[k][1]]
        return region if start(region) <= address < start(region) + max(1, region.nbytes) else None

    def translate(self, address: int, nbytes: int) -> tuple[int, int, Region]:
        """(device address, ggml buffer, region) of the `nbytes` at host (or device) `address`; an address
        of no region is a weight, copied now."""
        region = self._find(self._by_host, address, lambda r: r.host)
        if region is not None:
            offset = address - region.host
        else:
            region = self._find(self._by_device, address, lambda r: r.device)
            if region is not None:
                offset = address - region.device
            else:
                for start, end, what in self._forbidden:
                    if start <= address < end:
                        raise RuntimeError(f"a graph on the {self.backend.kind} reads {what} on the host")
                k = bisect.bisect_right(self._released, (address, 1 << 64)) - 1
                if k >= 0 and self._released[k][0] <= address < self._released[k][1]:
                    raise RuntimeError(
                        f"a graph on the {self.backend.kind} reads {nbytes} bytes at {address:#x} of the "
                        "trunk's host copy, given back at load, that were not copied to the device "
                        "(`upload_weights`): not a weight of the model's spec"
                    )
                region = self._add(address, nbytes, "weight", "")
                offset = 0
        if offset + nbytes > region.nbytes:
            raise RuntimeError(
                f"a graph tensor of {nbytes} bytes at offset {offset} overruns its {region.nbytes}-byte "
                f"region {region.name!r}"
            )
        return region.device + offset, region.buffer.handle, region

    # --- copies --------------------------------------------------------------------------------

    def upload(self, region: Region, offset: int, nbytes: int) -> None:
        """Host -> device, on the backend's stream (ordered before the next compute)."""
        self.lib.base.ggml_backend_tensor_set_async(
            self.backend.handle, region.tensor, region.host + offset, offset, nbytes
        )

    def download(self, region: Region, offset: int, nbytes: int) -> None:
        """Device -> host, on the backend's stream (done once `backend.synchronize()` returns)."""
        self.lib.base.ggml_backend_tensor_get_async(
            self.backend.handle, region.tensor, region.host + offset, offset, nbytes
        )

    def upload_from(self, region: Region, offset: int, source: int, nbytes: int) -> None:
        """Bytes at host `source` into the region at `offset`, on the backend's stream (ordered before the
        next compute; asynchronous from host memory the device has pinned, `pin_host`)."""
        handle = self.backend.handle
        self.lib.base.ggml_backend_tensor_set_async(handle, region.tensor, source, offset, nbytes)

    def pin_host(self, start: int, nbytes: int) -> bool:
        """Page-lock host bytes for the device's copies (CUDA: registered until `close`), where it can;
        whether it did (the copies work either way, slower and synchronous from pageable memory).
        ggml registers nothing unless GGML_CUDA_REGISTER_HOST is set (read at each call): set here."""
        if self.backend.kind != "cuda" or (start, nbytes) in self._pinned:
            return False
        os.environ.setdefault("GGML_CUDA_REGISTER_HOST", "1")
        if not cuda_library().ggml_backend_cuda_register_host_buffer(start, nbytes):
            return False
        self._pinned.append((start, nbytes))
        return True

    def write(self, region: Region, offset: int, source: int, nbytes: int) -> None:
        """Bytes at host `source` into the region at `offset` (synchronous)."""
        self.lib.base.ggml_backend_tensor_set(region.tensor, source, offset, nbytes)

    def host_block(self, nbytes: int) -> tuple[torch.Tensor, Buffer | None]:
        """`nbytes` of host memory for the step's buffers, page-locked where the device is CUDA (ggml's
        pinned host buffer type: its copies to and from the device then run asynchronously), and the
        buffer to free with it (None: torch's own memory)."""
        if self.backend.kind != "cuda":
            return torch.zeros(nbytes, dtype=torch.uint8), None
        b = self.lib.base
        handle = b.ggml_backend_buft_alloc_buffer(cuda_library().ggml_backend_cuda_host_buffer_type(), nbytes)
        if not handle:
            raise MemoryError(f"CUDA could not allocate {nbytes} bytes of pinned host memory")
        b.ggml_backend_buffer_clear(handle, 0)
        buffer = Buffer(self.lib, handle, b.ggml_backend_buffer_get_base(handle), nbytes)
        block = torch.frombuffer((C.c_uint8 * nbytes).from_address(buffer.base), dtype=torch.uint8)
        return block, buffer

    def zero(self, t: torch.Tensor) -> None:
        """Zero the device copy of the registered host tensor `t` (a recurrent state at a new request)."""
        _, _, region = self.translate(t.data_ptr(), t.nbytes)
        self.lib.base.ggml_backend_tensor_memset(region.tensor, 0, t.data_ptr() - region.host, t.nbytes)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes + TAIL for r in self.regions.values())

    def unpin_hosts(self) -> None:
        """Undo every `pin_host` (before the host bytes are freed: a restream's old slots)."""
        for start, _ in self._pinned:
            cuda_library().ggml_backend_cuda_unregister_host_buffer(start)
        self._pinned.clear()

    def close(self) -> None:
        self.unpin_hosts()
        for region in self.regions.values():
            region.free(self.lib)
        self.regions.clear()
        self._by_host.clear()
        self._by_device.clear()
        self._released.clear()
        self._held.clear()


def merged_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) ranges, the overlapping ones merged, sorted."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def place_tensor(t: int, address: int, buffer: int) -> None:
    """A ggml tensor's data at `address` inside backend buffer `buffer` (what ggml-alloc would set)."""
    g = GgmlTensor.from_address(t)
    g.data = address
    g.buffer = buffer
