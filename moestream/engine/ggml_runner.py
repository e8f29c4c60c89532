"""The ggml `ModelRunner`: each decoder layer a ggml graph built by moestream, one thread pool.

It owns the KV cache (F16 ggml tensors of the whole context, as llama.cpp keeps it: ggml's CPU flash
attention over F32 keys and values gave wrong logits on the trained fixture), the graphs of the step
shapes in use and their buffers. transformers keeps the configs, the tokenizer, the chat template and
the routers' modules (the stale gate of `--prefetch`), and is the oracle of the tests. A step runs, per
layer, one graph (attention, router, shared expert; `graphs/layers.py`); the layer's routed
experts then go either into the next graph (every one cached: mul_mat_ids over the cache's slots) or
through the same schedule as every other path (cache misses as their bytes land, prefetch, traces,
routing replay), whose outputs the next graph sums in with the same nodes. The runner reaches the
experts through one door, `ExpertLayers` (runtime/expert_layers.py). When the cache
holds every expert of the model (read at load) and nothing needs the routing on the host, a step
(a decoded token, a prefill chunk) is one graph: the routers' ids address the slots inside it (expert
e of a layer in slot first + e), so nothing returns to Python between layers; the same nodes, so the
same bits. Every compute, graphs and experts alike, runs on ggml's one threadpool; torch runs
single-threaded glue in between.

On a backend (ggml's CUDA) the step is one graph over every expert copied to the device, or, with a GPU
tier smaller than the experts (`--gpu-tier`), a graph a layer over its slots (`engine/tiered_steps.py`).

A graph set (`graphs/graph_set.py`) serves one step shape: T tokens (1 when decoding, up to CHUNK per
prefill piece) and an attention span S (positions, a multiple of 256); the few most recent sets are kept.

Several sequences at once (`--parallel N`, `engine/batch.py` schedules them): the KV cache has N slots,
each `ctx` rows of every layer's cache (`GgmlKV.slot`); a prefill chunk or a token decoded alone runs in
its sequence's slot as above, and `decode` runs one token of each of B sequences as one step of B rows
(each attends over its own slot's rows, `LayerGraphs.attend`; every other op is row by row, so each
MoE layer computes each routed expert once over all the rows routed to it; from 8 rows, a K-quant
expert once for each group of at most 7 rows that routes to it, `ggml/tiled.py`). A slot per sequence rather
than llama.cpp's unified cells: a token's attention then spans only its own sequence's positions (a
unified cache masks the others' cells, which a decode step still walks), a slot is cropped or reset alone
(the prompt cache per slot), and no cell allocator is needed; the cost is memory reserved for N full
contexts, which the memory plan counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from moestream import ggml
from moestream.cache.policy import EvictionPolicy, LRUPolicy
from moestream.engine.gpu_tier import auto_tier, expert_bytes, minimum_budget
from moestream.engine.logits import DeviceLogits
from moestream.engine.options import AUTO
from moestream.engine.repacked import REPACK_ROWS, RepackedExperts, RepackedTrunk, trunk_matrices
from moestream.engine.runners import Launched, ModelRunner
from moestream.engine.stats import TierCounters
from moestream.engine.tiered_steps import TieredSteps, as_f32, tier_misses
from moestream.errors import MoestreamError
from moestream.ggml import tiled
from moestream.ggml.backend import Backend, DeviceMemory, Region
from moestream.ggml.lib import GgmlUnavailableError
from moestream.ggml.net import Net
from moestream.ggml.repack import REPACK_ENV, repack_wanted
from moestream.graphs.graph_set import GraphSet, set_bytes
from moestream.graphs.layers import SPAN_STEP, StepBuffers, layer_caches, recurrent_bytes
from moestream.graphs.moe import Whole
from moestream.graphs.spec import ModelSpec
from moestream.runtime.expert_layers import ExpertLayers, ExpertTypes, SlotArena
from moestream.runtime.experts import Routed
from moestream.units import format_size

CHUNK = 256  # prefill tokens per step: the step's buffers and scratch grow with it
DEVICE_CHUNK = 512  # on a backend (ggml's CUDA: llama.cpp's default micro-batch)
# graph sets kept: prefill shapes (T > 1: the largest buffers; a long prompt's chunks each attend over
# another span, so an older one is seldom used again) and decode sets (T = 1: the current span's and
# the previous one's)
KEEP_PREFILL_SETS = 1
KEEP_DECODE_SETS = 2


def _slots_words(slots: int) -> str:
    """The KV cache's slots in the mode line (none said for one)."""
    return f" in each of {slots} slots (--parallel {slots})" if slots > 1 else ""


def decode_sets(slots: int) -> int:
    """Decode sets kept by a runner of `slots` KV-cache slots: two (the current span's and the previous
    one's); with several slots, two per slot: a sequence decoding alone has a set of its slot's, a batch
    one per row count (pointed at its slots each step), and requests joining and leaving change which
    every few tokens (a set's build: ~10 ms on 2 cores, `benchmarks/batch_churn.py`)."""
    return KEEP_DECODE_SETS * slots


