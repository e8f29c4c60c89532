"""Find, check and load ggml's shared libraries (ggml-base + ggml-cpu) and declare the C API we call.

Which library: $MOESTREAM_GGML_LIB (a folder holding libggml-base.so and libggml-cpu.so, or the word
"prebuilt"), else the `make native` build in `build.native_dir()` when present, else the prebuilt
libggml-python wheel. Before anything is dlopen'ed, the CPU's flags are checked against what the library
was compiled for, so a missing instruction set is an error that says what to do, never a SIGILL. After
loading, the struct layouts this module declares are checked against the library itself.
"""

from __future__ import annotations

import ctypes as C
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from moestream.errors import MoestreamError
from moestream.ggml.host import cpu_flags, native_dir
from moestream.power.elfsyms import ElfError, needed_libraries

GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_NAME, GGML_MAX_N_THREADS = 4, 10, 64, 512
# What the prebuilt x86_64 wheel is compiled with (GGML_NATIVE=OFF, AVX2 baseline).
PREBUILT_X86_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi2")
# /proc/cpuinfo flags that a -march=native build may depend on; the current CPU must have the build's.
_ISA_PREFIXES = ("sse", "ssse3", "avx", "fma", "f16c", "bmi", "amx", "asimd", "sve", "sme", "i8mm", "bf16")


class GgmlUnavailableError(MoestreamError):
    """No usable ggml library: missing, built for another CPU, or of an incompatible layout."""


class GgmlGraph(C.Structure):
    """The head of ggml's `struct ggml_cgraph` (ggml-impl.h, ggml 0.25.x), read only to set its `uid`:
    ggml's CUDA backend replays a graph's CUDA graph without comparing its nodes' properties where the
    uid is the one it last saw (`graph_uid`)."""

    _fields_ = [
        ("size", C.c_int),
        ("n_nodes", C.c_int),
        ("n_leafs", C.c_int),
        ("nodes", C.c_void_p),
        ("grads", C.c_void_p),
        ("grad_accs", C.c_void_p),
        ("leafs", C.c_void_p),
        ("use_counts", C.c_void_p),
        ("hash_size", C.c_size_t),
        ("hash_used", C.c_void_p),
        ("hash_keys", C.c_void_p),
        ("order", C.c_int),
        ("uid", C.c_uint64),
    ]


class GgmlTensor(C.Structure):
    """struct ggml_tensor (ggml.h), 336 bytes on 64-bit; `data` is the field we swap."""

    _fields_ = [
        ("type", C.c_int),
        ("buffer", C.c_void_p),
        ("ne", C.c_int64 * GGML_MAX_DIMS),
        ("nb", C.c_size_t * GGML_MAX_DIMS),
        ("op", C.c_int),
        ("op_params", C.c_int32 * 16),
        ("flags", C.c_int32),
        ("src", C.c_void_p * GGML_MAX_SRC),
        ("view_src", C.c_void_p),
        ("view_offs", C.c_size_t),
        ("data", C.c_void_p),
        ("name", C.c_char * GGML_MAX_NAME),
        ("extra", C.c_void_p),
        ("padding", C.c_char * 8),
    ]


class GgmlObject(C.Structure):
    """struct ggml_object (ggml.c): the header in front of each tensor in a context."""

    _fields_ = [
        ("offs", C.c_size_t),
        ("size", C.c_size_t),
        ("next", C.c_void_p),
        ("type", C.c_int),
        ("padding", C.c_char * 4),
    ]


class InitParams(C.Structure):
    _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]


class Cplan(C.Structure):
    """struct ggml_cplan (ggml-cpu.h): what ggml_graph_plan returns and ggml_graph_compute takes."""

    _fields_ = [
        ("work_size", C.c_size_t),
        ("work_data", C.c_void_p),
        ("n_threads", C.c_int),
        ("threadpool", C.c_void_p),
        ("abort_callback", C.c_void_p),
        ("abort_callback_data", C.c_void_p),
        ("use_ref", C.c_bool),
    ]


class ThreadpoolParams(C.Structure):
    _fields_ = [
        ("cpumask", C.c_bool * GGML_MAX_N_THREADS),
        ("n_threads", C.c_int),
        ("prio", C.c_int),
        ("poll", C.c_uint32),
        ("strict_cpu", C.c_bool),
        ("paused", C.c_bool),
    ]


ToFloat = C.CFUNCTYPE(None, C.c_void_p, C.c_void_p, C.c_int64)


