"""Where the test data that lives beside the repository is (this module holds no tests).

The trained fixture and the real router traces are not part of the repository; they sit in `shared/`
next to it (`<repo>/../shared/fixtures`, `<repo>/../shared/traces`). `MOESTREAM_SHARED` points
somewhere else (a worktree or a clone elsewhere), and `MOESTREAM_FIXTURES` / `MOESTREAM_TRACES` name
either folder directly. Tests that need them skip, saying where they looked and how to point them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MOESTREAM_SHARED") or REPO.parent / "shared")
FIXTURES = Path(os.environ.get("MOESTREAM_FIXTURES") or SHARED / "fixtures")
TRACES = Path(os.environ.get("MOESTREAM_TRACES") or SHARED / "traces")

FIXTURE = FIXTURES / "stdlib-moe-8x64"  # the trained Qwen3-MoE (learned routing), see its README
MIXTRAL = TRACES / "mixtral-8x7b-humaneval-routing.jsonl"
QWEN = sorted(TRACES.glob("qwen1.5-moe-a2.7b-gsm8k-layer*.jsonl"))
MIXTRAL_EXPERT = 3 * 4096 * 14336 * 2  # bf16 gate+up+down
QWEN_EXPERT = 3 * 2048 * 1408 * 2

needs_traces = pytest.mark.skipif(
    not MIXTRAL.exists() or len(QWEN) != 5,
    reason=f"real traces not found in {TRACES} (they live beside the repository; set MOESTREAM_SHARED "
    "or MOESTREAM_TRACES to the folder that holds them)",
)
needs_fixture = pytest.mark.skipif(
    not (FIXTURE / "config.json").exists(),
    reason=f"the trained fixture is not in {FIXTURES} (it lives beside the repository; set MOESTREAM_SHARED "
    "or MOESTREAM_FIXTURES to the folder that holds stdlib-moe-8x64)",
)
