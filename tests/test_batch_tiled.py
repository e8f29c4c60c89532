"""Eight sequences in one decode step over K-quant experts: ggml's tiled kernel (issue 33, item 3).

ggml's CPU backend computes a K-quant matrix (Q2_K-Q6_K, IQ types) over 8 or more rows of one node with
its tiled kernel (`ggml-cpu/tiled`), and over fewer with vec_dot, row by row. A decode step of 8 or
more sequences (`--parallel 8`) where 8 rows share an expert (or a trunk matrix) therefore rounds that
product otherwise than each sequence's step alone: the products agree to about 5e-7 of their magnitude
(benchmarks/repack_invariance.py), the logits to about 1e-3 (a product's rounding moves the next q8_K
quantization by a step), not bit for bit. `GGML_CPU_TILED_MM=0` in the environment (read once
a process, by ggml) turns the tiled kernel off: every row then takes vec_dot and each sequence gets its
logits alone, bit for bit (at the cost of prefill: about half the rate on 2 cores, BENCHMARKS.md).

Oracle: the same runner with each sequence alone (tests/test_batch_runner.py's). Each setting runs in a
process of its own (ggml reads the variable once). The model: a tiny qwen3_moe whose experts are Q4_K,
every expert routed by every token (top-k = experts), so that an 8-row step gives each expert 8 rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from tiny_gguf import perturb_vectors, write_gguf
from tiny_models import write_tiny

PROMPTS = [[5, 17, 33], [250, 3, 12, 80], [9, 150], [64, 7, 1], [2, 3, 4, 5], [99], [41, 7, 8], [11, 12]]
STEPS = 4

SCRIPT = """
import json, sys, torch, moestream
path, prompts, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
with moestream.load(path, cache="256MiB", trunk="ggml", threads=2, parallel=len(prompts)) as engine:
    runner = engine.runner
    alone = []
    for p in prompts:
        logits, kv = runner(p, None)
        seen = []
        for _ in range(steps):
            seen.append(logits)
            logits, kv = runner([int(logits.argmax())], kv)
        alone.append(torch.stack(seen))
    seqs = runner.seqs[: len(prompts)]
    logits = []
    for kv, p in zip(seqs, prompts):
        kv.tokens = 0
        logits.append(runner(p, kv)[0])
    together = [[] for _ in prompts]
    for _ in range(steps):
        rows = []
        for i, row in enumerate(logits):
            together[i].append(row)
            rows.append((seqs[i], int(alone[i][len(together[i]) - 1].argmax())))  # alone's tokens
        logits = runner.decode(rows)
    got = [torch.stack(t) for t in together]
    print(json.dumps({
        "equal": [torch.equal(g, a) for g, a in zip(got, alone)],
        "rel": max(((g - a).abs().max() / a.abs().max()).item() for g, a in zip(got, alone)),
    }))
"""


@pytest.fixture(scope="module")
def q4k(tmp_path_factory):
    """A tiny qwen3_moe GGUF: Q4_K experts (256-wide rows), the trunk Q8_0, 4 experts all routed."""
    root = tmp_path_factory.mktemp("tiled")
    hf = write_tiny(
        "qwen3_moe",
        root / "hf",
        experts=4,
        top_k=4,
        hidden_size=256,
        moe_intermediate_size=256,
        num_hidden_layers=2,
    )
    perturb_vectors(hf)
    return write_gguf(hf, root / "model.gguf", ftype=Q.Q8_0, expert_type=lambda layer, kind: Q.Q4_K)


def _run(path: Path, tiled: str) -> dict:
    env = {**os.environ, "GGML_CPU_TILED_MM": tiled}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), json.dumps(PROMPTS), str(STEPS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_eight_rows_of_one_k_quant_expert_round_otherwise_unless_the_tiled_kernel_is_off(q4k):
    off = _run(q4k, "0")
    assert all(off["equal"]), off  # vec_dot for every row: each sequence's logits alone, bit for bit
    on = _run(q4k, "1")
    # the tiled kernel took the 8-row products (else this test checks no switch) ...
    assert not all(on["equal"]), on
    # ... within the stated tolerance: a product's rounding (~5e-7) can move the next node's q8_K
    # quantization of a value by a step (1/127 of its block's largest), so logits move by up to about
    # 1e-3 of their largest here (1.3e-3 seen); the same tokens are fed to both, so no near tie is followed
    assert on["rel"] < 1e-2, on
