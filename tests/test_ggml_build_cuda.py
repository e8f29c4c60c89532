"""`make native CUDA=1`: which nvcc, the cmake flags of ggml's CUDA backend, and what a machine without
nvcc or a visible GPU is told (the build itself is timed in BENCHMARKS.md: it takes tens of minutes)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from moestream.ggml import build


def _fake_nvcc(folder: Path) -> Path:
    (folder / "bin").mkdir(parents=True)
    nvcc = folder / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return nvcc


def test_nvcc_is_found_on_path_then_in_cuda_home(tmp_path):
    on_path = _fake_nvcc(tmp_path / "path")
    home = _fake_nvcc(tmp_path / "home")
    assert build.find_nvcc({"PATH": str(on_path.parent), "CUDA_HOME": str(home.parent.parent)}) == on_path
    assert build.find_nvcc({"PATH": "", "CUDA_HOME": str(home.parent.parent)}) == home


def _driver(monkeypatch, present: bool) -> None:
    """Whether the driver's libcuda can be found: this machine's own answer must not decide the flags."""
    import ctypes.util

    real = ctypes.util.find_library
    monkeypatch.setattr(
        ctypes.util,
        "find_library",
        lambda name: ("libcuda.so.1" if present else None) if name == "cuda" else real(name),
    )


def test_cuda_flags_name_the_architecture_and_the_compiler(tmp_path, monkeypatch):
    _driver(monkeypatch, present=True)
    nvcc = _fake_nvcc(tmp_path / "cuda")
    flags = build.cuda_flags(nvcc, "87")
    assert flags[:3] == ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=87", f"-DCMAKE_CUDA_COMPILER={nvcc}"]
    pypi = _fake_nvcc(tmp_path / "venv/lib/python3.11/site-packages/nvidia/cuda_nvcc")
    assert f"-DCUDAToolkit_ROOT={pypi.parent.parent}" in build.cuda_flags(pypi, "native")


def test_no_driver_library_builds_without_the_vmm_pool(tmp_path, monkeypatch):
    _driver(monkeypatch, present=False)
    nvcc = _fake_nvcc(tmp_path / "cuda")
    assert build.cuda_flags(nvcc, "90")[-1] == "-DGGML_CUDA_NO_VMM=ON"
    (tmp_path / "cuda/lib64/stubs").mkdir(parents=True)
    (tmp_path / "cuda/lib64/stubs/libcuda.so").write_bytes(b"")  # the toolkit's stub links it
    assert "-DGGML_CUDA_NO_VMM=ON" not in build.cuda_flags(nvcc, "90")


def test_no_nvcc_says_which_packages_to_install(monkeypatch):
    monkeypatch.setattr(build, "find_nvcc", lambda env=None: None)
    with pytest.raises(SystemExit, match=r"needs nvcc.*pip install 'nvidia-cuda-nvcc"):
        build.build(Path("/nonexistent/ggml"), 1, cuda_arch="90")


def test_no_visible_gpu_asks_for_an_architecture(monkeypatch):
    monkeypatch.setattr(build, "default_cuda_arch", lambda: None)
    with pytest.raises(SystemExit, match=r"no GPU is visible.*CUDA_ARCH=87 \(Jetson Orin\)"):
        build.main(["--cuda", "--dest", "/nonexistent/ggml"])


def test_cublas_from_nvidias_wheel_where_the_toolkit_has_none(tmp_path, monkeypatch):
    """A toolkit without cuBLAS (NVIDIA's nvcc alone) and the `nvidia-cublas` wheel (what a CUDA torch
    brings): its versioned libraries are named to cmake, its headers to nvcc."""
    wheel = tmp_path / "site-packages/nvidia/cu13"
    (wheel / "lib").mkdir(parents=True)
    (wheel / "include").mkdir()
    for name in ("libcublas.so.13", "libcublasLt.so.13"):
        (wheel / "lib" / name).write_bytes(b"")
    (wheel / "include" / "cublas_v2.h").write_text("")
    monkeypatch.setattr(build, "_nvidia_roots", lambda: [wheel])
    flags = build.cuda_flags(_fake_nvcc(tmp_path / "toolkit"), "90")
    assert f"-DCUDA_cublas_LIBRARY={wheel}/lib/libcublas.so.13" in flags
    assert f"-DCUDA_cublasLt_LIBRARY={wheel}/lib/libcublasLt.so.13" in flags
    assert f"-DCMAKE_CUDA_FLAGS=-I{wheel}/include" in flags
    (tmp_path / "toolkit/lib64").mkdir()
    (tmp_path / "toolkit/lib64/libcublas.so").write_bytes(b"")  # the toolkit's own wins
    assert not any(
        f.startswith("-DCUDA_cublas") for f in build.cuda_flags(tmp_path / "toolkit/bin/nvcc", "90")
    )
