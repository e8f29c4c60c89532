"""`make native`: build ggml's CPU backend for this machine's ISA from the llama-cpp-python sdist.

The prebuilt libggml-python wheel is compiled for a baseline (AVX2 on x86, armv8.0 on aarch64); a
GGML_NATIVE=ON build adds AVX512/VNNI/BF16, ARM dotprod/i8mm and llamafile's sgemm. The sdist vendors
llama.cpp, whose ggml is configured from the llama.cpp root (its ggml/ folder alone lacks ggml.pc.in).

    python -m moestream.ggml.build [--dest DIR] [--jobs N] [--source LLAMA_CPP_DIR]

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


def build(dest: Path, jobs: int, source: Path | None = None, sdist_dir: Path | None = None) -> dict:
    """Configure and build ggml-base and ggml-cpu, install the shared libs under dest/lib; `source`: a
    llama.cpp tree to build from instead of the sdist's; `sdist_dir`: where the sdist is (or goes)."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"make native needs {tool} on PATH (e.g. apt-get install cmake g++)")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    dest.parent.mkdir(parents=True, exist_ok=True)
    log = dest.parent / "ggml-native-build.log"
    log.write_text("")
    with tempfile.TemporaryDirectory(prefix="moestream-ggml-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        root, version = _local_source(source) if source else _fetch_source(work, log, sdist_dir)
        t1 = time.perf_counter()
        _run(["cmake", "-S", str(root), "-B", str(work / "build"), *generator, *CMAKE_FLAGS], log)
        targets = ["--target", "ggml-base", "ggml-cpu"]
        _run(["cmake", "--build", str(work / "build"), *targets, "-j", str(jobs)], log)
        seconds = time.perf_counter() - t1
        libs = [
            p
            for p in (work / "build" / "bin").iterdir()
            if p.name.startswith(("libggml-base.so", "libggml-cpu.so"))
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
        "cmake_flags": CMAKE_FLAGS,
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
    args = p.parse_args(argv)
    dest = args.dest or native_dir()
    if args.if_needed:
        reason = _why_build(dest)
        if reason is None:
            return
        print(f"make native: {reason}", flush=True)
    info = build(dest, args.jobs, args.source, args.sdist_dir)
    print(
        f"ggml {info['ggml_version']} native: sdist fetched in {info['fetch_seconds']} s, built in "
        f"{info['build_seconds']} s ({info['jobs']} jobs, {info['generator']}) into {dest}"
    )


if __name__ == "__main__":
    main()
