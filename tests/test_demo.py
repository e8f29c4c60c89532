"""`moestream demo` on a small synthetic checkpoint: it says the weights are random and what is shown, and
prints the streamed and the resident run side by side (speed, bytes read, hit rate), with equal tokens."""

from __future__ import annotations

import re

from moestream.cli import main
from moestream.synth import synthesize


def test_demo_explains_and_compares_streamed_with_resident(tmp_path, capsys):
    path = synthesize(
        tmp_path / "demo", arch="qwen3_moe", layers=2, experts=16, top_k=2, hidden=64, moe_intermediate=64
    )
    assert main(["demo", "--dir", str(path), "--cache", "192KiB", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "RANDOM weights, so the text is noise by design" in out
    share = re.search(r"a cache that holds (\d+)% of them", out)
    assert share and 0 < int(share.group(1)) < 100
    rows = {
        m.group(1): m.groups()[1:]
        for m in re.finditer(
            r"^(streamed|resident) +(.+?) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)%$", out, re.M
        )
    }
    assert set(rows) == {"streamed", "resident"}
    assert (
        float(rows["streamed"][3]) > 0 and float(rows["resident"][3]) == 0.0
    )  # MiB read: warmed resident reads none
    assert float(rows["resident"][4]) == 100.0 and float(rows["streamed"][4]) < 100.0
    assert all(float(rows[r][1]) > 0 for r in rows)  # decode tok/s of both
    assert "tokens: identical (8 generated)" in out
