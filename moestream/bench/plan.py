"""`moestream plan`'s model: decode speed at a cache budget, from parts measured on the model.

    MiB/token     the decode tokens of a routing trace replayed through the engine's own eviction policy
                  (`moestream.trace.simulator`, as `moestream simulate` does) at the budget, each miss
                  counted at the bytes the engine's reader asks of the disk for that expert (aligned)
    compute       ms per decoded token with every expert cached (C), and while streaming at the smallest
                  budget (S: the time not spent waiting for reads, every layer's experts computed one by
                  one as they land, where a fully cached layer runs as one graph)
    read rate     the engine's own: bytes read per second of waiting for them, at the smallest budget
                  (`plan_measure.py`); the disk alone (random whole experts through the engine's reader,
                  `ceiling.py`) is measured and shown beside it

    compute(B)          = C + (S - C) x miss rate(B)             (miss rate = 1 - hit rate)
    predicted ms/token  = compute(B) + MiB/token(B) / read rate          (the reported figure)
    overlapped ms/token = max(compute(B), MiB/token(B) / read rate)     (a bound: all reads hidden)

Reads are added to compute, not overlapped with it, because a layer's misses are only known once its
router ran and nothing is read ahead without `--prefetch`: the disk idles while attention, the router
and the last miss of each layer compute; what does overlap (hits computed while misses are read) is
already out of the read rate, measured as waiting. Compute depends on the budget: an expert that
misses is computed on its own as it lands, where cached ones run as one graph, so each miss adds its
share of S - C as well as its wait. The prediction is linear in the miss rate and passes through both
measured ends (every expert cached: C; the smallest budget, where every expert misses: S + its waits).
Interpolating by the share of layer forwards with any miss instead (a layer that misses once loses its
graph) predicted 1.5x too slow at 88% hits. `benchmarks/plan_check.py` compares the predicted and the
overlapped figures against real runs (BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from moestream.cache.size_classes import budget_requirements, planned_bytes
from moestream.cache.slots import plan_parts, slot_bytes
from moestream.errors import CacheBudgetError, MoestreamError
from moestream.store.experts import ExpertMap
from moestream.trace.simulator import simulate
from moestream.trace.table import Trace
from moestream.units import MiB, format_size

ALL_EXPERTS = "all experts"
AUTO = "auto"


@dataclass(frozen=True)
class ModelSizes:
    """What the model's experts cost the cache and the disk, per layer (indexed by layer id)."""

    n_layers: int
    read_bytes: list[int]  # aligned bytes the reader asks for to fill one expert of the layer (largest)
    slot_bytes: list[int]  # bytes one cache slot of the layer takes (largest)
    minimum: int  # the smallest budget the engine accepts: top_k x the largest slot
    all_experts: int  # the budget that holds every expert (what a cache that large allocates)


def model_sizes(emap: ExpertMap, top_k: int, n_layers: int) -> ModelSizes:
    """Sizes of `emap`'s experts as the engine's cache and reader see them."""
    read: dict[int, int] = {}
    slot: dict[int, int] = {}
    for (layer, _), parts in emap.units.items():
        reads = plan_parts(emap.kinds, parts).values()
        read[layer] = max(read.get(layer, 0), sum(p.length for kind in reads for p in kind))
        slot[layer] = max(slot.get(layer, 0), slot_bytes(parts))
    first = min(read)
    n = max(n_layers, max(read) + 1)
    minimum, _ = budget_requirements(emap, top_k)
    return ModelSizes(
        n,
        [read.get(i, read[first]) for i in range(n)],  # dense layers: never indexed
        [slot.get(i, slot[first]) for i in range(n)],
        minimum,
        planned_bytes(emap, 1 << 62, top_k),
    )


