"""moestream.kernels imports neither triton nor torch until a kernel is used, and says clearly when
triton is missing (runs with or without triton installed)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_loads_no_triton_and_no_torch():
    done = _run(
        "import sys\n"
        "import moestream.kernels as k\n"
        "assert k.choose('Q4_K', 1) in ('direct', 'dequant')\n"
        "print(sorted(m for m in ('triton', 'torch') if m in sys.modules))\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_missing_triton_is_one_clear_error():
    done = _run(
        "import sys\n"
        "sys.modules['triton'] = None  # as if not installed\n"
        "import moestream.kernels as k\n"
        "try:\n"
        "    k.matmul\n"
        "except k.KernelsUnavailableError as e:\n"
        "    print(e)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "need Triton" in done.stdout and "pip install triton" in done.stdout


@pytest.mark.parametrize("m", [1, 63, 64, 1 << 20])
def test_choose_reads_the_table(m):
    from moestream.kernels.choice import DEQUANT_FROM, NEVER, choose

    for name, start in DEQUANT_FROM.items():
        assert choose(name, m) == ("dequant" if m >= start else "direct"), (name, m)
    assert choose("Q4_K", 1 << 20) == "direct" and DEQUANT_FROM["Q4_K"] == NEVER  # measured: never dequant
    assert choose("Q5_0", 64) == "dequant" and choose("Q5_0", 63) == "direct"
    assert choose("NOT_A_TYPE", 1) == "dequant"  # never measured: the dequantize route
