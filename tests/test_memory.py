"""Resident memory after load: non-expert bytes + cache budget + 200 MiB at most, on >= 2 GiB of experts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moestream.units import MiB

PROBE = """
import json, sys
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
import torch, transformers, moestream.engine.engine, moestream.synth.routing
before = rss()
engine = moestream.load(sys.argv[1], cache=sys.argv[2])
after = rss()
out = engine.generate("Hello there", max_tokens=2, ignore_eos=True)
print(json.dumps({"before": before, "after": after, "expert_bytes": engine.emap.expert_bytes,
                  "locked": engine.cache.locked, "tokens": len(out.tokens)}))
"""


@pytest.mark.slow
def test_load_rss_stays_below_non_experts_plus_budget(tmp_path):
    from moestream.cli.info import describe
    from moestream.synth import synthesize

    path = synthesize(tmp_path / "big", preset="demo", layers=11, seed=3)
    info = describe(str(path))
    assert info["all_expert_bytes"] >= 2 << 30
    budget = 64 * MiB
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(path), str(budget)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = result["after"] - result["before"]
    limit = info["non_expert_bytes"] + budget + 200 * MiB
    assert growth < limit, f"RSS grew {growth / MiB:.0f} MiB during load, limit {limit / MiB:.0f} MiB"
    assert result["tokens"] == 2
