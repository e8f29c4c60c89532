"""`make native`: build ggml's CPU backend for this machine's ISA from the llama-cpp-python sdist.

The prebuilt libggml-python wheel is compiled for a baseline (AVX2 on x86, armv8.0 on aarch64); a
GGML_NATIVE=ON build adds AVX512/VNNI/BF16, ARM dotprod/i8mm and llamafile's sgemm. The sdist vendors
llama.cpp, whose ggml is configured from the llama.cpp root (its ggml/ folder alone lacks ggml.pc.in).

    python -m moestream.ggml.build [--dest DIR] [--jobs N] [--source LLAMA_CPP_DIR] [--cuda [--cuda-arch 90]]

Output: DIR/lib/libggml-base.so*, DIR/lib/libggml-cpu.so* and DIR/build.json (version, ISA flags of the
build machine, build seconds), where DIR defaults to `native_dir()` and moestream finds it.

`--cuda` (`make native CUDA=1`) adds ggml's CUDA backend, DIR/lib/libggml-cuda.so*, built from the same
tree (the same ggml) for this machine's GPU (`--cuda-arch native`, the default where a GPU is visible)
or the architectures named (`--cuda-arch 87` for a Jetson Orin; `90` an H100/H200). The compiler is
the system's nvcc (PATH, $CUDA_HOME, /usr/local/cuda), else NVIDIA's from PyPI (`nvidia-cuda-nvcc` with
its headers from `nvidia-cuda-cccl`, the CUDA version of the installed torch).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from moestream.ggml.host import cpu_flags, native_dir
from moestream.ggml.sdist import SDIST, download

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_OPENMP=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_CURL=OFF",
]


def _run(cmd: list[str], log: Path) -> None:
    """Run cmd with its output appended to log; on failure show the log's tail and stop."""
    print("+ " + " ".join(cmd), flush=True)
    with log.open("a") as f:
        f.write("+ " + " ".join(cmd) + "\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = log.read_text().splitlines()[-40:]
        raise SystemExit("\n".join(tail) + f"\nmake native: {cmd[0]} failed ({done.returncode}), log {log}")


def _fetch_source(work: Path, log: Path, sdist_dir: Path | None) -> tuple[Path, str]:
    """The sdist (from `sdist_dir` when `make setup` downloaded it there already, else downloaded now)
    with its vendored llama.cpp extracted into `work`; returns (root, ggml version)."""
    with log.open("a") as f:
        archive = download(sdist_dir or work, f)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        tar.extractall(work, members=members, filter="data")
    return _local_source(next(work.glob("llama_cpp_python-*/vendor/llama.cpp")))


def _local_source(root: Path) -> tuple[Path, str]:
    """A llama.cpp tree already on disk (a machine without PyPI): its root and ggml version."""
    if not (root / "ggml" / "CMakeLists.txt").exists():
        raise SystemExit(f"make native: {root} is not a llama.cpp source tree (no ggml/CMakeLists.txt)")
    version = []
    for line in (root / "ggml" / "CMakeLists.txt").read_text().splitlines():
        for part in ("MAJOR", "MINOR", "PATCH"):
            if line.startswith(f"set(GGML_VERSION_{part} "):
                version.append(line.split()[1].rstrip(")"))
    return root, ".".join(version)


def find_nvcc(env: dict[str, str] | None = None) -> Path | None:
    """The CUDA compiler to build ggml's CUDA backend with: the system's (PATH, $CUDA_HOME,
    /usr/local/cuda), else the one NVIDIA ships on PyPI (`nvidia-cuda-nvcc`) in this Python's packages."""
    env = os.environ if env is None else env
    found = shutil.which("nvcc", path=env.get("PATH", ""))
    if found:
        return Path(found)
    for root in (env.get("CUDA_HOME"), env.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return Path(root) / "bin" / "nvcc"
    for root in _nvidia_roots():  # NVIDIA's wheels
        if (root / "bin" / "nvcc").exists():
            return root / "bin" / "nvcc"
    return None


def nvcc_missing() -> str:
    """What to do without nvcc: the PyPI packages matched to the CUDA of the installed torch."""
    try:
        import torch

        cuda = torch.version.cuda
    except ImportError:
        cuda = None
    pin = f"=={cuda.split('.')[0]}.{cuda.split('.')[1]}.*" if cuda else ""
    return (
        "make native CUDA=1 needs nvcc, the CUDA compiler: install the CUDA toolkit, or "
        f"pip install 'nvidia-cuda-nvcc{pin}' 'nvidia-cuda-cccl{pin}'"
        + (f" (torch here is built for CUDA {cuda})" if cuda else "")
    )


def _nvidia_roots() -> list[Path]:
    """The folders of NVIDIA's PyPI wheels (nvidia/cu13, nvidia/cublas, ...) on this Python's path: a
    CUDA build of torch brings cuBLAS that way."""
    try:
        import nvidia
    except ImportError:
        return []
    return [p for base in getattr(nvidia, "__path__", []) for p in sorted(Path(base).iterdir()) if p.is_dir()]


def pypi_cublas(toolkit: Path) -> list[str]:
    """cmake flags naming cuBLAS where the toolkit of `toolkit` (nvcc's root) has none but NVIDIA's
    `nvidia-cublas` wheel is installed (its libraries carry only versioned names, which CMake's search
    does not find by itself; its headers go to nvcc)."""
    if any((toolkit / sub / "libcublas.so").exists() for sub in ("lib64", "lib", "targets")):
        return []
    for root in _nvidia_roots():
        libs = {p.name.split(".so")[0]: p for p in sorted((root / "lib").glob("libcublas*.so*"))}
        if "libcublas" in libs and "libcublasLt" in libs and (root / "include" / "cublas_v2.h").exists():
            return [
                f"-DCUDA_cublas_LIBRARY={libs['libcublas']}",
                f"-DCUDA_cublasLt_LIBRARY={libs['libcublasLt']}",
                f"-DCMAKE_CUDA_FLAGS=-I{root / 'include'}",
            ]
    return []


def cuda_flags(nvcc: Path, arch: str) -> list[str]:
    """cmake flags of ggml's CUDA backend for `arch` ("native", or CMake's list such as "87" or "90")."""
    flags = ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", f"-DCMAKE_CUDA_COMPILER={nvcc}"]
    toolkit = nvcc.resolve().parent.parent
    if "site-packages" in str(nvcc) or "dist-packages" in str(nvcc):  # PyPI's: a toolkit root of its own
        flags.append(f"-DCUDAToolkit_ROOT={toolkit}")
    return flags + pypi_cublas(toolkit) + _no_driver(toolkit)


def _no_driver(toolkit: Path) -> list[str]:
    """Without the driver's libcuda to link (a build machine with no GPU driver, no toolkit stubs), ggml's
    CUDA backend is built without its VMM memory pool, which alone links it (it then uses its pool of
    cudaMalloc'ed blocks)."""
    import ctypes.util

    stubs = [toolkit / sub / "stubs" / "libcuda.so" for sub in ("lib64", "lib")]
    if any(p.exists() for p in stubs) or ctypes.util.find_library("cuda"):
        return []
    return ["-DGGML_CUDA_NO_VMM=ON"]


def default_cuda_arch() -> str | None:
    """ "native" where this machine shows a GPU (nvidia-smi lists one), else None: then name one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    done = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return "native" if done.returncode == 0 and "GPU" in done.stdout else None


def build(
    dest: Path,
    jobs: int,
    source: Path | None = None,
    sdist_dir: Path | None = None,
    cuda_arch: str | None = None,
) -> dict:
    """Configure and build ggml-base and ggml-cpu (and with `cuda_arch`, ggml-cuda for it), install the
    shared libs under dest/lib; `source`: a llama.cpp tree to build from instead of the sdist's;
    `sdist_dir`: where the sdist is (or goes)."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"make native needs {tool} on PATH (e.g. apt-get install cmake g++)")
    cuda: list[str] = []
    if cuda_arch is not None:
        nvcc = find_nvcc()
        if nvcc is None:
            raise SystemExit(nvcc_missing())
        cuda = cuda_flags(nvcc, cuda_arch)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    dest.parent.mkdir(parents=True, exist_ok=True)
    log = dest.parent / "ggml-native-build.log"
    log.write_text("")
    with tempfile.TemporaryDirectory(prefix="moestream-ggml-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        root, version = _local_source(source) if source else _fetch_source(work, log, sdist_dir)
        t1 = time.perf_counter()
        _run(["cmake", "-S", str(root), "-B", str(work / "build"), *generator, *CMAKE_FLAGS, *cuda], log)
        targets = ["--target", "ggml-base", "ggml-cpu", *(["ggml-cuda"] if cuda else [])]
        _run(["cmake", "--build", str(work / "build"), *targets, "-j", str(jobs)], log)
        seconds = time.perf_counter() - t1
        libs = [
            p
            for p in (work / "build" / "bin").iterdir()
            if p.name.startswith(("libggml-base.so", "libggml-cpu.so", "libggml-cuda.so"))
        ]
        if dest.exists():
            shutil.rmtree(dest)
        (dest / "lib").mkdir(parents=True)
        for p in libs:  # keep the soname symlinks as links
            shutil.copy2(p, dest / "lib" / p.name, follow_symlinks=False)
    info = {
        "ggml_version": version,
        "source": str(source) if source else SDIST,
        "fetch_seconds": round(t1 - t0, 1),
        "build_seconds": round(seconds, 1),
        "jobs": jobs,
        "generator": "ninja" if generator else "make",
        "cmake_flags": CMAKE_FLAGS + cuda,
        "cuda_arch": cuda_arch,
        "machine": platform.machine(),
        "cpu_flags": sorted(cpu_flags()),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
    (dest / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def _why_build(dest: Path) -> str | None:
    """Why this machine wants a native build (None: it does not, or has one)."""
    if (dest / "build.json").exists():
        return None
    from moestream.ggml.lib import GgmlUnavailableError, library, unused_isa

    try:
        isa = library().isa
    except GgmlUnavailableError as exc:
        return f"the prebuilt ggml cannot run here ({exc}); building ggml for this CPU"
    unused = unused_isa(isa, cpu_flags())
    if not unused:
        return None
    return f"the prebuilt ggml leaves this CPU's {', '.join(unused)} unused; building ggml for this CPU"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m moestream.ggml.build", description=__doc__.split("\n")[0])
    p.add_argument("--dest", type=Path, default=None, help="install folder (default: native_dir())")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs")
    p.add_argument("--source", type=Path, help="a llama.cpp source tree on disk (default: the sdist's)")
    p.add_argument(
        "--sdist-dir",
        type=Path,
        help="a folder holding the sdist (downloaded there if missing; `make setup` fetches it into the "
        "venv while pip installs)",
    )
    p.add_argument(
        "--if-needed",
        action="store_true",
        help="build only when the prebuilt library leaves features of this CPU unused (AVX512, VNNI, "
        "dotprod, ...) and no native build is there yet (what `make setup` runs)",
    )
    p.add_argument(
        "--cuda",
        action="store_true",
        help="also build ggml's CUDA backend (needs nvcc: the CUDA toolkit, or NVIDIA's PyPI packages)",
    )
    p.add_argument(
        "--cuda-arch",
        default=None,
        help="CUDA architectures (CMake's list: 87 for a Jetson Orin, 90 for an H100/H200; default: this "
        "machine's GPU)",
    )
    args = p.parse_args(argv)
    dest = args.dest or native_dir()
    cuda_arch = None
    if args.cuda or args.cuda_arch:
        cuda_arch = args.cuda_arch or default_cuda_arch()
        if cuda_arch is None:
            raise SystemExit(
                "make native CUDA=1: no GPU is visible here (nvidia-smi lists none): name the "
                "architecture to build for, e.g. CUDA_ARCH=87 (Jetson Orin) or CUDA_ARCH=90 (H100/H200)"
            )
    if args.if_needed:
        reason = _why_build(dest)
        if reason is None:
            return
        print(f"make native: {reason}", flush=True)
    info = build(dest, args.jobs, args.source, args.sdist_dir, cuda_arch)
    with_cuda = f" with CUDA ({cuda_arch})" if cuda_arch else ""
    print(
        f"ggml {info['ggml_version']} native{with_cuda}: sdist fetched in {info['fetch_seconds']} s, built "
        f"in {info['build_seconds']} s ({info['jobs']} jobs, {info['generator']}) into {dest}"
    )


if __name__ == "__main__":
    main()