class TypeTraits(C.Structure):
    _fields_ = [
        ("type_name", C.c_char_p),
        ("blck_size", C.c_int64),
        ("blck_size_interleave", C.c_int64),
        ("type_size", C.c_size_t),
        ("is_quantized", C.c_bool),
        ("to_float", C.c_void_p),
        ("from_float_ref", C.c_void_p),
    ]


class TypeTraitsCpu(C.Structure):
    _fields_ = [
        ("from_float", C.c_void_p),
        ("vec_dot", C.c_void_p),
        ("vec_dot_type", C.c_int),
        ("nrows", C.c_int64),
    ]


_P, _I, _I64, _SZ, _B, _F = C.c_void_p, C.c_int, C.c_int64, C.c_size_t, C.c_bool, C.c_float
_BASE_API = {  # name: (restype, argtypes)
    "ggml_version": (C.c_char_p, []),
    "ggml_tensor_overhead": (_SZ, []),
    "ggml_graph_overhead_custom": (_SZ, [_SZ, _B]),
    "ggml_init": (_P, [InitParams]),
    "ggml_free": (None, [_P]),
    "ggml_new_tensor_2d": (_P, [_P, _I, _I64, _I64]),
    "ggml_new_tensor_3d": (_P, [_P, _I, _I64, _I64, _I64]),
    "ggml_set_name": (_P, [_P, C.c_char_p]),
    "ggml_get_data": (_P, [_P]),
    "ggml_nbytes": (_SZ, [_P]),
    "ggml_mul_mat": (_P, [_P, _P, _P]),
    "ggml_swiglu_split": (_P, [_P, _P, _P]),
    "ggml_get_rows": (_P, [_P, _P, _P]),
    "ggml_new_graph_custom": (_P, [_P, _SZ, _B]),
    "ggml_build_forward_expand": (None, [_P, _P]),
    "ggml_get_type_traits": (C.POINTER(TypeTraits), [_I]),
    "ggml_row_size": (_SZ, [_I, _I64]),
    "ggml_quantize_requires_imatrix": (_B, [_I]),
    "ggml_quantize_chunk": (_SZ, [_I, _P, _P, _I64, _I64, _I64, _P]),
    "ggml_threadpool_params_default": (ThreadpoolParams, [_I]),
    # what moestream's model graphs (ggml/net.py, ggml/layers.py) are built from
    "ggml_new_tensor_1d": (_P, [_P, _I, _I64]),
    "ggml_new_tensor_4d": (_P, [_P, _I, _I64, _I64, _I64, _I64]),
    "ggml_graph_n_nodes": (_I, [_P]),
    "ggml_graph_node": (_P, [_P, _I]),
    "ggml_rms_norm": (_P, [_P, _P, _F]),
    "ggml_mul": (_P, [_P, _P, _P]),
    "ggml_add": (_P, [_P, _P, _P]),
    "ggml_div": (_P, [_P, _P, _P]),
    "ggml_clamp": (_P, [_P, _P, _F, _F]),
    "ggml_scale": (_P, [_P, _P, _F]),
    "ggml_sum_rows": (_P, [_P, _P]),
    "ggml_out_prod": (_P, [_P, _P, _P]),
    "ggml_sigmoid": (_P, [_P, _P]),
    "ggml_silu": (_P, [_P, _P]),
    "ggml_soft_max": (_P, [_P, _P]),
    "ggml_argsort": (_P, [_P, _P, _I]),
    "ggml_cont": (_P, [_P, _P]),
    "ggml_transpose": (_P, [_P, _P]),
    "ggml_mul_mat_id": (_P, [_P, _P, _P, _P]),
    "ggml_cpy": (_P, [_P, _P, _P]),
    "ggml_set_rows": (_P, [_P, _P, _P, _P]),
    "ggml_reshape_2d": (_P, [_P, _P, _I64, _I64]),
    "ggml_reshape_3d": (_P, [_P, _P, _I64, _I64, _I64]),
    "ggml_view_1d": (_P, [_P, _P, _I64, _SZ]),
    "ggml_view_2d": (_P, [_P, _P, _I64, _I64, _SZ, _SZ]),
    "ggml_view_3d": (_P, [_P, _P, _I64, _I64, _I64, _SZ, _SZ, _SZ]),
    "ggml_permute": (_P, [_P, _P, _I, _I, _I, _I]),
    "ggml_rope_ext": (_P, [_P, _P, _P, _P, _I, _I, _I, _F, _F, _F, _F, _F, _F]),
    "ggml_flash_attn_ext": (_P, [_P, _P, _P, _P, _P, _F, _F, _F]),
    "ggml_flash_attn_ext_set_prec": (None, [_P, _I]),
    "ggml_flash_attn_ext_add_sinks": (None, [_P, _P]),
    # gpt-oss's experts: a bias row per expert id, the clamped SwiGLU
    "ggml_add_id": (_P, [_P, _P, _P, _P]),
    "ggml_swiglu_oai": (_P, [_P, _P, _P, _F, _F]),
    # DeepSeek's MLA (a query and a cache row of two parts) and group-limited routing
    "ggml_concat": (_P, [_P, _P, _P, _I]),
    "ggml_sub": (_P, [_P, _P, _P]),
    "ggml_neg": (_P, [_P, _P]),
    "ggml_step": (_P, [_P, _P]),
    # the greedy token on a backend, and the check that it is numpy's (graphs/layers.py, `greedy`)
    "ggml_argmax": (_P, [_P, _P]),
    "ggml_sgn_inplace": (_P, [_P, _P]),
    "ggml_pool_2d": (_P, [_P, _P, _I, _I, _I, _I, _I, _F, _F]),
}
# Qwen3-Next / Qwen3.5's Gated DeltaNet layers: declared where the library has them (an older ggml
# loads without them; those families then run transformers' forward, and the mode line says why)
_GATED_DELTA_NET_API = {
    "ggml_ssm_conv": (_P, [_P, _P, _P]),
    "ggml_l2_norm": (_P, [_P, _P, _F]),
    "ggml_softplus": (_P, [_P, _P]),
    "ggml_repeat_4d": (_P, [_P, _P, _I64, _I64, _I64, _I64]),
    "ggml_reshape_4d": (_P, [_P, _P, _I64, _I64, _I64, _I64]),
    "ggml_gated_delta_net": (_P, [_P, _P, _P, _P, _P, _P, _P, _I64]),
}
# ggml's backend API (ggml-backend.h, in ggml-base): a device's buffers, graph compute and events, and
# the scheduler across devices (moestream/ggml/backend.py)
_BACKEND_API = {
    "ggml_backend_name": (C.c_char_p, [_P]),
    "ggml_backend_free": (None, [_P]),
    "ggml_backend_get_default_buffer_type": (_P, [_P]),
    "ggml_backend_get_device": (_P, [_P]),
    "ggml_backend_synchronize": (None, [_P]),
    "ggml_backend_graph_compute": (_I, [_P, _P]),
    "ggml_backend_graph_compute_async": (_I, [_P, _P]),
    "ggml_backend_supports_op": (_B, [_P, _P]),
    "ggml_backend_tensor_set": (None, [_P, _P, _SZ, _SZ]),
    "ggml_backend_tensor_get": (None, [_P, _P, _SZ, _SZ]),
    "ggml_backend_tensor_set_async": (None, [_P, _P, _P, _SZ, _SZ]),
    "ggml_backend_tensor_get_async": (None, [_P, _P, _P, _SZ, _SZ]),
    "ggml_backend_tensor_memset": (None, [_P, C.c_uint8, _SZ, _SZ]),
    "ggml_backend_tensor_alloc": (_I, [_P, _P, _P]),
    "ggml_backend_view_init": (_I, [_P]),
    "ggml_backend_buft_name": (C.c_char_p, [_P]),
    "ggml_backend_buft_alloc_buffer": (_P, [_P, _SZ]),
    "ggml_backend_buft_get_alignment": (_SZ, [_P]),
    "ggml_backend_buft_get_alloc_size": (_SZ, [_P, _P]),
    "ggml_backend_buft_is_host": (_B, [_P]),
    "ggml_backend_buffer_free": (None, [_P]),
    "ggml_backend_buffer_get_base": (_P, [_P]),
    "ggml_backend_buffer_get_size": (_SZ, [_P]),
    "ggml_backend_buffer_clear": (None, [_P, C.c_uint8]),
    "ggml_backend_buffer_set_usage": (None, [_P, _I]),
    "ggml_backend_cpu_buffer_type": (_P, []),
    "ggml_backend_cpu_buffer_from_ptr": (_P, [_P, _SZ]),
    "ggml_backend_dev_description": (C.c_char_p, [_P]),
    "ggml_backend_dev_type": (_I, [_P]),
    "ggml_backend_reg_dev_count": (_SZ, [_P]),
    "ggml_backend_reg_dev_get": (_P, [_P, _SZ]),
    "ggml_backend_event_new": (_P, [_P]),
    "ggml_backend_event_free": (None, [_P]),
    "ggml_backend_event_record": (None, [_P, _P]),
    "ggml_backend_event_synchronize": (None, [_P]),
    "ggml_backend_event_wait": (None, [_P, _P]),
    "ggml_backend_sched_new": (_P, [C.POINTER(_P), C.POINTER(_P), _I, _SZ, _B, _B]),
    "ggml_backend_sched_free": (None, [_P]),
    "ggml_backend_sched_reserve": (_B, [_P, _P]),
    "ggml_backend_sched_alloc_graph": (_B, [_P, _P]),
    "ggml_backend_sched_graph_compute": (_I, [_P, _P]),
    "ggml_backend_sched_get_n_splits": (_I, [_P]),
    "ggml_backend_sched_get_tensor_backend": (_P, [_P, _P]),
    "ggml_backend_sched_set_tensor_backend": (None, [_P, _P, _P]),
    "ggml_backend_sched_reset": (None, [_P]),
    "ggml_op_name": (C.c_char_p, [_I]),
}
_CPU_BACKEND_API = {
    "ggml_backend_cpu_init": (_P, []),
    "ggml_backend_cpu_reg": (_P, []),
    "ggml_backend_cpu_set_n_threads": (None, [_P, _I]),
    "ggml_backend_cpu_set_threadpool": (None, [_P, _P]),
}
# libggml-cuda (ggml-cuda.h): loaded only when a CUDA backend is asked for (`cuda_library`)
_CUDA_API = {
    "ggml_backend_cuda_init": (_P, [_I]),
    "ggml_backend_cuda_get_device_count": (_I, []),
    "ggml_backend_cuda_reg": (_P, []),
    "ggml_backend_cuda_buffer_type": (_P, [_I]),
    "ggml_backend_cuda_host_buffer_type": (_P, []),
    "ggml_backend_cuda_get_device_description": (None, [_I, C.c_char_p, _SZ]),
    "ggml_backend_cuda_get_device_memory": (None, [_I, C.POINTER(_SZ), C.POINTER(_SZ)]),
    "ggml_backend_cuda_register_host_buffer": (_B, [_P, _SZ]),
    "ggml_backend_cuda_unregister_host_buffer": (None, [_P]),
}
_CPU_API = {
    "ggml_cpu_init": (None, []),
    "ggml_get_type_traits_cpu": (C.POINTER(TypeTraitsCpu), [_I]),
    "ggml_threadpool_new": (_P, [C.POINTER(ThreadpoolParams)]),
    "ggml_threadpool_free": (None, [_P]),
    "ggml_threadpool_pause": (None, [_P]),
    "ggml_threadpool_resume": (None, [_P]),
    "ggml_graph_plan": (Cplan, [_P, _I, _P]),
    "ggml_graph_compute": (_I, [_P, C.POINTER(Cplan)]),
}
# ggml_cpu_has_<name>: the compiled-in features named in the mode line, in this order.
_ISA_NAMES = (
    "avx2",
    "avx512",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_int8",
    "neon",
    "dotprod",
    "matmul_int8",
    "sve",
    "sme",
    "llamafile",
)


