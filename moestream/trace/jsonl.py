"""moestream's own JSONL trace format: a header line, then one JSON object per row.

    {"type": "header", "format": "moestream-trace", "version": 1, "model_id": ..., "n_layers": ..., ...}
    {"request": "r0", "token": 5, "phase": "decode", "layer": 3, "step": 2, "experts": [4, 1],
     "weights": [0.7, 0.3], "pred_experts": [...], "pred_scores": [...]}      (pred_* only when recorded)

It carries exactly what the Parquet file carries, for people who want to read a trace with `jq`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from moestream.trace.atomic import atomic_output
from moestream.trace.errors import TraceError
from moestream.trace.schema import FORMAT_NAME, PHASES, PREDICTION_COLUMNS, TraceHeader
from moestream.trace.table import Trace, trace_from_pylists

_REQUIRED = ("request", "token", "phase", "layer", "step", "experts", "weights")


def write_jsonl(trace: Trace, path: str | Path) -> None:
    """Write `trace` as moestream JSONL (header line first)."""
    # a reader never sees half an export under the final name, and a failed one leaves nothing behind
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as out:
        out.write(json.dumps({"type": "header", **trace.header.to_dict()}) + "\n")
        for row in _rows(trace):
            out.write(json.dumps(row, separators=(",", ":")) + "\n")


def _rows(trace: Trace) -> Iterator[dict[str, Any]]:
    experts, weights = trace.experts.tolist(), trace.weights.tolist()
    optional = {name: getattr(trace, name) for name in PREDICTION_COLUMNS if getattr(trace, name) is not None}
    for i in range(len(trace)):
        row: dict[str, Any] = {
            "request": trace.request_names[trace.request[i]],
            "token": int(trace.token[i]),
            "phase": PHASES[trace.phase[i]],
            "layer": int(trace.layer[i]),
            "step": int(trace.step[i]),
            "experts": experts[i],
            "weights": weights[i],
        }
        for name, values in optional.items():
            kept = [v for v in values[i].tolist() if not (isinstance(v, float) and math.isnan(v)) and v != -1]
            if kept:
                row[name] = kept
        yield row


def read_jsonl(path: Path, handle: TextIO) -> Trace:
    """Read moestream JSONL from an open text handle (the caller detected the format from line 1)."""
    lines = iter(enumerate(handle, start=1))
    _, first = next(lines)
    meta = json.loads(first)
    if meta.get("format") != FORMAT_NAME:
        raise TraceError(f"{path} line 1 is not a moestream trace header")
    try:
        header = TraceHeader.from_dict(meta)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{path} has a bad trace header: {exc}") from None
    columns: dict[str, list[Any]] = {name: [] for name in (*_REQUIRED, *PREDICTION_COLUMNS)}
    for number, line in lines:
        if not line.strip():
            continue
        row = parse_line(path, number, line)
        try:
            for name in _REQUIRED:
                columns[name].append(row[name])
        except KeyError as exc:
            raise TraceError(f"{path} line {number} lacks the field {exc.args[0]!r}") from None
        for name in PREDICTION_COLUMNS:
            columns[name].append(row.get(name))
    try:
        return trace_from_pylists(header, columns)
    except (ValueError, TypeError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise TraceError(f"{path} holds rows that do not fit the trace schema: {exc}") from None


def parse_line(path: Path, number: int, line: str) -> dict[str, Any]:
    """One JSONL line as a dict, or a TraceError naming the file and line (a cut last line, say)."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path} line {number} is not valid JSON ({exc.msg}); was the file cut?") from None
    if not isinstance(value, dict):
        raise TraceError(f"{path} line {number} is not a JSON object")
    return value
