"""A trace whose writer is killed stays readable up to its last flushed batch, or fails saying where it was
cut."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moestream.trace import TraceError, TraceHeader, TraceWriter, partial_path, read_trace

CHILD = """
import sys
from moestream.trace import TraceHeader, TraceWriter
w = TraceWriter(sys.argv[1], TraceHeader("k", 1, 8, 2), flush_rows=100)
i = 0
while True:
    w.append("r", i, "decode", 0, [i % 8, (i + 1) % 8], [0.5, 0.5])
    i += 1
    if i % 100 == 0:
        print(i, flush=True)  # after the batch went out (append flushes at 100 buffered rows)
"""


def test_sigkilled_writer_leaves_its_flushed_rows(tmp_path: Path) -> None:
    path = tmp_path / "killed.parquet"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        for line in child.stdout:
            if int(line) >= 500:
                break
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert not path.exists() and partial_path(path).exists()
    t = read_trace(path)  # the missing Parquet file is read from its writer's stream
    assert len(t) >= 500 and len(t) % 100 == 0
    assert t.token.tolist() == list(range(len(t)))  # the rows, in order, with nothing invented
    assert t.experts[:, 0].tolist() == (np.arange(len(t)) % 8).tolist()
    # killed between two batches ("did not close") or inside one ("cut inside a batch"): where the kill
    # lands is the scheduler's, so either note is right (the rows are the flushed batches' either way)
    assert any("did not close" in note or "cut inside a batch" in note for note in t.notes), t.notes


def _stream_with_batches(tmp_path: Path, batches: int, rows: int = 10) -> tuple[bytes, list[int]]:
    """Bytes of a writer's stream after `batches` flushes, and the file size after the schema and each
    batch."""
    writer = TraceWriter(tmp_path / "w.parquet", TraceHeader("k", 1, 8, 2), flush_rows=rows)
    ends = [partial_path(writer.path).stat().st_size]
    for i in range(batches * rows):
        writer.append("r", i, "decode", 0, [i % 8, (i + 3) % 8], [0.7, 0.3])
        if (i + 1) % rows == 0:
            ends.append(partial_path(writer.path).stat().st_size)
    data = partial_path(writer.path).read_bytes()
    writer.close()
    return data, ends


def test_every_cut_inside_the_last_batch_yields_exactly_the_complete_batches(tmp_path: Path) -> None:
    data, ends = _stream_with_batches(tmp_path, 3)
    target = tmp_path / "cut.parquet"
    cuts = [*range(ends[2] + 1, ends[3], 7), *range(ends[3] - 9, ends[3])]  # every 7th byte, and the tail
    for cut in cuts:
        partial_path(target).write_bytes(data[:cut])
        t = read_trace(target)
        assert t.token.tolist() == list(range(20)), cut
        assert any(f"cut inside a batch at byte {cut}" in note for note in t.notes)


def test_cut_between_batches_reads_all_of_them(tmp_path: Path) -> None:
    data, ends = _stream_with_batches(tmp_path, 3)
    partial_path(tmp_path / "c.parquet").write_bytes(data[: ends[2]])
    t = read_trace(tmp_path / "c.parquet")
    assert len(t) == 20 and any("did not close" in note for note in t.notes)


def test_stream_without_batches_or_schema_is_an_error(tmp_path: Path) -> None:
    data, ends = _stream_with_batches(tmp_path, 1)
    partial_path(tmp_path / "a.parquet").write_bytes(data[: ends[0]])
    with pytest.raises(TraceError, match="no complete batch"):
        read_trace(tmp_path / "a.parquet")
    partial_path(tmp_path / "b.parquet").write_bytes(data[: ends[0] // 2])
    with pytest.raises(TraceError, match=r"(cut before its schema|no complete batch)"):
        read_trace(tmp_path / "b.parquet")


def test_truncated_parquet_says_so(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    with TraceWriter(path, TraceHeader("k", 1, 8, 2)) as w:
        for i in range(50):
            w.append("r", i, "decode", 0, [1, 2], [0.5, 0.5])
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(TraceError, match="not a complete Parquet file") as info:
        read_trace(path)
    assert str(path) in str(info.value)


def test_exception_inside_with_block_still_finishes_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    with pytest.raises(RuntimeError), TraceWriter(path, TraceHeader("k", 1, 8, 2), flush_rows=1000) as w:
        w.append("r", 0, "decode", 0, [1, 2], [0.5, 0.5])
        raise RuntimeError("model crashed")
    assert len(read_trace(path)) == 1 and not partial_path(path).exists()