@dataclass(frozen=True)
class Library:
    """A loaded ggml: `base` and `cpu` are the ctypes handles; `describe()` is for the mode line."""

    base: C.CDLL
    cpu: C.CDLL
    folder: Path
    kind: str  # "prebuilt" | "native" | "custom"
    version: str  # ggml's own version string, e.g. "0.20.2"
    isa: tuple[str, ...]
    gated_delta_net: bool = False  # the Gated DeltaNet ops are declared (_GATED_DELTA_NET_API)
    # built with OpenMP (llama.cpp's default; not the wheel's or `make native`'s): its graphs are computed
    # from one thread only (`graphs.compute_graph`)
    openmp: bool = False

    def describe(self) -> str:
        """E.g. 'ggml 0.25.3 native (AVX2, AVX512, AVX512_VNNI, ...)', or for a build that lacks what this
        CPU has: 'ggml 0.20.2 prebuilt (AVX2; not using this CPU's AVX512, AVX512_VNNI: make native)'."""
        unused = unused_isa(self.isa, cpu_flags())
        note = f"; not using this CPU's {', '.join(unused)}: make native" if unused else ""
        omp = ", OpenMP: one compute thread" if self.openmp else ""
        return f"ggml {self.version} {self.kind} ({', '.join(self.isa) or 'no SIMD'}{omp}{note})"


