"""`TraceWriter`: append router-trace rows while a model runs, survive being killed, end as one Parquet file.

Durability: a Parquet file is only readable once its footer is written at close, so a writer killed
mid-run would leave nothing usable. Rows therefore go first to `PATH.partial`, an Arrow IPC *stream*
(schema message, then one self-contained, length-prefixed record batch per flush). Each flush hands the
whole batch to the kernel, so a SIGKILL loses at most the rows appended since the last flush; a batch
torn by the kill is detected by its length prefix when read (`read_trace` says where the file was cut).
`close()` converts the stream to `PATH` (Parquet, written to a temporary name, then renamed) and
deletes the stream, so a reader sees either the finished Parquet file or the partial stream, never a
half-written Parquet file.

Failures: the path is checked when the writer is made (a missing directory fails before any row). A
write that fails later (a full disk) raises `TraceError` once, saying which rows are kept where; after
that the writer takes no more rows, and `close()` leaves the stream, readable up to its last complete
batch, instead of a Parquet file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from moestream.trace.atomic import atomic_output, check_output_path, describe
from moestream.trace.errors import TraceError
from moestream.trace.schema import PHASES, PREDICTION_COLUMNS, TraceHeader, arrow_schema

PARTIAL_SUFFIX = ".partial"
_COLUMNS = ("request", "token", "phase", "layer", "step", "experts", "weights", *PREDICTION_COLUMNS)


def partial_path(path: str | os.PathLike[str]) -> Path:
    """Where a writer streams the rows of `path` until it is closed."""
    path = Path(path)
    return path.with_name(path.name + PARTIAL_SUFFIX)


class TraceWriter:
    """Appends rows in batches to `PATH.partial`; `close()` (or leaving the `with` block) writes `PATH`.

    One row per (request, token, phase, layer). Rows with equal `step` and `layer` are one forward pass
    (the replay accesses their distinct experts once); when `step` is not given, a new step starts
    whenever the request or phase changes, and in decode whenever the token changes, which is right for
    one sequence at a time (pass `step` explicitly for batched forwards or chunked prefill).

    Args:
        path: final Parquet file.
        header: model description stored with the rows.
        flush_rows: rows buffered in memory before a batch is written (what a crash can lose).
        fsync: also fsync after every batch (survives power loss, not only a killed process).
    """

    def __init__(
        self, path: str | os.PathLike[str], header: TraceHeader, flush_rows: int = 4096, fsync: bool = False
    ) -> None:
        if flush_rows < 1:
            raise ValueError(f"flush_rows must be >= 1, got {flush_rows}")
        self.path = Path(path)
        self.partial = partial_path(self.path)
        # a copy, so the caller's header is not changed; the file name is the default source
        self.header = dataclasses.replace(header, source=header.source or self.path.name)
        self.flush_rows = flush_rows
        self.fsync = fsync
        self.rows_written = 0
        self._schema = arrow_schema(self.header)
        # whole rows, each added by one list.append: a KeyboardInterrupt between two bytecodes can
        # never leave one column a row longer than another (it did with a list per column)
        self._rows: list[tuple[Any, ...]] = []
        self._step = -1
        self._step_key: tuple[Any, ...] | None = None
        self.failure: TraceError | None = None  # set by the first write that failed
        check_output_path(self.path)
        try:
            self._file = open(self.partial, "wb")
        except OSError as exc:
            raise TraceError(f"cannot write the trace {self.partial}: {describe(exc)}") from None
        try:
            self._stream = pa.ipc.new_stream(self._file, self._schema)
            # pyarrow writes the schema lazily; an empty batch forces it out now, so a writer killed before
            # its first flush leaves a file that says "a trace with no rows yet" rather than an empty file
            self._stream.write_batch(pa.RecordBatch.from_pylist([], schema=self._schema))
            self._file.flush()
        except OSError as exc:
            with contextlib.suppress(OSError):
                self._file.close()
            self.partial.unlink(missing_ok=True)
            raise TraceError(f"cannot write the trace {self.partial}: {describe(exc)}") from None
        self._closed = False

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.close()  # the rows appended before an exception are still valid
        except TraceError:
            if exc is None:
                raise  # else the exception in flight says more; the stream keeps what was written

    def append(
        self,
        request: str,
        token: int,
        phase: str,
        layer: int,
        experts: Sequence[int],
        weights: Sequence[float],
        step: int | None = None,
        pred_experts: Sequence[int] | None = None,
        pred_scores: Sequence[float] | None = None,
        pred2_experts: Sequence[int] | None = None,
        pred2_scores: Sequence[float] | None = None,
    ) -> None:
        """Add one (request, token, phase, layer) row.

        Args:
            experts: the routed experts in router order (top_k ints); weights: their routing weights.
            step: forward pass number (see the class docstring); derived when None.
            pred_experts / pred_scores: the top-2k experts (best first) and scores of layer+1's router
                applied to this layer's router input; pred2_*: the same for layer+2. None when not recorded.
        """
        if self.failure is not None:
            raise self.failure
        if self._closed:
            raise ValueError(f"trace writer for {self.path} is closed")
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        if len(experts) != self.header.top_k or len(weights) != len(experts):
            raise ValueError(
                f"a row needs top_k={self.header.top_k} experts and as many weights, "
                f"got {len(experts)} and {len(weights)}"
            )
        if step is None:
            step = self._derive_step(request, phase, token)
        values = (
            str(request),
            int(token),
            phase,
            int(layer),
            int(step),
            [int(e) for e in experts],
            [float(w) for w in weights],
            _ints(pred_experts),
            _floats(pred_scores),
            _ints(pred2_experts),
            _floats(pred2_scores),
        )
        self._rows.append(values)
        if len(self._rows) >= self.flush_rows:
            self.flush()

    def append_forward(
        self,
        request: str,
        tokens: Sequence[int],
        phase: str,
        layer: int,
        experts: Sequence[Sequence[int]],
        weights: Sequence[Sequence[float]],
        step: int | None = None,
        pred_experts: Sequence[Sequence[int]] | None = None,
        pred_scores: Sequence[Sequence[float]] | None = None,
        pred2_experts: Sequence[Sequence[int]] | None = None,
        pred2_scores: Sequence[Sequence[float]] | None = None,
    ) -> None:
        """Add the rows of one layer forward of one request: T tokens, experts/weights shaped [T, top_k],
        predictions [T, 2k] (numpy arrays work; pass `tensor.tolist()` for torch tensors)."""
        experts, weights = _rows(experts), _rows(weights)
        extra = [_rows(v) for v in (pred_experts, pred_scores, pred2_experts, pred2_scores)]
        for i, token in enumerate(tokens):
            self.append(
                request,
                int(token),
                phase,
                layer,
                experts[i],
                weights[i],
                step,
                *(None if column is None else column[i] for column in extra),
            )

    def flush(self) -> None:
        """Write the buffered rows as one record batch and hand it to the kernel."""
        rows, n = self._rows, len(self._rows)
        if n == 0 or self._closed or self.failure is not None:
            return
        columns = dict(zip(_COLUMNS, zip(*rows)))
        arrays = [pa.array(list(columns[f.name]), f.type) for f in self._schema]
        try:
            self._stream.write_batch(pa.RecordBatch.from_arrays(arrays, schema=self._schema))
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
        except OSError as exc:
            self.failure = TraceError(
                f"writing the trace {self.partial} failed ({describe(exc)}): recording stopped; the "
                f"{self.rows_written} rows written before are kept there (`moestream simulate` reads it), "
                f"the {n} rows of the failed batch and any later ones are lost"
            )
            raise self.failure from None
        finally:
            del rows[:n]
        self.rows_written += n

    def close(self) -> None:
        """Flush, then convert the stream to the final Parquet file and remove the stream."""
        if self._closed:
            return
        if self.failure is None:
            try:
                self.flush()
                self._stream.close()
                self._file.close()
            except TraceError:
                pass  # flush recorded it
            except OSError as exc:  # the end-of-stream marker did not fit: the batches before it are whole
                self.failure = TraceError(
                    f"finishing the trace {self.partial} failed ({describe(exc)}); its {self.rows_written} "
                    "rows are kept there (`moestream simulate` reads it)"
                )
        self._closed = True
        if self.failure is not None:
            with contextlib.suppress(OSError):
                self._file.close()  # a failed stream is left as it is: its complete batches stay readable
            raise self.failure
        try:
            stream_to_parquet(self.partial, self.path)
        except TraceError as exc:
            self.failure = TraceError(
                f"{exc}; its {self.rows_written} rows are kept in {self.partial} "
                "(`moestream simulate` and `moestream trace-convert` read it)"
            )
            raise self.failure from None
        self.partial.unlink()

    def _derive_step(self, request: str, phase: str, token: int) -> int:
        key = (request, phase, token if phase == "decode" else None)
        if key != self._step_key:
            self._step_key = key
            self._step += 1
        return self._step


def stream_to_parquet(stream_path: Path, path: Path) -> None:
    """Copy an Arrow IPC stream of trace batches into a Parquet file (atomically, via a temporary name).

    Raises:
        TraceError: writing failed; no temporary file is left behind.
    """
    with atomic_output(path) as tmp, pa.OSFile(str(stream_path), "rb") as source:
        reader = pa.ipc.open_stream(source)
        with pq.ParquetWriter(str(tmp), reader.schema, compression="zstd") as out:
            for batch in reader:
                out.write_batch(batch)


def _ints(values: Sequence[int] | None) -> list[int] | None:
    return None if values is None else [int(v) for v in values]


def _floats(values: Sequence[float] | None) -> list[float] | None:
    return None if values is None else [float(v) for v in values]


def _rows(values: Any) -> list[list[Any]] | None:
    if values is None:
        return None
    return values.tolist() if hasattr(values, "tolist") else [list(v) for v in values]
