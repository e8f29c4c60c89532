"""Router traces: the format (`TraceWriter`, `read_trace`), importers, the cache simulator, predictor
evaluation.

Nothing here imports torch, so `moestream simulate` runs on any machine with pyarrow.

Recording (the engine):
    with TraceWriter(path, TraceHeader(model_id, n_layers, n_experts, top_k, dtype, expert_bytes=[...])) as w:
        w.append_forward(request, tokens, "prefill" | "decode", layer, experts [T, k], weights [T, k],
                         step=forward_number, pred_experts=[T, 2k], pred_scores=[T, 2k])
Reading: `read_trace(path) -> Trace` (any format, detected from the content); `load_traces(paths)` also
merges several vLLM-MoE-Logger files into one model.
"""

from __future__ import annotations

from moestream.trace.errors import TraceError
from moestream.trace.reader import detect_format, load_traces, read_trace
from moestream.trace.schema import PHASES, TraceHeader
from moestream.trace.table import Trace
from moestream.trace.writer import TraceWriter, partial_path

__all__ = [
    "PHASES",
    "Trace",
    "TraceError",
    "TraceHeader",
    "TraceWriter",
    "detect_format",
    "load_traces",
    "partial_path",
    "read_trace",
]
