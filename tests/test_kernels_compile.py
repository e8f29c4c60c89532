"""Every GGUF kernel compiles to GPU machine code for an H200 (sm_90) and a Jetson Orin (sm_87), without
a GPU, ahead of time (tests/kernels_aot.py, in a process without TRITON_INTERPRET). The other CPU tests
run the same kernels in Triton's interpreter, which does not lower them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from moestream.kernels import TYPES

_SCRIPT = Path(__file__).with_name("kernels_aot.py")
_ORIN = ["Q4_K", "Q6_K", "MXFP4"]


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    """ "ARCH:NAME" -> "ok" or the compiler's error, from one subprocess."""
    groups = [f"90:{','.join(TYPES)}", f"87:{','.join(_ORIN)}"]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, str(_SCRIPT), *groups]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(TYPES))
def test_compiles_for_h200_sm90(compiled, name):
    assert compiled[f"90:{name}"] == "ok"


@pytest.mark.parametrize("name", _ORIN)
def test_compiles_for_jetson_orin_sm87(compiled, name):
    assert compiled[f"87:{name}"] == "ok"
