"""Loading ggml: which library, refusals (CPU, layout, types, alignment), and the other build's run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream import ggml
from moestream.ggml import lib as ggml_lib
from moestream.ggml.host import native_dir

REQUIRED = [
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
    "MXFP4",
]
HERE = Path(__file__).parent


def test_type_table_covers_the_cpu_types_with_gguf_block_sizes():
    table = ggml.type_table()
    assert set(REQUIRED) <= set(table)
    for name, t in table.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name]] == (t.block, t.block_bytes)
        assert t.id == GGMLQuantizationType[name].value
    # the kernel tests cover every multipliable type gguf can dequantize
    from test_ggml_kernels import TYPES

    assert set(table) - set(TYPES) <= {"Q1_0"}
    q4k = ggml.ggml_type("q4_k")
    assert (q4k.block, q4k.block_bytes, q4k.vec_dot_type) == (256, 144, "Q8_K")
    assert ggml.row_bytes("Q6_K", 2048) == 8 * 210
    assert ggml.row_bytes(GGMLQuantizationType.MXFP4, 2880) == 90 * 17
    assert ggml.ggml_type(8).name == "Q8_0" and q4k.nbytes(768, 2048) == 884_736


@pytest.mark.parametrize("t", ["Q8_K", "Q8_1", "I32", "F64", GGMLQuantizationType.I8])
def test_types_ggml_cannot_multiply_are_refused_by_name(t):
    with pytest.raises(ggml.UnsupportedTypeError, match="cannot multiply"):
        ggml.ggml_type(t)


def test_unknown_types_and_partial_blocks_are_refused():
    with pytest.raises(ggml.UnsupportedTypeError, match="not a GGML tensor type"):
        ggml.ggml_type("Q9_9")
    with pytest.raises(ggml.UnsupportedTypeError, match="not a GGML tensor type"):
        ggml.ggml_type(4)  # Q4_2, removed from ggml
    with pytest.raises(ValueError, match="multiple"):
        ggml.row_bytes("Q4_K", 2880)  # gpt-oss's K, why llama.cpp falls back to Q5_0 there
    with pytest.raises(ValueError, match="multiple"):
        ggml.linear(torch.zeros(1, 2880), torch.zeros(10**6, dtype=torch.uint8), "Q4_K", 4)


def test_describe_names_version_kind_and_isa():
    lib = ggml.library()
    assert ggml.describe().startswith(f"ggml {lib.version} {lib.kind} (")
    assert lib.kind in ("prebuilt", "native", "custom")
    if lib.kind == "prebuilt" and os.uname().machine == "x86_64":
        assert "AVX2" in lib.isa and "AVX512" not in lib.isa


def test_unaligned_or_short_weights_and_bad_activations_are_refused():
    data = ggml.quantize(torch.randn(32, 256), "Q4_0")
    buf = torch.zeros(data.numel() + 64, dtype=torch.uint8)
    x = torch.randn(2, 256)
    for off in (1, 2, 16):
        with pytest.raises(ValueError, match="32-byte aligned"):
            ggml.linear(x, buf[off : off + data.numel()], "Q4_0", 32)
        with pytest.raises(ValueError, match="32-byte aligned"):
            ggml.linear(x, buf.data_ptr() + off, "Q4_0", 32)
    buf[32 : 32 + data.numel()] = data  # an aligned address inside a larger buffer works
    assert torch.equal(ggml.linear(x, buf.data_ptr() + 32, "Q4_0", 32), ggml.linear(x, data, "Q4_0", 32))
    with pytest.raises(ValueError, match="needs"):
        ggml.linear(x, data[:-1], "Q4_0", 32)
    with pytest.raises(ValueError, match="float32"):
        ggml.linear(x.bfloat16(), data, "Q4_0", 32)
    with pytest.raises(ValueError, match="needs"):  # K comes from x: a wider x needs a larger matrix
        ggml.linear(torch.randn(2, 512), data, "Q4_0", 32)
    assert ggml.linear(torch.zeros(0, 256), data, "Q4_0", 32).shape == (0, 32)  # an expert nobody picked
    with pytest.raises(ValueError, match="null address"):
        ggml.linear(x, 0, "Q4_0", 32)
    with pytest.raises(ValueError, match="out must be"):
        ggml.linear(x, data, "Q4_0", 32, out=torch.empty(2, 31))
    with pytest.raises(ValueError, match="importance matrix"):
        ggml.quantize(torch.randn(4, 256), "IQ2_XXS")


def test_prebuilt_library_is_refused_on_a_cpu_without_avx2():
    no_avx2 = {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "fma", "f16c", "bmi2"}
    with pytest.raises(ggml.GgmlUnavailableError, match=r"lacks AVX2.*run `make native`"):
        ggml_lib.check_cpu("prebuilt", "x86_64", no_avx2)
    ggml_lib.check_cpu("prebuilt", "x86_64", no_avx2 | {"avx2"})
    ggml_lib.check_cpu("prebuilt", "aarch64", {"fp", "asimd"})  # the aarch64 wheel is armv8.0
    with pytest.raises(ggml.GgmlUnavailableError, match=r"avx512f.*`make native` again"):
        ggml_lib.check_cpu(
            "native", "x86_64", no_avx2 | {"avx2"}, build_flags={"avx2", "avx512f", "hypervisor"}
        )


def test_refusal_happens_before_the_library_is_loaded(tmp_path):
    # A fresh interpreter on "a CPU without AVX2": load() must raise, and no libggml may be mapped.
    code = (
        "import moestream.ggml.lib as l\n"
        "l.cpu_flags = lambda: {'sse', 'sse2', 'avx'}\n"
        "try:\n    l.load()\nexcept l.GgmlUnavailableError as e:\n    print('refused:', e)\n"
        "print('mapped' if 'libggml' in open('/proc/self/maps').read() else 'not mapped')\n"
    )
    env = dict(os.environ, MOESTREAM_GGML_LIB="prebuilt")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if os.uname().machine != "x86_64":
        pytest.skip("the AVX2 refusal applies to the x86_64 wheel")
    assert out.returncode == 0, out.stderr
    assert "refused: this CPU lacks AVX2, FMA, F16C, BMI2, which the prebuilt" in out.stdout
    assert "make native" in out.stdout and out.stdout.strip().endswith("not mapped")


def test_a_library_of_another_struct_layout_is_refused():
    class FakeBase:  # a ggml whose tensor struct grew by 8 bytes
        def ggml_tensor_overhead(self):
            return 376

    with pytest.raises(ggml.GgmlUnavailableError, match=r"tensor struct is 344 bytes.*expects 336"):
        ggml_lib._check_layout(FakeBase())


def test_locate_follows_env_then_native_then_prebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESTREAM_HOME", str(tmp_path))
    monkeypatch.delenv("MOESTREAM_GGML_LIB", raising=False)
    folder, kind = ggml_lib.locate()
    assert kind == "prebuilt" and (folder / "libggml-cpu.so").exists()
    fake = tmp_path / "ggml-native"
    (fake / "lib").mkdir(parents=True)
    for name in ("libggml-base.so", "libggml-cpu.so"):
        (fake / "lib" / name).write_bytes(b"")
    (fake / "build.json").write_text(json.dumps({"cpu_flags": []}))
    assert ggml_lib.locate() == (fake / "lib", "native")
    monkeypatch.setenv("MOESTREAM_GGML_LIB", "prebuilt")
    assert ggml_lib.locate()[1] == "prebuilt"
    monkeypatch.setenv("MOESTREAM_GGML_LIB", str(fake))
    assert ggml_lib.locate() == (fake / "lib", "native")
    monkeypatch.setenv("MOESTREAM_GGML_LIB", str(tmp_path / "nowhere"))
    with pytest.raises(ggml.GgmlUnavailableError, match=r"holds no libggml-base.so"):
        ggml_lib.locate()


def test_the_other_build_passes_the_same_kernel_tests():
    """Runs the kernel tests against the build this process did not load (native <-> prebuilt)."""
    if not (native_dir() / "build.json").exists():
        pytest.skip(f"no native ggml build at {native_dir()} (run `make native`)")
    other = "prebuilt" if ggml.library().kind == "native" else str(native_dir())
    env = dict(os.environ, MOESTREAM_GGML_LIB=other)
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(HERE / "test_ggml_kernels.py"),
    ]
    out = subprocess.run(argv, cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout


def test_dequant_thresholds_cover_the_benchmarked_formats():
    from moestream.ggml.thresholds import NEVER

    assert ggml.dequant_threshold("Q4_K", "prebuilt", 2) == 32
    assert ggml.dequant_threshold("Q4_K", "native", 2) == NEVER  # VNNI + sgemm: ggml wins up to M=256
    assert ggml.dequant_threshold("Q6_K", "prebuilt", 8) == ggml.dequant_threshold("Q6_K", "prebuilt", 2)
    assert ggml.dequant_threshold("IQ2_XXS", "prebuilt", 1) == NEVER  # not measured: stay on ggml
    assert ggml.dequant_threshold("Q8_0", "custom", 1) == ggml.dequant_threshold("Q8_0", "prebuilt", 1)


def test_the_mode_line_names_the_cpu_features_a_build_leaves_unused():
    """Never a silent AVX2 fallback: a build without AVX512 on an AVX512 CPU says so, and what to run."""
    from moestream.ggml.lib import unused_isa

    flags = {"avx2", "avx512f", "avx512_vnni", "fma"}
    assert unused_isa(("AVX2",), flags) == ["AVX512", "AVX512_VNNI"]
    assert unused_isa(("AVX2", "AVX512", "AVX512_VNNI"), flags) == []
    assert unused_isa(("NEON",), {"asimd", "asimddp", "i8mm"}) == ["DOTPROD", "MATMUL_INT8"]
    from moestream.ggml.host import cpu_flags

    missing = unused_isa(ggml.library().isa, cpu_flags())
    assert (": make native" in ggml.describe()) == bool(missing)