def _round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step


class GgmlKV:
    """The runner's KV cache as the engine's prompt cache sees it: how many positions hold tokens.
    `recurrent`: bytes of linear-attention states (Qwen3-Next, Qwen3.5), which fold in every token: such
    a cache is never cropped back (the prompt cache then starts over, as with transformers' cache)."""

    def __init__(self, bytes_per_token: int, recurrent: int = 0, slot: int = 0) -> None:
        self.tokens = 0
        self.slot = slot  # its rows in the runner's KV cache: [slot * ctx, (slot + 1) * ctx)
        self.bytes_per_token = bytes_per_token
        self.recurrent = recurrent

    def held_bytes(self) -> int:
        """Bytes of keys and values the positions in use hold (and the recurrent states, once used)."""
        return self.tokens * self.bytes_per_token + (self.recurrent if self.tokens else 0)

    def crop(self, length: int) -> None:
        """transformers' convention: a negative length removes that many tokens, else keep `length`.

        Raises:
            ValueError: tokens would be removed from recurrent states.
        """
        kept = max(0, self.tokens + length if length < 0 else min(length, self.tokens))
        if self.recurrent and kept < self.tokens:
            raise ValueError("linear-attention states cannot be cropped back")
        self.tokens = kept

    def get_seq_length(self) -> int:
        return self.tokens


