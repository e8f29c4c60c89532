"""What a router trace holds: a header describing the model, and one row per (request, token, phase, layer).

Row layout (the same columns in Parquet, in the Arrow stream a writer appends to, and in JSONL):

| column        | type          | meaning                                                                 |
|---------------|---------------|-------------------------------------------------------------------------|
| request       | string        | request id                                                              |
| token         | int64         | token index within the request (its position)                           |
| phase         | string        | "prefill" or "decode"                                                   |
| layer         | int32         | MoE layer index                                                         |
| step          | int64         | forward pass number; rows with equal (step, layer) ran as one forward   |
| experts       | list<int32>   | routed experts, in router order (top_k of them)                         |
| weights       | list<float32> | their routing weights, same order                                       |
| pred_experts  | list<int32>?  | stale-gate prediction: top-2k of layer+1's router on this layer's input |
| pred_scores   | list<float32>?| the router scores of those predicted experts                            |
| pred2_experts | list<int32>?  | the same for layer+2 (two layers ahead)                                 |
| pred2_scores  | list<float32>?|                                                                         |

The header lives in the Parquet/Arrow schema metadata under `HEADER_KEY`, and as the first JSONL line.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import pyarrow as pa

FORMAT_NAME = "moestream-trace"
FORMAT_VERSION = 1
HEADER_KEY = b"moestream.trace.header"
PHASES = ("prefill", "decode")  # phase codes 0 and 1 in memory
PREDICTION_COLUMNS = ("pred_experts", "pred_scores", "pred2_experts", "pred2_scores")


@dataclass
class TraceHeader:
    """The model a trace was recorded on, and what the replay needs to count bytes.

    Attributes:
        model_id: checkpoint name or path.
        n_layers: MoE layers of the model (a trace may hold fewer).
        n_experts: routed experts per layer.
        top_k: experts routed per token.
        dtype: dtype of the expert weights as stored ("bf16", "mxfp4", ...).
        expert_bytes: bytes read for one expert of each layer (gate+up+down), or None when unknown.
        slot_bytes: bytes one cache slot of each layer takes (alignment included), or None: the unit size.
        synthetic: recorded on a random-weight checkpoint (predictions there are unrealistically easy).
        token_order_known: consecutive token indices of a request are consecutive tokens of one
            sequence (False for imported batched logs whose rows cannot be tied to their request).
        source: where the rows came from (recorder, or the imported file and its format).
        notes: what an importer assumed, one sentence each.
    """

    model_id: str
    n_layers: int
    n_experts: int
    top_k: int
    dtype: str = "unknown"
    expert_bytes: list[int] | None = None
    slot_bytes: list[int] | None = None
    synthetic: bool = False
    token_order_known: bool = True
    source: str = ""
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_experts", "top_k"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"trace header: {name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.n_experts:
            raise ValueError(f"trace header: top_k {self.top_k} exceeds n_experts {self.n_experts}")
        for name in ("expert_bytes", "slot_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, int):  # one size for every layer
                value = [value] * self.n_layers
            value = [int(v) for v in value]
            if len(value) != self.n_layers or min(value) < 1:
                raise ValueError(
                    f"trace header: {name} needs {self.n_layers} positive sizes, got {value[:4]}..."
                )
            setattr(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict, with the format name and version."""
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TraceHeader:
        """Inverse of `to_dict`; unknown keys (from newer writers) are ignored."""
        version = int(data.get("version", FORMAT_VERSION))
        if version > FORMAT_VERSION:
            raise ValueError(
                f"trace format version {version} is newer than this moestream ({FORMAT_VERSION})"
            )
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def arrow_schema(header: TraceHeader) -> pa.Schema:
    """The Arrow schema of a trace, with the header JSON in its metadata."""
    ints, floats = pa.list_(pa.int32()), pa.list_(pa.float32())
    return pa.schema(
        [
            pa.field("request", pa.string(), nullable=False),
            pa.field("token", pa.int64(), nullable=False),
            pa.field("phase", pa.string(), nullable=False),
            pa.field("layer", pa.int32(), nullable=False),
            pa.field("step", pa.int64(), nullable=False),
            pa.field("experts", ints, nullable=False),
            pa.field("weights", floats, nullable=False),
            pa.field("pred_experts", ints),
            pa.field("pred_scores", floats),
            pa.field("pred2_experts", ints),
            pa.field("pred2_scores", floats),
        ],
        metadata={HEADER_KEY: header.to_json().encode()},
    )


def header_from_schema(schema: pa.Schema) -> TraceHeader | None:
    """The header stored in a schema's metadata, or None when the schema carries none."""
    raw = (schema.metadata or {}).get(HEADER_KEY)
    return None if raw is None else TraceHeader.from_dict(json.loads(raw))
