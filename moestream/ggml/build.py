"""`make native`: build ggml's CPU backend for this machine's ISA from the llama-cpp-python sdist.

The prebuilt libggml-python wheel is compiled for a baseline (AVX2 on x86, armv8.0 on aarch64); a
GGML_NATIVE=ON build adds AVX512/VNNI/BF16, ARM dotprod/i8mm and llamafile's sgemm. The sdist vendors
llama.cpp, whose ggml is configured from the llama.cpp root (its ggml/ folder alone lacks ggml.pc.in).

    python -m moestream.ggml.build [--dest DIR] [--jobs N]

Output: DIR/lib/libggml-base.so*, DIR/lib/libggml-cpu.so* and DIR/build.json (version, ISA flags of the
build machine, build seconds), where DIR defaults to `native_dir()` and moestream finds it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=ON", "-DGGML_OPENMP=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF",
]


def native_dir() -> Path:
    """Where `make native` puts its build: $MOESTREAM_HOME/ggml-native (default ~/.cache/moestream)."""
    home = os.environ.get("MOESTREAM_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "moestream")
    return Path(home) / "ggml-native"


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 'flags', ARM 'Features'); empty where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def _fetch_source(work: Path) -> tuple[Path, str]:
    """Download the sdist with pip and extract its vendored llama.cpp; returns (root, ggml version)."""
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", str(work)])
    archive = next(work.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        tar.extractall(work, members=members, filter="data")
    root = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    version = []
    for line in (root / "ggml" / "CMakeLists.txt").read_text().splitlines():
        for part in ("MAJOR", "MINOR", "PATCH"):
            if line.startswith(f"set(GGML_VERSION_{part} "):
                version.append(line.split()[1].rstrip(")"))
    return root, ".".join(version)


def build(dest: Path, jobs: int) -> dict:
    """Configure and build ggml-base and ggml-cpu, install the shared libs under dest/lib."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"make native needs {tool} on PATH (e.g. apt-get install cmake g++)")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    with tempfile.TemporaryDirectory(prefix="moestream-ggml-") as tmp:
        work = Path(tmp)
        root, version = _fetch_source(work)
        t0 = time.perf_counter()
        _run(["cmake", "-S", str(root), "-B", str(work / "build"), *generator, *CMAKE_FLAGS])
        _run(["cmake", "--build", str(work / "build"), "--target", "ggml-base", "ggml-cpu", "-j", str(jobs)])
        seconds = time.perf_counter() - t0
        libs = [p for p in (work / "build" / "bin").iterdir() if p.name.startswith(("libggml-base.so",
                                                                                    "libggml-cpu.so"))]
        if dest.exists():
            shutil.rmtree(dest)
        (dest / "lib").mkdir(parents=True)
        for p in libs:  # keep the soname symlinks as links
            shutil.copy2(p, dest / "lib" / p.name, follow_symlinks=False)
    info = {"ggml_version": version, "source": SDIST, "build_seconds": round(seconds, 1), "jobs": jobs,
            "generator": "ninja" if generator else "make", "cmake_flags": CMAKE_FLAGS,
            "machine": platform.machine(), "cpu_flags": sorted(cpu_flags()),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    (dest / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m moestream.ggml.build", description=__doc__.split("\n")[0])
    p.add_argument("--dest", type=Path, default=None, help="install folder (default: native_dir())")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs")
    args = p.parse_args(argv)
    dest = args.dest or native_dir()
    info = build(dest, args.jobs)
    print(f"ggml {info['ggml_version']} native built in {info['build_seconds']} s "
          f"({info['jobs']} jobs, {info['generator']}) into {dest}")


if __name__ == "__main__":
    main()