class GgmlRunner(ModelRunner):
    """Runs `ids` after what the KV cache holds: (last position's logits [V] f32, the cache object)."""

    owns_compute_pool = True  # every compute on ggml's one pool; torch runs single-threaded glue

    def __init__(
        self,
        spec: ModelSpec,
        experts: ExpertLayers,
        ctx_size: int,
        threads: int,
        backend: Backend | None = None,
        gpu_tier: int | str | None = None,
        policy: Callable[[], EvictionPolicy] = LRUPolicy,
        slots: int = 1,
        trunk_bytes: int = 0,
        memory: DeviceMemory | None = None,
    ) -> None:
        """`gpu_tier`: bytes of device slots for the routed experts on `backend` (`engine/gpu_tier.py`;
        None: every expert on the device; "auto": sized from the device's free memory, `auto_tier`),
        filled by `policy` from the host cache (which reads from disk what it lacks). `slots`: KV-cache
        slots, one per sequence decoded together (`--parallel`). `trunk_bytes`: the trunk's weights.
        `memory`: `backend`'s, the trunk copied there at load (`engine/trunk_release.py`); else made here.

        Raises:
            MoestreamError: several slots for a model with linear-attention layers.
            GgmlUnavailableError: a GPU tier without a backend, or for experts the graphs cannot compute.
            CacheBudgetError: the tier cannot hold one token's routed experts of a layer.
        """
        self.spec, self.experts, self.threads = spec, experts, threads
        self.ctx = _round_up(ctx_size, SPAN_STEP)
        recurrent_layers = [x.index for x in spec.layers if x.mixer.recurrent]
        if slots > 1 and recurrent_layers:
            raise MoestreamError(
                f"--parallel {slots} is not possible for {spec.family}: its linear-attention layers keep "
                "one recurrent state, not one per sequence (run it with --parallel 1)"
            )
        # Gated DeltaNet layers: their two states. On a backend the host tensors only name the device's
        # copies (`DeviceMemory.register`, "device": never copied): left unwritten, they take no memory
        if backend is None:
            self.kv = layer_caches(spec, self.ctx * slots)
        else:
            shapes = layer_caches(spec, self.ctx * slots, "meta")
            self.kv = [tuple(torch.empty(t.shape, dtype=t.dtype) for t in pair) for pair in shapes]
        # on a backend (ggml's CUDA): the graphs compute there; the KV cache lives there alone, and every
        # routed expert in stacks of its own (`_on_device`), the step one graph
        if backend is not None:
            Net.check_query_mode()
        if memory is None and backend is not None:
            memory = DeviceMemory(backend)
        self.memory = memory
        # the device's memory before the trunk and this runner took any (both counted in what it keeps)
        measured = memory.before if memory is not None and gpu_tier == AUTO else (0, 0)
        self._device: tuple[tuple, dict[int, ExpertTypes], Whole] | None = None  # (key, types, slots)
        self._stacks: list[Region] = []  # the experts' stacks on the device
        if self.memory is not None:
            for i, pair in enumerate(self.kv):
                for j, t in enumerate(pair):
                    if t.numel():
                        self.memory.register(t, "device", f"kv{i}.{j}")
        recurrent = recurrent_bytes(spec, self.kv)
        per_token = (self.kv_bytes - recurrent) // (self.ctx * slots)
        self.seqs = [GgmlKV(per_token, recurrent, slot) for slot in range(slots)]  # one per KV slot
        self.state = self.seqs[0]  # what a request from scratch runs in (`forward` with no cache)
        self._moe_layers = [x.index for x in spec.layers if x.router is not None]
        # read once (each a scan of the layers, which a step did): the sliding window, and the hits a
        # decoded token's whole-step graph counts (K distinct experts a MoE layer)
        self._window = spec.window
        self._token_hits = len(self._moe_layers) * spec.top_k if self._moe_layers else 0
        self._generation = 0  # the expert streaming (`ExpertLayers.generation`) the graph sets read
        self._sets: OrderedDict[tuple, GraphSet] = OrderedDict()
        self._steps = 0  # steps run and sets closed: whether a step's `DeviceLogits` still hold
        self.tiered: TieredSteps | None = None  # the steps over a GPU tier, when asked for one
        self.auto_words = ""  # --gpu-tier auto: what it chose and why (the mode line)
        # MOESTREAM_GGML_REPACK=1: short steps on repacked copies of the experts (`engine/repacked.py`),
        # made once every expert is in its slot for good
        self._repack = repack_wanted()
        tiled.groups_wanted()  # another value than 0 or 1 refused at load, not at the first batch step
        self._repacked: RepackedExperts | None = None
        self._trunk_copy: RepackedTrunk | None = None  # the trunk's, for the same steps (`_host_trunk`)
        try:
            if self._repack and backend is not None:
                raise GgmlUnavailableError(
                    f"{REPACK_ENV}=1 repacks the experts for ggml's CPU path, not a backend's "
                    "(--device cuda): unset it there"
                )
            if self._repack and not experts.holds_all():
                raise GgmlUnavailableError(
                    f"{REPACK_ENV}=1 copies every expert once all are cached: it needs an expert cache that "
                    "holds every expert (--cache), or unset it"
                )
            if gpu_tier is None:
                tier_misses(False)  # refused when set: there is no tier to miss
            elif self.memory is None:
                raise GgmlUnavailableError(
                    "--gpu-tier sizes the expert slots of ggml's CUDA backend: run with --device cuda "
                    "(or drop --gpu-tier)"
                )
            else:
                if gpu_tier == AUTO:
                    gpu_tier = self._auto_tier(trunk_bytes, *measured)
                if gpu_tier is not None:
                    self.tiered = TieredSteps(self.memory, experts, spec, gpu_tier, policy, threads)
        except BaseException:
            self.close()
            raise

    def _auto_tier(self, trunk_bytes: int, free: int, total: int) -> int | None:
        """`--gpu-tier auto` on a device with `free` of `total` bytes free: every expert on the device where
        they fit beside the trunk, the KV cache and the graphs' buffers (`device_needs`), else a tier of
        what is left (`auto_tier`); the choice said in the mode line.

        Raises:
            GgmlUnavailableError: the backend does not say its free memory.
            CacheBudgetError: too little is left for a tier.
        """
        backend = self.memory.backend
        if not total:
            raise GgmlUnavailableError(
                f"--gpu-tier auto: ggml's {backend.kind} backend does not say its free memory; give "
                "--gpu-tier a size"
            )
        needs = device_needs(self.spec, self.experts, self.ctx, self.threads, len(self.seqs), trunk_bytes)
        if needs is None:
            return None  # a tier cannot hold them (TieredSteps says so); every expert on the device
        tier = auto_tier(free, needs.reserve, needs.every, needs.least, needs.holds_all)
        where = "every expert on the device" if tier is None else f"a tier of {format_size(tier)}"
        self.auto_words = (
            f"--gpu-tier auto: {where} ({format_size(free)} free, {format_size(needs.reserve)} for the "
            f"trunk, KV cache and graphs, {format_size(needs.every)} of experts)"
        )
        return tier

    @property
    def kv_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv)

    def describe(self) -> str:
        if self.memory is not None:
            backend = self.memory.backend
            experts = "one graph a step, every routed expert on the device"
            if self.tiered is not None:
                experts = self.tiered.describe()
            if self.auto_words:
                experts += f"; {self.auto_words}"
            return (
                f"trunk ggml graphs on ggml's {backend.kind} backend ({backend.description}; "
                f"{self.spec.family}: {experts}), KV cache F16 of {self.ctx} positions there"
                + _slots_words(len(self.seqs))
            )
        if self.experts.graph_types():
            whole = "; one graph a step while every expert is cached"
        else:  # the graphs cannot compute them (a family's activation, a format ggml lacks)
            whole = ", computed by the expert runtime"
        if self._repack:
            whole += (
                f"; steps of up to {REPACK_ROWS} tokens on repacked copies of the experts (made once every "
                f"expert is in its slot) and of the trunk's matrices ({REPACK_ENV}=1)"
            )
        return (
            f"trunk ggml graphs ({self.spec.family}: one graph a layer, the routed experts between them"
            f"{whole}), KV cache F16 of {self.ctx} positions" + _slots_words(len(self.seqs))
        )

    @property
    def chunk(self) -> int:
        """Prefill tokens a step feeds at most."""
        return CHUNK if self.memory is None else DEVICE_CHUNK

    def forward(
        self, ids: list[int], cache: Any, greedy: bool = False
    ) -> tuple[torch.Tensor | DeviceLogits, GgmlKV]:
        """`ids` after what `cache` holds (None: a request from scratch in slot 0; else one of `seqs`,
        which may hold 0 tokens: a request from scratch in that slot), in chunks of `chunk` tokens.
        On a backend, a step of one graph leaves the logits there when `greedy` (`DeviceLogits`: its
        argmax read back alone), and a chunk before the last always (no one reads them)."""
        kv = self._own(cache)
        logits = None
        for start in range(0, len(ids), self.chunk):
            chunk = ids[start : start + self.chunk]
            if kv.tokens + len(chunk) > self.ctx:
                raise ValueError(f"{kv.tokens + len(chunk)} positions exceed the KV cache's {self.ctx}")
            left = greedy or start + self.chunk < len(ids)
            logits = self._step(chunk, list(range(kv.tokens, kv.tokens + len(chunk))), (kv.slot,), left)
            kv.tokens += len(chunk)
        return (logits.clone() if isinstance(logits, torch.Tensor) else logits), kv

    def launch(self, ids: list[int], cache: Any, greedy: bool = False) -> Launched | None:
        """`ModelRunner.launch`: a plainly greedy decoded token's step of one graph on a backend (no GPU
        tier), started; None elsewhere."""
        if self.memory is None or self.tiered is not None or len(ids) != 1 or not greedy:
            return None
        kv = self._own(cache)
        if kv.tokens + 1 > self.ctx:
            return None  # the call raises what is wrong
        with torch._C._InferenceMode(True):
            done = self._step(ids, [kv.tokens], (kv.slot,), left=True, wait=False)

        def finish() -> tuple[torch.Tensor | DeviceLogits, GgmlKV]:
            with torch._C._InferenceMode(True):
                logits = done()
            kv.tokens += 1
            return logits, kv

        return finish

    def decode(self, seqs: list[tuple[GgmlKV, int]]) -> torch.Tensor:
        """One token after each sequence's cache (one of `seqs` each, distinct) as one step of B rows:
        their logits [B, V]. A single sequence runs the step `forward` runs."""
        if len(seqs) == 1:
            kv, token = seqs[0]
            return self.forward([token], self._own(kv))[0][None]
        kvs = [self._own(kv) for kv, _ in seqs]
        if len({kv.slot for kv in kvs}) != len(kvs):
            raise ValueError("a decode step takes each KV slot once")
        for kv in kvs:
            if kv.tokens + 1 > self.ctx:
                raise ValueError(f"{kv.tokens + 1} positions exceed the KV cache's {self.ctx}")
        logits = self._step([t for _, t in seqs], [kv.tokens for kv in kvs], tuple(kv.slot for kv in kvs))
        for kv in kvs:
            kv.tokens += 1
        return logits.clone()

    def _own(self, cache: Any) -> GgmlKV:
        """The slot `cache` is (None: slot 0, emptied)."""
        if cache is None:
            self.state.tokens = 0  # a request from scratch
            return self.state
        if cache is not self.state and not any(cache is kv for kv in self.seqs):
            raise RuntimeError("the ggml runner continues only its own KV cache")
        return cache

    def _set(
        self,
        tokens: int,
        span: int,
        last: bool = False,
        slots: tuple[int, ...] = (0,),
        kern: Any = None,
        keep: int = KEEP_PREFILL_SETS,
    ) -> GraphSet:
        """The graph set of a step's shape, built where none is kept; `keep`: the prefill sets kept at
        least (a round's side by side, `together`, each its own)."""
        kern = kern if kern is not None else ggml.kernels(self.threads)
        if self.experts.generation != self._generation:  # a restream: the graphs read the old slots
            self.close_sets()
            self._drop_repacked()
            self._generation = self.experts.generation
        if self.tiered is not None:  # the tier first: made again, it closes the sets over the old one
            self._tier_types()
        # a batch on the host: keyed by its row count, its slots pointed at each step (`GraphSet.rebase`),
        # so that requests joining and leaving build no graphs (a device's sets keep their slots)
        rebase = len(slots) > 1 and self.memory is None and self.tiered is None
        key = (tokens, span, len(slots) if rebase else slots)
        gs = self._sets.get(key)
        # the pool was replaced (another thread count), or the routing is wanted on the host now
        if gs is not None and (gs.pool != kern.pool or gs.last != (last and tokens > 1)):
            self._sets.pop(key).close()
            gs = None
        if gs is None:
            types = self._host_types(tokens) if self.memory is None else self._device_types()
            experts = self.experts.num_experts
            segments = tuple((slot * self.ctx, 1 if len(slots) > 1 else tokens) for slot in slots)
            shape = (tokens, span)
            args = (self.spec, self.kv, shape, experts, types, self.threads, kern.pool, last, self.memory)
            tiered = self.tiered
            if tiered is None:
                trunk = self._host_trunk(tokens) if self.memory is None else None
                gs = GraphSet(*args, segments, trunk=trunk)
            else:
                gs = GraphSet(*args, segments, tiered.device_only, tiered.mixed)
            self._sets[key] = gs
            same = [k for k in self._sets if _prefill(k) == _prefill(key)]  # oldest first
            kept = max(keep, KEEP_PREFILL_SETS) if _prefill(key) else decode_sets(len(self.seqs))
            for k in same[: max(0, len(same) - kept)]:
                self._sets.pop(k).close()
        self._sets.move_to_end(key)
        if rebase:
            gs.rebase(tuple(slot * self.ctx for slot in slots))
        return gs

    def _step(
        self,
        ids: list[int],
        positions: list[int],
        slots: tuple[int, ...],
        left: bool = False,
        wait: bool = True,
    ) -> torch.Tensor | DeviceLogits | Callable[[], torch.Tensor | DeviceLogits]:
        """One step: one sequence's `ids` at `positions` in slot slots[0], or one token of each of
        len(slots) sequences (a batch); the logits of its last position [V] (a batch: [B, V]). `left`
        (one sequence): a backend's graph of the whole step leaves them there (`_left`). `wait` False
        (a backend's step without a GPU tier): what waits for the launched step and gives them."""
        self._steps += 1  # the logits a step before left on the device are overwritten now
        T = len(ids)
        batch = len(slots) > 1
        last = not batch and not self.experts.every_position()
        kern = ggml.kernels(self.threads)
        gs = self._set(T, _round_up(max(positions) + 1, SPAN_STEP), last, slots, kern)
        self._begin(gs, ids, positions, slots)
        b = gs.buf
        if self.tiered is not None:  # the device, a graph a layer over its GPU tier
            # the pool computes the experts the host does; its workers poll between those computes, but
            # on ggml's CPU backend, whose own threads compute the graphs on the same cores, it pauses
            cpu = self.memory.backend.kind == "cpu"
            with kern._lock, contextlib.nullcontext() if cpu else kern.hold():
                self.tiered.step(gs, lambda layer, n: self._place(self._experts(layer, b, n), b))
            return b.logits
        if self.memory is not None:  # the device: the step one graph over its expert stacks
            net = gs.whole_graph(self._on_device()[2])
            net.launch(fetch=not left)
            done = lambda: self._device_done(gs, net, T, left)  # noqa: E731
            return done() if wait else done
        first = self.experts.resident_slots()
        if first is not None:
            # one graph: its pool paused after it, as `hold` would pause it (without that generator-
            # based context: a few microseconds a decoded token)
            with kern._lock:
                try:
                    gs.whole_graph(Whole(first)).run()
                finally:
                    kern.idle()
            self.experts.count_resident(self._resident_hits(gs, T))
            return b.logits
        with kern._lock, kern.hold():
            for _ in self._host_layers(gs, batch):
                pass
        return b.logits

    def _begin(self, gs: GraphSet, ids: list[int], positions: list[int], slots: tuple[int, ...]) -> None:
        """A step's inputs into its set's buffers (a sequence from scratch: its linear-attention states
        zeroed first)."""
        batch = len(slots) > 1
        if positions[0] == 0 and not batch:  # from scratch: linear-attention states start at zero
            for layer, (conv, state) in zip(self.spec.layers, self.kv):
                if layer.linear is not None:
                    for t in (conv, state):
                        t.zero_() if self.memory is None else self.memory.zero(t)
        gs.buf.set_inputs(
            ids, positions, [slot * self.ctx for slot in (slots if batch else slots * len(ids))], self._window
        )

    def _host_layers(self, gs: GraphSet, batch: bool, fuse: bool = True) -> Iterator[None]:
        """A step on the host's expert streaming (`_step`, `together`; the caller holds the pool), a layer
        at a time: its graph, then its routed experts (`fuse`: pinned where the cache holds every one,
        for the next graph to compute; else by the schedule, which reads what the cache lacks), then a
        yield. The last graph leaves the logits in `gs.buf.logits`."""
        b = gs.buf
        pinned: tuple[int, list[int]] | None = None  # (layer, experts) to unpin
        try:
            graphs, fused = gs.layer_graphs()
            for i, net in enumerate(graphs):
                (fused[i] if pinned is not None else net).run()
                if pinned is not None:
                    self.experts.unpin(*pinned)
                    pinned = None
                if i < len(self.spec.layers) and self.spec.layers[i].router is not None:
                    if fuse and i + 1 in fused:
                        pinned = self._cached(i, b, gs.rows(i))
                    if pinned is None:
                        self._place(self._experts(i, b, gs.rows(i), batch), b)
                yield
        finally:
            if pinned is not None:
                self.experts.unpin(*pinned)

    def lockstep(self) -> bool:
        """Whether a round's steps run side by side, a layer at a time (`together`): on the host, streaming
        experts through a cache that does not hold every one, with nothing following the routing a step
        at a time (a routing replay, prefetch: `steps_in_order`; a trace is told each step's rows). Not
        on a backend (a step is one graph there)."""
        return (
            self.memory is None
            and self.tiered is None
            and not self.experts.steps_in_order()
            and self.experts.resident_slots() is None
        )

    def together(
        self,
        decode: list[tuple[GgmlKV, int]],
        chunks: list[tuple[list[int], GgmlKV]],
        before: Callable[[int], None] | None = None,
    ) -> list[torch.Tensor]:
        """A round's steps side by side (where `lockstep`): the decode step of `decode` (a token after each
        sequence's cache, as `decode` runs it; none where empty) and each of `chunks` (a prompt's next
        tokens after what its cache holds, at most `chunk`), a layer at a time: every step computes its
        layer as it does alone (its own graphs, its experts by the schedule: the same bits), each in turn,
        so that the experts one step reads for a layer are hits for the others at that layer, not evicted
        by the layers in between. Their logits: the decode step's [B, V], then each chunk's last [V].
        `before(i)`: called before each layer of step i (the decode step first, then the chunks), for a
        trace recorder to know whose routing comes next.

        Raises:
            ValueError: a sequence twice, a chunk longer than `chunk`, positions beyond the KV cache.
        """
        items: list[tuple[list[int], list[int], tuple[int, ...]]] = []
        kvs = [self._own(kv) for kv, _ in decode] + [self._own(kv) for _, kv in chunks]
        if len({kv.slot for kv in kvs}) != len(kvs):
            raise ValueError("a round takes each KV slot once")
        if decode:
            rows = kvs[: len(decode)]
            items.append(([t for _, t in decode], [kv.tokens for kv in rows], tuple(kv.slot for kv in rows)))
        for (ids, _), kv in zip(chunks, kvs[len(decode) :]):
            if not ids or len(ids) > self.chunk:
                raise ValueError(f"a chunk of {len(ids)} tokens: 1 to {self.chunk}")
            items.append((list(ids), list(range(kv.tokens, kv.tokens + len(ids))), (kv.slot,)))
        for ids, positions, _ in items:
            if positions[-1] + 1 > self.ctx:
                raise ValueError(f"{positions[-1] + 1} positions exceed the KV cache's {self.ctx}")
        kern = ggml.kernels(self.threads)
        prefills = sum(len(ids) > 1 for ids, _, _ in items)
        steps = []
        for ids, positions, slots in items:
            self._steps += 1
            last = len(slots) == 1 and not self.experts.every_position()
            span = _round_up(max(positions) + 1, SPAN_STEP)
            gs = self._set(len(ids), span, last, slots, kern, keep=prefills)
            self._begin(gs, ids, positions, slots)
            steps.append((gs, len(slots) > 1))
        with kern._lock, kern.hold():
            layers = [self._host_layers(gs, batch, fuse=False) for gs, batch in steps]
            try:
                for _ in steps[0][0].layer_graphs()[0]:  # each step's layer i, in turn; then layer i + 1
                    for i, layer in enumerate(layers):
                        if before is not None:
                            before(i)
                        next(layer)
            finally:
                for layer in layers:
                    layer.close()
        out = [gs.buf.logits.clone() for gs, _ in steps]
        if len(decode) == 1:  # a decode step of one sequence: [1, V], as `decode` gives it
            out[0] = out[0][None]
        for kv, n in zip(kvs, [1] * len(decode) + [len(ids) for ids, _ in chunks]):
            kv.tokens += n
        return out

    def _device_done(self, gs: GraphSet, net: Net, T: int, left: bool) -> torch.Tensor | DeviceLogits:
        """The end of a backend's step of one graph (`Net.launch`ed): waited for, its experts counted, its
        logits (`left`: as `_left` gives them)."""
        self.memory.backend.synchronize()
        self.experts.count_resident(self._resident_hits(gs, T))
        return self._left(gs, net) if left else gs.buf.logits

    def _resident_hits(self, gs: GraphSet, T: int) -> int:
        """The cache hits of a step of one graph over every expert: K a layer for one token; else, as
        `pin_all_hits` counts them, each layer's distinct experts."""
        if T == 1:
            return self._token_hits
        rows = [gs.rows(layer) for layer in self._moe_layers]
        return sum(int(torch.unique(routed[:n]).numel()) for routed, n in zip(gs.buf.routed, rows))

    def _left(self, gs: GraphSet, net: Net) -> torch.Tensor | DeviceLogits:
        """The logits a backend's step left there: its argmax as their greedy token, the logits copied
        back on demand until the next step; where the argmax may not be numpy's (tied maxima, a NaN:
        `LayerGraphs.greedy`), copied back now."""
        token = gs.buf.greedy_token()
        if token is None:
            net.fetch()
            return gs.buf.logits
        step = self._steps

        def fetch() -> torch.Tensor:
            if self._steps != step:
                raise RuntimeError("a step's logits left on the device are overwritten by the next step")
            net.fetch()
            return gs.buf.logits.clone()

        return DeviceLogits(token, fetch)

    def _device_types(self) -> dict[int, ExpertTypes]:
        """Each MoE layer's experts as the device's graphs see them: its GPU tier's slots, or the stacks
        of every expert."""
        return self._tier_types() if self.tiered is not None else self._on_device()[1]

    def _tier_types(self) -> dict[int, ExpertTypes]:
        tier, made = self.tiered.tier()
        if made:  # the sets' graphs read an older tier's slots
            self.close_sets()
        return tier.types

    def tier_counters(self) -> TierCounters | None:
        """The GPU tier's cumulative counters (None without one)."""
        return None if self.tiered is None else self.tiered.counters()

    def before_restream(self) -> None:
        """The host slots are freed next: the tier copied from them goes, and they are unpinned."""
        if self.tiered is not None:
            self.tiered.drop()
            self.close_sets()
            self.memory.unpin_hosts()

    def _on_device(self) -> tuple[tuple, dict[int, ExpertTypes], Whole]:
        """(key, each MoE layer's experts as the device's graphs see them, their Whole): every routed
        expert copied out of the expert cache (which holds them all, read at load) into stacks on the
        device, one per matrix kind and layer, expert e at e times the matrix's bytes (ggml's CUDA
        kernels step between experts in whole blocks, which the host slots' stride is not). Made again
        when the streaming or its slots change (a restream).

        Raises:
            GgmlUnavailableError: the cache does not hold every expert in place (on a backend the step
                is one graph: experts streamed from disk between layers are not computed there yet).
        """
        if self.experts.generation != self._generation:  # a restream: the sets read the old copies
            self.close_sets()
            self._generation = self.experts.generation
        kind = self.memory.backend.kind
        if self.experts.host_routing():
            raise GgmlUnavailableError(
                f"ggml's {kind} backend computes a step as one graph: a trace, a routing replay and "
                "--prefetch need each layer's routing on the host, which it does not give yet (--device cpu; "
                "a trace and --prefetch run with a GPU tier, --gpu-tier)"
            )
        key = (self._generation, self.experts.cache_version())
        if self._device is not None and self._device[0] == key:  # the host slots did not move
            return self._device
        first = self.experts.resident_slots()
        host = self.experts.graph_types()
        moe = self.experts.layers
        if first is None or any(layer not in host for layer in moe):
            raise GgmlUnavailableError(
                f"ggml's {kind} backend computes a step as one graph with every routed expert on the "
                "device: give the expert cache room for all of them (the experts of this model streamed "
                "from disk run on the CPU path: --device cpu)"
            )
        self._drop_device()
        for base, nbytes in self.experts.slot_regions():  # the host slots change: never weights
            self.memory.forbid(base, nbytes, "the expert cache's slots")
        types = {}
        n = self.experts.num_experts
        for layer in moe:
            p = host[layer]
            arena = p.arena
            address, strides = {}, {}
            for kind, nbytes in p.matrix_bytes(self.spec.hidden):
                stack = self.memory.alloc(nbytes * n, f"experts{layer}.{kind}")
                self._stacks.append(stack)
                for e in range(n):
                    src = arena.address[kind] + (first[layer] + e) * arena.slot_bytes
                    self.memory.write(stack, e * nbytes, src, nbytes)
                address[kind], strides[kind] = stack.device, nbytes
            types[layer] = dataclasses.replace(p, arena=SlotArena(address, 0, n, strides))
        self._device = (key, types, Whole(dict.fromkeys(moe, 0)))
        return self._device

    def _drop_device(self) -> None:
        for stack in self._stacks:
            self.memory.release(stack)
        self._stacks = []
        self._device = None

    def _cached(self, layer: int, b: StepBuffers, n: int) -> tuple[int, list[int]] | None:
        """The step's experts of `layer` when the cache holds every one and nothing else needs the
        routing on the host (a trace, a replay, prefetch): pinned, each token's slots in `b.slots`,
        for the next graph to compute (the first `n` tokens' rows). Returns (layer, experts) to unpin,
        or None to run the schedule instead."""
        if self.experts.host_routing():
            return None
        rows = b.order[:n, : b.weights[0].shape[1]].tolist()
        slot = self.experts.pin(layer, rows)
        if slot is None:
            return None
        b.slots[:n].copy_(torch.tensor([[slot[e] for e in row] for row in rows], dtype=torch.int32))
        return layer, list(slot)

    def _experts(self, layer: int, b: StepBuffers, n: int, apart: bool = False) -> Routed:
        """The schedule on the first `n` tokens' rows (`apart`: a batch of sequences, one token each)."""
        weights = b.weights[layer % 2][:n]
        k = weights.shape[1]
        routed = self.experts.compute(layer, b.moe_in[:n], b.order[:n, :k], weights, apart=apart)
        if routed.weights is not weights:  # a routing replay gives the trace's weights
            weights.copy_(routed.weights)
        return routed

    @staticmethod
    def _place(routed: Routed, b: StepBuffers) -> None:
        """Put the runtime's expert outputs where the next graph reads them: `b.outputs` [T, K, H]."""
        k = b.outputs.shape[1]
        flat = b.outputs.view(-1, b.outputs.shape[2])  # [T * K, H]
        if b.outputs.shape[0] == 1:
            for position, e in enumerate(routed.rows[0]):
                flat[position].copy_(routed.outputs[e][0])
            return
        # the routing's pairs are grouped by expert, in the order of `by_expert`
        routing = routed.routing
        outputs = torch.cat([as_f32(routed.outputs[e]) for e in routing.by_expert])
        flat.index_copy_(0, routing.tokens * k + routing.positions, outputs)

    def _host_types(self, tokens: int) -> dict[int, ExpertTypes]:
        """How a host graph set of `tokens` tokens sees the experts: their slots, or with
        MOESTREAM_GGML_REPACK=1, a step of at most REPACK_ROWS tokens while every expert is in its slot
        for good, the repacked copies (made on the first such set)."""
        types = self.experts.graph_types()
        first = self.experts.resident_slots() if self._repack and tokens <= REPACK_ROWS else None
        if first is None:
            return types
        if self._repacked is None:
            self._repacked = RepackedExperts(types, first, self.experts.num_experts, self.spec.hidden)
        return self._repacked.types

    def _host_trunk(self, tokens: int) -> dict[int, tuple[int, int, int]] | None:
        """With MOESTREAM_GGML_REPACK=1, a host graph set of at most REPACK_ROWS tokens reads the trunk's
        repacked copies (made on the first such set): their map, else None."""
        if not self._repack or tokens > REPACK_ROWS:
            return None
        if self._trunk_copy is None:
            self._trunk_copy = RepackedTrunk(trunk_matrices(self.spec))
        return self._trunk_copy.map

    def _drop_repacked(self) -> None:
        """The repacked copies freed (the sets over them closed first)."""
        if self._repacked is not None:
            self._repacked.close()
            self._repacked = None

    def close_sets(self) -> None:
        self._steps += 1  # logits left on a set's device buffers go with it
        for gs in self._sets.values():
            gs.close()
        self._sets.clear()

    def close(self) -> None:
        """The graph sets and the KV cache freed at once (and on a backend, everything it holds there)."""
        self.close_sets()
        self._drop_repacked()
        if self._trunk_copy is not None:
            self._trunk_copy.close()
            self._trunk_copy = None
        self.kv = []
        if self.memory is not None:
            if self.tiered is not None:
                self.tiered.drop()
            self._stacks = []
            self.memory.close()
            self.memory.backend.close()
            self.memory = None