# /proc/cpuinfo flag -> ggml_cpu_has_<name>, for the features a build may leave unused
_CPU_FEATURES = {
    "avx2": "AVX2",
    "avx512f": "AVX512",
    "avx512_vnni": "AVX512_VNNI",
    "avx512_bf16": "AVX512_BF16",
    "avx_vnni": "AVX_VNNI",
    "amx_int8": "AMX_INT8",
    "asimddp": "DOTPROD",
    "i8mm": "MATMUL_INT8",
    "sve": "SVE",
}


def unused_isa(isa: tuple[str, ...], flags: set[str]) -> list[str]:
    """The CPU's kernel-relevant features (from /proc/cpuinfo `flags`) that a build with `isa` lacks."""
    return [name for flag, name in _CPU_FEATURES.items() if flag in flags and name not in isa]


def locate() -> tuple[Path, str]:
    """The folder of the ggml libraries to load and its kind, following the order in the module doc."""
    env = os.environ.get("MOESTREAM_GGML_LIB", "").strip()
    if env and env != "prebuilt":
        folder = Path(env)
        if (folder / "lib").is_dir():
            folder = folder / "lib"
        if not (folder / "libggml-base.so").exists() or not (folder / "libggml-cpu.so").exists():
            raise GgmlUnavailableError(
                f"MOESTREAM_GGML_LIB={env} holds no libggml-base.so and libggml-cpu.so."
            )
        return folder, "native" if (folder.parent / "build.json").exists() else "custom"
    if not env and (native_dir() / "build.json").exists():
        return native_dir() / "lib", "native"
    try:
        import libggml
    except ImportError:
        raise GgmlUnavailableError(
            "ggml is not installed: pip install libggml-python, or run `make native`."
        ) from None
    root = Path(libggml.__file__).parent
    for sub in ("lib64", "lib"):
        if (root / sub / "libggml-cpu.so").exists():
            return root / sub, "prebuilt"
    raise GgmlUnavailableError(
        f"the libggml-python package at {root} has no libggml-cpu.so for this platform; run `make native`."
    )


