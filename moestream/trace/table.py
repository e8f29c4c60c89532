"""`Trace`: a whole router trace in memory, as numpy columns (the simulator's and the evaluator's input)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from moestream.trace.schema import PHASES, TraceHeader, arrow_schema


@dataclass
class Trace:
    """Router trace rows as columns; N rows, top_k = K, predictions of width M (padded with -1).

    Attributes:
        header: the model description.
        request: [N] int32 index into `request_names`.
        request_names: request ids in order of first appearance.
        token: [N] int64 token index within its request.
        phase: [N] int8, 0 = prefill, 1 = decode (`PHASES`).
        layer: [N] int32.
        step: [N] int64 forward pass number.
        experts: [N, K] int32 routed experts in router order.
        weights: [N, K] float32 routing weights.
        pred_experts / pred_scores: [N, M] stale-gate prediction for layer+1 (-1 / nan where absent), or None.
        pred2_experts / pred2_scores: [N, M2] the same for layer+2, or None.
        notes: what the reader or importer assumed, one sentence each (printed by the CLI).
        round: [N] int64, the engine round each row's forward ran in (`batch_steps`: a round's forwards
            run side by side, a layer at a time, where the engine streams experts), or None; a
            simulation's alone, not written to a file.
    """

    header: TraceHeader
    request: np.ndarray
    request_names: list[str]
    token: np.ndarray
    phase: np.ndarray
    layer: np.ndarray
    step: np.ndarray
    experts: np.ndarray
    weights: np.ndarray
    pred_experts: np.ndarray | None = None
    pred_scores: np.ndarray | None = None
    pred2_experts: np.ndarray | None = None
    pred2_scores: np.ndarray | None = None
    notes: list[str] = field(default_factory=list)
    round: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.layer.shape[0])

    @property
    def has_predictions(self) -> bool:
        """Whether any row carries a stale-gate prediction for the next layer."""
        return self.pred_experts is not None and bool((self.pred_experts >= 0).any())

    @property
    def all_notes(self) -> list[str]:
        """The header's notes (from an import) followed by the reader's."""
        return [*self.header.notes, *self.notes]

    @classmethod
    def from_table(cls, table: pa.Table, header: TraceHeader, notes: list[str] | None = None) -> Trace:
        """Columns of an Arrow table with the trace schema (missing prediction columns are fine)."""
        request = table.column("request").combine_chunks().dictionary_encode()
        phase_names = np.asarray(table.column("phase").to_numpy(zero_copy_only=False), dtype=object)
        bad = set(phase_names.tolist()) - set(PHASES)
        if bad:
            raise ValueError(f"unknown phase {sorted(bad)[0]!r} (expected prefill or decode)")
        optional = {}
        for name in ("pred_experts", "pred_scores", "pred2_experts", "pred2_scores"):
            if name in table.column_names and table.column(name).null_count < len(table):
                fill, dtype = (-1, np.int32) if name.endswith("experts") else (np.nan, np.float32)
                optional[name] = lists_to_2d(table.column(name).combine_chunks(), fill, dtype)
        return cls(
            header=header,
            request=request.indices.to_numpy(zero_copy_only=False).astype(np.int32),
            request_names=[str(x) for x in request.dictionary.to_pylist()],
            token=table.column("token").to_numpy().astype(np.int64),
            phase=(phase_names == "decode").astype(np.int8),
            layer=table.column("layer").to_numpy().astype(np.int32),
            step=table.column("step").to_numpy().astype(np.int64),
            experts=lists_to_2d(table.column("experts").combine_chunks(), -1, np.int32, uniform=True),
            weights=lists_to_2d(table.column("weights").combine_chunks(), np.nan, np.float32),
            notes=list(notes or []),
            **optional,
        )

    def to_table(self) -> pa.Table:
        """An Arrow table with the trace schema and the header in its metadata."""
        schema = arrow_schema(self.header)
        names = pa.array(self.request_names, pa.string())
        columns = {
            "request": pa.DictionaryArray.from_arrays(pa.array(self.request), names).cast(pa.string()),
            "token": pa.array(self.token, pa.int64()),
            "phase": pa.DictionaryArray.from_arrays(
                pa.array(self.phase.astype(np.int32)), pa.array(PHASES)
            ).cast(pa.string()),
            "layer": pa.array(self.layer, pa.int32()),
            "step": pa.array(self.step, pa.int64()),
            "experts": array_to_lists(self.experts, pa.int32()),
            "weights": array_to_lists(self.weights, pa.float32()),
        }
        for name, kind in (
            ("pred_experts", pa.int32()),
            ("pred_scores", pa.float32()),
            ("pred2_experts", pa.int32()),
            ("pred2_scores", pa.float32()),
        ):
            value = getattr(self, name)
            if value is None:
                columns[name] = pa.nulls(len(self), pa.list_(kind))
            else:
                valid = getattr(self, name.replace("scores", "experts")) >= 0
                columns[name] = array_to_lists(value, kind, valid)
        return pa.Table.from_pydict(columns, schema=schema)


def lists_to_2d(arr: pa.Array, fill: float, dtype: type, uniform: bool = False) -> np.ndarray:
    """A list<T> array as an [N, max length] numpy array, short or null rows padded with `fill`.

    Raises:
        ValueError: `uniform` is set and the rows differ in length (e.g. a ragged experts column).
    """
    offsets = arr.offsets.to_numpy().astype(np.int64)
    lengths = np.diff(offsets)
    if arr.null_count:
        lengths = np.where(arr.is_null().to_numpy(zero_copy_only=False), 0, lengths)
    width = int(lengths.max()) if len(lengths) else 0
    if uniform and len(lengths) and int(lengths.min()) != width:
        raise ValueError(f"rows hold between {int(lengths.min())} and {width} experts; every row needs top_k")
    flat = arr.flatten().to_numpy(zero_copy_only=False).astype(dtype)
    if len(lengths) and int(lengths.min()) == width:
        return flat.reshape(len(lengths), width)
    out = np.full((len(lengths), width), fill, dtype=dtype)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    out[rows, np.arange(len(flat)) - starts] = flat
    return out


def array_to_lists(values: np.ndarray, kind: pa.DataType, valid: np.ndarray | None = None) -> pa.Array:
    """Inverse of `lists_to_2d`: row i keeps the entries where `valid[i]` (all when None); empty -> null."""
    if valid is None:
        valid = np.ones(values.shape, dtype=bool)
    counts = valid.sum(axis=1)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    flat = pa.array(values[valid], kind)
    return pa.ListArray.from_arrays(pa.array(offsets), flat, mask=pa.array(counts == 0))


def trace_from_pylists(
    header: TraceHeader, columns: dict[str, list], notes: list[str] | None = None
) -> Trace:
    """A Trace from plain Python column lists (as importers collect them); absent prediction columns are
    null."""
    schema = arrow_schema(header)
    n = len(columns["layer"])
    data = {f.name: columns.get(f.name, [None] * n) for f in schema}
    return Trace.from_table(pa.Table.from_pydict(data, schema=schema), header, notes)