def fit_trace(trace: Trace, emap: ExpertMap, top_k: int, sizes: ModelSizes, name: str) -> Trace:
    """`trace` with this model's expert and slot sizes in its header, once its shape is checked.

    Raises:
        MoestreamError: the trace holds no decode tokens, or was recorded on a model of another shape.
    """
    h = trace.header
    if len(trace) == 0 or not (trace.phase == 1).any():
        raise MoestreamError(
            f"the trace {name} holds no decode tokens, and plan predicts decode speed from them"
        )
    if h.n_experts != emap.num_experts or h.top_k != top_k:
        raise MoestreamError(
            f"the trace {name} routes top-{h.top_k} of {h.n_experts} experts, but this model routes "
            f"top-{top_k} of {emap.num_experts}"
        )
    extra = sorted(set(trace.layer.tolist()) - set(emap.layers))
    if extra:
        raise MoestreamError(f"the trace {name} has MoE layer {extra[0]}, which this model does not have")
    header = replace(
        h, n_layers=sizes.n_layers, expert_bytes=list(sizes.read_bytes), slot_bytes=list(sizes.slot_bytes)
    )
    return replace(trace, header=header, notes=list(trace.notes))


def default_budgets(sizes: ModelSizes) -> list[int]:
    """Powers of two from the smallest at or above the minimum up to below every expert (the largest
    eight), and the budget that holds every expert."""
    budget = 1 << (sizes.minimum - 1).bit_length()
    budgets = []
    while budget < sizes.all_experts:
        budgets.append(budget)
        budget *= 2
    return [*budgets[-8:], sizes.all_experts]


def check_budgets(budgets: list[int], sizes: ModelSizes) -> None:
    """Raises CacheBudgetError for a budget the engine would refuse (below one layer's worst case)."""
    low = min(budgets)
    if low < sizes.minimum:
        raise CacheBudgetError(
            f"budget {format_size(low)} is below this model's minimum of {format_size(sizes.minimum)} "
            f"(top-k x the largest expert slot), which the engine would refuse"
        )


@dataclass(frozen=True)
class PlanRow:
    """The prediction at one budget. Times are ms per decoded token."""

    budget_bytes: int
    label: str  # "", "auto" or "all experts"
    slots: int
    hit_rate: float
    mib_per_token: float
    read_ms: float
    compute_ms: float
    ms: float  # compute + read
    overlap_ms: float  # max(compute, read)

    @property
    def tok_s(self) -> float:
        return 1000.0 / self.ms

    @property
    def overlap_tok_s(self) -> float:
        return 1000.0 / self.overlap_ms

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tok_s": self.tok_s, "overlap_tok_s": self.overlap_tok_s}


def predict(mib_per_token: float, compute_ms: float, read_bytes_per_s: float) -> tuple[float, float, float]:
    """(read ms, predicted ms, overlapped ms) per token from this budget's compute: the formulas of this
    module's docstring."""
    read_ms = mib_per_token * MiB / read_bytes_per_s * 1000.0
    return read_ms, compute_ms + read_ms, max(compute_ms, read_ms)


def compute_at(cached_ms: float, streaming_ms: float, miss_rate: float) -> float:
    """compute(B) = C + (S - C) x miss rate."""
    return cached_ms + (streaming_ms - cached_ms) * miss_rate


def plan_rows(
    trace: Trace,
    budgets: dict[int, str],
    policy: str,
    compute: tuple[float, float],
    read_bytes_per_s: float,
) -> tuple[list[PlanRow], list[str]]:
    """One row per budget (bytes -> label), from the decode part of `trace` replayed under `policy`
    (the trace's header gives the sizes: `fit_trace`); `compute` is (C, S) of the module's docstring.
    Returns the rows and the simulator's notes."""
    records, _, sim_sizes = simulate(trace, [policy], sorted(budgets))
    rows = []
    for r in (r for r in records if r["phase"] == "decode" and r["scope"] == "all"):
        compute_ms = compute_at(*compute, 1.0 - r["hit_rate"])
        read_ms, ms, overlap_ms = predict(r["mib_per_token"], compute_ms, read_bytes_per_s)
        rows.append(
            PlanRow(
                r["budget_bytes"],
                budgets[r["budget_bytes"]],
                r["capacity_slots"],
                r["hit_rate"],
                r["mib_per_token"],
                read_ms,
                compute_ms,
                ms,
                overlap_ms,
            )
        )
    return rows, sim_sizes.notes