def check_cpu(kind: str, machine: str, flags: set[str], build_flags: set[str] | None = None) -> None:
    """Refuse a library whose instructions this CPU lacks (fake `flags` to test it)."""
    if not flags:  # /proc/cpuinfo unreadable: nothing to check against
        return
    if kind == "prebuilt" and machine in ("x86_64", "AMD64"):
        missing = [f for f in PREBUILT_X86_FLAGS if f not in flags]
        if missing:
            raise GgmlUnavailableError(
                f"this CPU lacks {', '.join(m.upper() for m in missing)}, which the prebuilt ggml library "
                "(libggml-python) needs; run `make native` to build ggml for this CPU."
            )
    if build_flags is not None:
        missing = sorted(f for f in build_flags - flags if f.startswith(_ISA_PREFIXES))
        if missing:
            raise GgmlUnavailableError(
                f"the native ggml build was compiled on a CPU with {', '.join(missing)}, which this CPU "
                "lacks; run `make native` again on this machine."
            )


def _declare(lib: C.CDLL, api: dict) -> None:
    for name, (res, args) in api.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


def _check_layout(base: C.CDLL) -> None:
    """Create a tensor and read it back through our struct: a library of another layout is refused."""
    if base.ggml_tensor_overhead() != C.sizeof(GgmlObject) + C.sizeof(GgmlTensor):
        raise GgmlUnavailableError(
            f"ggml's tensor struct is {base.ggml_tensor_overhead() - C.sizeof(GgmlObject)} bytes, "
            f"moestream expects {C.sizeof(GgmlTensor)}: this ggml version is not supported."
        )
    ctx = base.ggml_init(InitParams(4 * base.ggml_tensor_overhead(), None, True))
    try:
        ptr = base.ggml_new_tensor_2d(ctx, 0, 7, 3)  # F32 [3, 7]
        base.ggml_set_name(ptr, b"probe")
        t = GgmlTensor.from_address(ptr)
        t.data = 0x1000
        ok = (
            t.type == 0
            and tuple(t.ne) == (7, 3, 1, 1)
            and tuple(t.nb) == (4, 28, 84, 84)
            and t.name == b"probe"
            and base.ggml_get_data(ptr) == 0x1000
            and base.ggml_nbytes(ptr) == 84
        )
    finally:
        base.ggml_free(ctx)
    tp = base.ggml_threadpool_params_default(3)
    ok = ok and tp.n_threads == 3 and tp.poll == 50 and not tp.paused and not any(tp.cpumask)
    if not ok:
        raise GgmlUnavailableError(
            "ggml's struct layout differs from moestream's binding: this ggml version "
            "is not supported (use libggml-python 0.20.x or `make native`)."
        )


