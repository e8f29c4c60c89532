"""`read_trace(path)`: any supported trace file into a `Trace`, the format told apart by its content.

Formats: moestream Parquet (a closed writer), moestream Arrow stream (`PATH.partial`, a writer that did
not close), moestream JSONL, speculative-moe JSONL and vLLM-MoE-Logger JSONL (see `importers`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from moestream.trace.errors import TraceError
from moestream.trace.importers import import_speculative_moe, import_vllm_logger
from moestream.trace.jsonl import parse_line, read_jsonl
from moestream.trace.schema import FORMAT_NAME, TraceHeader, header_from_schema
from moestream.trace.table import Trace
from moestream.trace.writer import partial_path

PARQUET, STREAM, JSONL = "moestream parquet", "moestream arrow stream", "moestream jsonl"
MIXTRAL, VLLM = "speculative-moe jsonl", "vllm-logger jsonl"
_STREAM_MAGIC = b"\xff\xff\xff\xff"  # IPC continuation marker that opens every stream message
_STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def detect_format(path: Path) -> str:
    """Which format `path` holds, judged from its first bytes or its first JSON line."""
    if path.is_dir():
        raise TraceError(f"{path} is a directory, not a trace file")
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
            if magic == b"PAR1":
                return PARQUET
            if magic == _STREAM_MAGIC:
                return STREAM
            handle.seek(0)
            first = next((line for line in handle if line.strip()), b"")
    except OSError as exc:
        raise TraceError(f"cannot read the trace file {path}: {exc.strerror}") from None
    if not first:
        raise TraceError(f"{path} is empty")
    try:
        row = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise TraceError(f"{path} is neither Parquet, an Arrow stream nor JSONL") from None
    if not isinstance(row, dict):
        raise TraceError(f"{path} starts with JSON that is not an object")
    if row.get("format") == FORMAT_NAME:
        return JSONL
    if row.get("type") == "meta" or "topk_ids" in row:
        return VLLM
    if {"layer", "token_pos", "experts"} <= row.keys():
        return MIXTRAL
    raise TraceError(f"cannot tell the trace format of {path}: its first line has keys {sorted(row)[:8]}")


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read one trace file. A missing `PATH` whose writer was killed is read from `PATH.partial`.

    Raises:
        TraceError: missing file, unknown format, truncated or malformed content (the message names it).
    """
    path = Path(path)
    if not path.exists():
        if partial_path(path).exists():
            return _read_stream(partial_path(path))
        raise TraceError(f"trace file {path} does not exist")
    if path.is_dir():
        raise TraceError(f"{path} is a directory, not a trace file")
    fmt = detect_format(path)
    if fmt == PARQUET:
        return _read_parquet(path)
    if fmt == STREAM:
        return _read_stream(path)
    if fmt == JSONL:
        with open(path, encoding="utf-8") as handle:
            return read_jsonl(path, handle)
    return load_traces([path])


def load_traces(paths: Sequence[str | os.PathLike[str]]) -> Trace:
    """One trace from one file, or from several vLLM-MoE-Logger files (one layer each) of one workload."""
    paths = [Path(p) for p in paths]
    if len(paths) == 1 and detect_format_or_missing(paths[0]) not in (MIXTRAL, VLLM):
        return read_trace(paths[0])
    if len(paths) == 1 and detect_format(paths[0]) == MIXTRAL:
        try:
            return import_speculative_moe(paths[0], _records(paths[0]))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise TraceError(
                f"{paths[0]} does not look like a speculative-moe routing file ({exc!r})"
            ) from None
    logs = []
    for path in paths:
        fmt = detect_format_or_missing(path)
        if fmt != VLLM:
            raise TraceError(
                f"{path} is a {fmt} file; only vLLM-MoE-Logger files (one layer each) can be merged"
            )
        records = _records(path)
        meta = records[0] if records and records[0].get("type") == "meta" else {}
        logs.append((path, meta, [r for r in records if r.get("type", "route") == "route"]))
    try:
        return import_vllm_logger(logs)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise TraceError(f"{paths[0]} does not look like a vLLM-MoE-Logger file ({exc!r})") from None


def detect_format_or_missing(path: Path) -> str:
    """`detect_format`, with a clear error for a missing file (a killed writer's stream counts as present)."""
    if not path.exists():
        if partial_path(path).exists():
            return STREAM
        raise TraceError(f"trace file {path} does not exist")
    return detect_format(path)


def _records(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        return [parse_line(path, n, line) for n, line in enumerate(handle, start=1) if line.strip()]


def _read_parquet(path: Path) -> Trace:
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise TraceError(
            f"{path} is not a complete Parquet file ({exc}); a writer killed before closing "
            f"leaves its rows in {partial_path(path).name} instead"
        ) from None
    header = header_from_schema(table.schema)
    if header is None:
        raise TraceError(f"{path} is a Parquet file without a moestream trace header")
    return _from_table(path, table, header, [])


def _read_stream(path: Path) -> Trace:
    """Every complete batch of a writer's Arrow stream; says whether and where the stream was cut."""
    size = path.stat().st_size
    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except (pa.ArrowInvalid, OSError):
            raise TraceError(
                f"{path} was cut before its schema was complete ({size} bytes): it holds no rows"
            ) from None
        header = header_from_schema(reader.schema)
        if header is None:
            raise TraceError(f"{path} is an Arrow stream without a moestream trace header")
        batches, good_end, torn = [], source.tell(), False
        while True:
            try:
                batches.append(reader.read_next_batch())
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError):
                torn = True  # a batch whose bytes end early: the writer died while writing it
                break
            good_end = source.tell()
        with open(path, "rb") as handle:
            handle.seek(max(0, size - len(_STREAM_END)))
            finished = handle.read() == _STREAM_END
    rows = sum(b.num_rows for b in batches)
    if not rows:  # the writer's opening batch is empty: it only carries the schema
        raise TraceError(
            f"{path} holds no complete batch of rows (the writer stopped before its first flush"
            + (f"; cut at byte {size})" if torn else ")")
        )
    notes = []
    if torn:
        notes.append(
            f"{path.name} was cut inside a batch at byte {size}; read the {rows} rows of the "
            f"{len(batches)} complete batches before byte {good_end}, the torn batch is ignored"
        )
    elif not finished:
        notes.append(
            f"{path.name} is the stream of a writer that did not close (killed?); read the {rows} "
            f"rows of its {len(batches)} flushed batches, rows appended after the last flush are lost"
        )
    return _from_table(path, pa.Table.from_batches(batches, schema=reader.schema), header, notes)


def _from_table(path: Path, table: pa.Table, header: TraceHeader, notes: list[str]) -> Trace:
    try:
        return Trace.from_table(table, header, notes)
    except (KeyError, ValueError) as exc:  # a missing column, a ragged experts column, a bad phase
        raise TraceError(f"{path} does not hold valid trace rows: {exc}") from None