def planned_bytes(
    spec: ModelSpec,
    ctx_size: int,
    experts: int,
    inter: int,
    threads: int,
    slots: int = 1,
    chunk: int = CHUNK,
) -> tuple[int, int]:
    """(its KV cache, its graph sets at most): the bytes a runner of `spec` takes, known before it is
    built: KEEP_PREFILL_SETS sets of the largest step shape (a full prefill chunk, `chunk` tokens: on a
    backend DEVICE_CHUNK, attending over the whole context) and `decode_sets(slots)` of one token
    (`slots` > 1: one of each slot's sequences, the largest batch, at most) over the whole context, each
    as `set_bytes` lays it out (a batch's logits added: one row a sequence)."""
    ctx = _round_up(ctx_size, SPAN_STEP)
    kv = layer_caches(spec, ctx * slots, "meta")
    prefill = set_bytes(spec, kv, min(chunk, ctx), ctx, experts, inter, threads)
    decode = set_bytes(spec, kv, slots, ctx, experts, inter, threads) + 4 * spec.vocab * (slots - 1)
    return sum(k.nbytes + v.nbytes for k, v in kv), KEEP_PREFILL_SETS * prefill + decode_sets(slots) * decode


@dataclass(frozen=True)
class DeviceNeeds:
    """What a runner on a backend keeps in the device's memory with `slots` KV-cache slots, and its routed
    experts' bytes there: what `--gpu-tier auto` and `--parallel auto` size from (`device_needs`)."""

    slots: int
    kv: int  # the KV cache of every slot
    graphs: int  # the graph sets' buffers at most (`planned_bytes`)
    reserve: int  # the trunk, the KV cache and the graphs' buffers
    every: int  # every routed expert, as the device lays them out (`expert_bytes`)
    least: int  # the smallest GPU tier (`minimum_budget`)
    holds_all: bool  # the host expert cache holds every expert