def elf_needed(path: Path) -> list[str]:
    """The libraries the ELF shared object `path` names as DT_NEEDED, in order (`power.elfsyms`); [] for
    any other file."""
    try:
        return needed_libraries(path)
    except ElfError:
        return []


def load() -> Library:
    """Locate, check and load ggml; raises GgmlUnavailableError with the reason and the remedy."""
    folder, kind = locate()
    build = folder.parent / "build.json"
    build_flags = set(json.loads(build.read_text())["cpu_flags"]) if kind == "native" else None
    check_cpu(kind, platform.machine(), cpu_flags(), build_flags)
    try:  # base first, by path: libggml-cpu's DT_NEEDED libggml-base.so.0 then binds to this very copy
        base = C.CDLL(str(folder / "libggml-base.so"))
        cpu = C.CDLL(str(folder / "libggml-cpu.so"))
        _declare(base, _BASE_API)
        _declare(cpu, _CPU_API)
    except (OSError, AttributeError) as e:
        raise GgmlUnavailableError(f"cannot load ggml from {folder}: {e}") from e
    _check_layout(base)
    gated_delta_net = all(hasattr(base, name) for name in _GATED_DELTA_NET_API)
    if gated_delta_net:
        _declare(base, _GATED_DELTA_NET_API)
    _declare(base, _BACKEND_API)
    _declare(cpu, _CPU_BACKEND_API)
    cpu.ggml_cpu_init()
    isa = []
    for name in _ISA_NAMES:
        fn = getattr(cpu, f"ggml_cpu_has_{name}", None)
        if fn is not None and fn():
            isa.append(name.upper())
    # the CPU library's own DT_NEEDED, not a handle's lookup: llama.cpp's default libggml-base links
    # libgomp too (for its quantisation loops), so a native libggml-cpu beside it (one ggml, its CPU
    # library rebuilt with ggml's own thread pool) would look like an OpenMP build
    openmp = any(
        name.startswith(("libgomp", "libomp", "libiomp")) for name in elf_needed(folder / "libggml-cpu.so")
    )
    return Library(base, cpu, folder, kind, base.ggml_version().decode(), tuple(isa), gated_delta_net, openmp)


_LIB: Library | None = None
_CUDA: C.CDLL | None = None


def library() -> Library:
    """The process-wide ggml, loaded on first use (one per process: both builds share their sonames)."""
    global _LIB
    if _LIB is None:
        _LIB = load()
    return _LIB


CUDA_HOW = (
    "`make native CUDA=1` builds ggml's CUDA backend for this GPU (it needs nvcc: the CUDA toolkit, or "
    "`pip install nvidia-cuda-nvcc nvidia-cuda-cccl` matched to torch's CUDA), or point MOESTREAM_GGML_LIB "
    "at a folder holding libggml-base.so, libggml-cpu.so and libggml-cuda.so of one ggml build"
)


def cuda_library() -> C.CDLL:
    """libggml-cuda from the folder the loaded ggml came from (the same build: it links that very
    libggml-base), loaded once. Raises GgmlUnavailableError saying what is missing and how to get it."""
    global _CUDA
    if _CUDA is None:
        lib = library()
        path = lib.folder / "libggml-cuda.so"
        if not path.exists():
            raise GgmlUnavailableError(
                f"the ggml at {lib.folder} has no CUDA backend (no libggml-cuda.so): {CUDA_HOW}."
            )
        try:
            cuda = C.CDLL(str(path))
            _declare(cuda, _CUDA_API)
        except (OSError, AttributeError) as e:
            raise GgmlUnavailableError(f"cannot load ggml's CUDA backend {path} ({e}): {CUDA_HOW}.") from e
        _CUDA = cuda
    return _CUDA