def device_needs(
    spec: ModelSpec, experts: ExpertLayers, ctx_size: int, threads: int, slots: int, trunk_bytes: int
) -> DeviceNeeds | None:
    """A runner of `spec` on a backend with `slots` slots of `ctx_size` positions (`trunk_bytes`: the trunk's
    weights): what it keeps on the device (`DeviceNeeds`); None where the graphs cannot address the routed
    experts in slots (a tier cannot hold them: every expert on the device)."""
    moe = [x.index for x in spec.layers if x.router is not None]
    types, n = experts.graph_types(), experts.num_experts
    if not moe or any(types.get(layer) is None or types[layer].arena is None for layer in moe):
        return None
    kv, graphs = planned_bytes(spec, ctx_size, n, types[moe[0]].inter, threads, slots, DEVICE_CHUNK)
    every = expert_bytes(types, moe, spec.hidden, n)
    least = minimum_budget(types, moe, spec.hidden, n, spec.top_k)
    return DeviceNeeds(slots, kv, graphs, trunk_bytes + kv + graphs, every, least, experts.holds_all())


def _prefill(key: tuple) -> bool:
    """Whether a graph set's key (tokens, span, slots or a batch's row count) is a prefill shape (several
    tokens of one sequence)."""
    return key[0] > 1 and isinstance(key[2], tuple) and len(key[2]) == 1
