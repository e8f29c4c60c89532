"""The ggml runner's steps over a GPU tier (`--gpu-tier`): a graph a layer on the backend, each MoE layer's
routed experts placed in the tier's device slots between two graphs (`engine/gpu_tier.py`).

After a MoE layer's graph its routing comes back to the host (`b.order`, `b.weights`); the tier places
the layer's experts in slots by its policy, and the next graph (`fused`) computes them from the slots
(ids = slots, `b.slots`). A miss goes one of two ways (MOESTREAM_TIER_MISSES):

- "upload" (default): held in a host slot by the expert cache (`ExpertLayers.hold`: a hit pinned, a miss
  read from disk by the cache's reader) and copied into its device slot before that graph, each kind as
  its bytes land;
- "host": the CPU computes the misses' (token, k) pairs from the host cache into `b.outputs`: one ggml
  CPU graph a layer over the host size class's slots (`HostMisses`, as llama.cpp's --n-cpu-moe computes
  a layer's experts), or, where the host cache lacks a miss, the expert runtime (its schedule: a miss
  read from disk as its bytes land); the graph (`mixed`) takes each output from the device's slots or
  the host's outputs as `b.pick` says. A miss gets a device slot only as the tier's `FrequencyGate`
  allows (used more than twice as often as the expert it would evict): such a one is copied into its
  slot after the graph, for later tokens, from the host slot it was computed from (pinned until then;
  one the cache evicted meanwhile, the layer's misses being more than its slots, leaves the tier
  instead). Every miss admitted, as the way "upload" must, copied an expert a miss for nothing under
  routing close to uniform: 204 MiB a token on the H100 12-layer synthetic.

The host cache may hold fewer experts than the model has (`--cache`): the tier's misses that it lacks are
then read from disk, so the model may be bigger than the host and device tiers together. The two tiers
are then exclusive, so that they add up: an expert copied into the tier is the host cache's next victim
(`ResidentSet.demote`), and one the tier evicts is kept in the host cache as used now where it is still
there (a victim cache's rule; its bytes are not copied back). Without that, the host cache's most recent
experts are the tier's own, and a 2 GiB tier over a 5 GiB cache held little more than the cache alone
(190 MiB read a token of 408 on the H100's 24 x 128 synthetic).

A layer whose distinct experts outnumber its class's slots (a prefill chunk's union) is computed by the
expert runtime from the host cache, whichever the way. The residual stream and the experts' input stay on
the device between the graphs (`device_only`); the step's inputs are copied there once a step.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from moestream.cache.policy import EvictionPolicy, execution_order, uses_of
from moestream.cache.tiers import lent_slots
from moestream.engine.gpu_tier import ClassPlan, GpuTier, WayTrial, plan_tier
from moestream.engine.host_misses import HostMisses
from moestream.engine.stats import TierCounters
from moestream.engine.tier_ahead import ReadAhead, heard
from moestream.ggml.backend import DeviceMemory
from moestream.ggml.lib import GgmlUnavailableError
from moestream.graphs.graph_set import GraphSet
from moestream.graphs.layers import StepBuffers
from moestream.graphs.spec import ModelSpec
from moestream.runtime.expert_layers import ExpertLayers
from moestream.units import format_size

_NOTHING_AHEAD = ReadAhead(None, None)  # a layer whose routing nothing hears: no read-ahead (done)
# the step's buffers that the host writes before a step and every layer's graph reads
STEP_INPUTS = ("tokens", "positions", "rows", "mask", "window")
HostLayer = Callable[[int, int], None]  # (MoE layer, rows): its experts computed on the host into b.outputs


class TieredSteps:
    """The GPU tier of one runner and the steps over it (`step`); `types` for the graphs."""

    def __init__(
        self,
        memory: DeviceMemory,
        experts: ExpertLayers,
        spec: ModelSpec,
        budget: int,
        policy: Callable[[], EvictionPolicy],
        threads: int,
    ) -> None:
        """`threads`: the CPU's for the misses it computes (the way "host").

        Raises:
        GgmlUnavailableError: experts the graphs cannot compute from slots, or MOESTREAM_TIER_MISSES
            says neither way.
        CacheBudgetError: the tier cannot hold one token's routed experts of a layer.
        """
        self.memory, self.experts, self.spec, self.policy = memory, experts, spec, policy
        self.threads = threads
        self._host: tuple[int, HostMisses] | None = None  # (the streaming's generation, its CPU graphs)
        self.misses = tier_misses(True)  # "upload", "host", "split" or "auto" (a `WayTrial` chooses)
        self.trial = WayTrial() if self.misses == "auto" else None
        self.split = tier_split()  # the way "split"'s share of the misses copied (not under "auto")
        # the graphs take each output from the device or the host (the way "host", and "auto" for both)
        self.mixed = self.misses != "upload"
        # the residual stream and the experts' input stay on the device (the experts' input comes back
        # only for a layer computed on the host); the step's inputs go there once a step
        # (where the CPU computes the misses, the experts' input comes back with each layer's routing: a
        # copy of [T, H] floats instead of a second round trip for it)
        kept = ("resid0", "resid1") if self.mixed else ("resid0", "resid1", "moe_in")
        self.device_only = frozenset((*STEP_INPUTS, *kept))
        self._moe = [x.index for x in spec.layers if x.router is not None]
        self._moe_set = frozenset(self._moe)
        self._first: dict[int, int] | None = None  # a step's `resident_slots`
        self._host_hits = [0, 0]  # a step's misses read in place: (hits, layers)
        types = experts.graph_types()
        if any(types.get(layer) is None or types[layer].arena is None for layer in self._moe):
            raise GgmlUnavailableError(
                "--gpu-tier: the ggml graphs cannot compute this model's routed experts from slots "
                "(their format or activation), so no GPU tier can hold them"
            )
        n, k = experts.num_experts, spec.top_k
        self.plans: list[ClassPlan] = plan_tier(types, self._moe, spec.hidden, n, budget, k)
        self._tier: tuple[int, GpuTier] | None = None  # (the streaming whose host slots it copies from, it)
        # the host cache lacks room for every expert: the two tiers exclusive (each expert the tier copies
        # in is the host cache's next victim; each it evicts, kept there as used now where still held)
        self._exclusive = False
        # misses the CPU computed, copied after the next graph: (layer, expert -> device slot, -> host slot)
        self._deferred: list[tuple[int, dict[int, int], dict[int, int]]] = []
        self._closed = TierCounters()  # of the tiers dropped before (a restream)

    def describe(self) -> str:
        """The mode line's words for the experts: the slots, their bytes, the policy, the way of a miss."""
        slots = " + ".join(str(p.slots) for p in self.plans)
        nbytes = sum(p.slots * p.slot_bytes for p in self.plans)
        misses = {
            "host": "misses computed by the CPU from it, then copied",
            "upload": "misses copied before their graph",
            "split": f"misses {self.split:.0%} copied before their graph while the CPU computes the rest",
            "auto": "misses copied before their graph, computed by the CPU or both, as a trial of the first "
            f"{len(WayTrial.WAYS) * WayTrial().window} decoded tokens finds faster",
        }[self.misses]
        exclusive = ""
        if not self.experts.holds_all():
            exclusive = "; the host cache evicts first what the tier holds"
            if spare := self._spare(True):
                lent = " + ".join(str(lent_slots(p.slots, spare)) for p in self.plans)
                exclusive += f", {lent} slots lent to the misses the tier's gate keeps out"
        return (
            f"a graph a layer, the routed experts in a GPU tier of {slots} slots "
            f"({format_size(nbytes)}, {self.policy().name}) filled from the host cache, {misses}{exclusive}"
        )

    def tier(self) -> tuple[GpuTier, bool]:
        """(The GPU tier over the host cache's slots, whether it was made now: graphs over an older one
        are stale), made when first used and again when those slots move (a restream).

        Raises:
            GgmlUnavailableError: a routing replay is on (not yet with a GPU tier).
        """
        if self.experts.replaying():
            raise GgmlUnavailableError(
                f"a GPU tier on ggml's {self.memory.backend.kind} backend does not yet take a routing replay "
                "(--device cpu)"
            )
        key = self.experts.generation
        if self._tier is not None and self._tier[0] == key:
            return self._tier[1], False
        self.drop()
        for base, nbytes in self.experts.slot_regions():  # the host slots: copied from, never weights
            self.memory.forbid(base, nbytes, "the expert cache's slots")
            self.memory.pin_host(base, nbytes)
        self._exclusive = not self.experts.holds_all()
        spare = self._spare(self._exclusive)
        tier = GpuTier(
            self.memory, self.experts.graph_types(), self.plans, self.policy, self._exclusive, spare
        )
        self._tier = (key, tier)
        return tier, True

    def _spare(self, exclusive: bool) -> int:
        """The spare slots a class is asked for: top_k where the tiers are `exclusive` and misses are copied
        in (a miss copied is admitted as the gate allows, else lent a spare slot for its graph), else 0."""
        return self.spec.top_k if exclusive and self.misses in ("upload", "auto") else 0

    def way(self) -> str:
        """The next step's way of a miss: "upload", "host" or "split" (the trial's, under "auto")."""
        return self.trial.way() if self.trial is not None else self.misses

    def split_share(self) -> float:
        """The way "split": the share of a layer's misses (those the gate kept out) copied in while the
        CPU computes the others: the trial's (its two ways' step times), else MOESTREAM_TIER_SPLIT (0.5)."""
        return self.trial.share() if self.trial is not None else self.split

    def step(self, gs: GraphSet, host_layer: HostLayer) -> None:
        """One step of `gs` (its buffers filled) over the tier; `host_layer` computes a layer's experts on
        the host where its class has too few slots. With a trial on, a decode step's time is its way's."""
        if self.trial is None or self.trial.chosen is not None or gs.buf.tokens.numel() != 1:
            self._step(gs, host_layer)
            return
        way, start = self.trial.way(), time.perf_counter()
        self._step(gs, host_layer)
        self.trial.record(way, time.perf_counter() - start)

    def _step(self, gs: GraphSet, host_layer: HostLayer) -> None:
        b = gs.buf
        tier, _ = self.tier()
        graphs, fused = gs.layer_graphs()
        for name, t in b.tensors():
            if name in STEP_INPUTS:
                _, _, region = self.memory.translate(t.data_ptr(), t.nbytes)
                self.memory.upload(region, t.data_ptr() - region.host, t.nbytes)
        ready, hits, layers = False, 0, 0
        # once a step: the numpy views, the way (a trial changes it between steps), whether the routing is
        # heard (a trace, prefetch)
        order, slots, k, moe = b.order.numpy(), b.slots.numpy(), b.weights[0].shape[1], self._moe_set
        way, routing_heard = self.way(), self.experts.host_routing()
        # every expert in its host slot for good (expert e at first + e): the CPU's misses read them there
        # and the copies copy them from there, unpinned, as the CPU path's whole-step graph reads them;
        # their hits counted once a step
        self._first, self._host_hits = self.experts.resident_slots(), [0, 0]
        try:
            for i, net in enumerate(graphs):
                (fused[i] if ready else net).run()
                if self._deferred:  # misses the CPU computed: to their slots now, for the next tokens
                    self._flush(tier)
                ready = False
                if i not in moe:
                    continue
                n = gs.rows(i)
                rows = order[:n, :k].tolist()
                # gated: the CPU computes the misses the gate keeps out, or (exclusive tiers, `lend`) they
                # pass through spare slots, so that the tier's residents settle and the host cache
                # holds the others (admitting every miss, each copied in evicts another as likely used)
                lending = way == "upload" and self._exclusive and tier.lends(i)
                placed = tier.place(i, rows, way != "upload" or lending) if i + 1 in fused else None
                if placed is None:
                    self._fetch(b.moe_in[:n])
                    host_layer(i, n)
                    if self._exclusive:  # the host cache's uses made those the tier holds its own again
                        chunk = execution_order(rows)
                        missing = set(tier.missing(i, chunk))
                        self.experts.demote(i, [e for e in chunk if e not in missing])
                    continue
                slot, misses = placed
                group = set(rows[0]) if n == 1 else {e for row in rows for e in row}
                try:
                    # the routing heard where a trace or prefetch wants it (inside: a failure here must
                    # also take the placed misses out of the tier)
                    ahead = _NOTHING_AHEAD
                    if routing_heard:
                        self._fetch(b.moe_in[:n])
                        hidden, weights = b.moe_in[:n], b.weights[i % 2][:n]
                        ahead = heard(self.experts, tier, i, hidden, b.order[:n, :k], weights)
                    # copied in now: every miss ("upload"), none ("host": the CPU computes them), or a share
                    # of those the gate kept out ("split", given slots here); the gate's own admissions
                    # are copied after the graph, from where the CPU computed them
                    admitted = [e for e in misses if e in slot]
                    copied = misses if way == "upload" else []
                    if way == "split":
                        rest = [e for e in misses if e not in slot]
                        copied = split_copied(rest, rows, self.split_share())
                        slot.update(tier.admit(i, copied, list(group)))
                    lent: dict[int, int] = {}
                    if lending and len(slot) < len(group):  # the misses the gate kept out: lent slots
                        refused = [e for e in misses if e not in slot]
                        lent = tier.lend(i, refused) or {}
                        slot.update(lent or tier.admit(i, refused, list(group)))  # too many: admitted
                    slots[:n] = [row_slots(slot, row) for row in rows]
                    if self._exclusive:  # what the tier evicted, kept by the host cache before its reads
                        evicted = tier.take_evicted()
                        if evicted:
                            self.experts.keep(evicted)
                    # the CPU's share (none for "upload": the graph then picks every output the device's)
                    on_cpu = set(misses) - set(copied) if copied else set(misses)
                    if not copied and self.mixed:  # nothing to copy: the CPU's share alone
                        self._host_pairs(i, b, rows, on_cpu, ahead)
                    else:
                        cpu = None
                        if self.mixed:
                            cpu = functools.partial(self._host_pairs, i, b, rows, on_cpu, ahead)
                        self._upload(tier, i, rows, slot, copied, ahead, cpu)
                    if admitted:
                        self._defer(tier, i, slot, [e for e in admitted if e in on_cpu])
                    ahead()  # where none was read or computed (once per layer: the gate counts them)
                    if self._exclusive:  # what the tier now holds, the host cache's next victims
                        self.experts.demote(i, [e for e in copied if e not in lent])
                except BaseException:  # placed, never copied: they must miss again, not be read stale
                    tier.forget(i, misses)
                    raise
                ready = True
                hits, layers = hits + len(group) - len(misses), layers + 1
        finally:
            self._drop_deferred(tier)  # a step that raised: the misses it did not copy leave the tier
        # the device's hits (none read from disk); the misses were counted by the host cache's job, or
        # here where they were read from their slots in place
        self.experts.count_resident(hits + self._host_hits[0], layers + self._host_hits[1])

    def _upload(
        self,
        tier: GpuTier,
        layer: int,
        rows: list[list[int]],
        slot: dict[int, int],
        misses: list[int],
        ahead: ReadAhead,
        during: Callable[[], None] | None = None,
    ) -> None:
        """`misses` copied into their device slots from the host cache, which holds them for the copies
        (pinned) and reads those it lacks from disk: each kind copied as it lands, the gate while the up
        and down are still read. Before the graph that computes them (the copies on its stream).
        `ahead`: the next layer's read-ahead, once these reads are queued (by `during` where it computes
        the CPU's share, whose reads go first). `during`: run once every copy is issued, before waiting
        for them (the CPU's share of the layer)."""
        if not misses:
            if during is not None:
                during()
            return
        if self._first is not None:  # in their host slots for good: copied from there, nothing held
            base, kinds = self._first[layer], tuple(tier.types[layer].arena.address)
            for e in misses:
                tier.upload(layer, slot[e], kinds, base + e)
            self._host_hits[0] += len(misses)
            self._host_hits[1] += 1
            if during is not None:
                during()
            else:
                ahead()  # nothing of these to read
            return
        uses = uses_of(misses, rows)
        sync = self.memory.backend.synchronize
        with self.experts.hold(layer, misses, list(uses.values()), len(rows)) as held:
            if during is None:
                ahead()  # the reads of the misses the host cache lacks are queued: behind them
            left = dict.fromkeys(misses, sum(len(k) for k in held.kinds.values()))
            for e, kinds, source in held.landed():
                tier.upload(layer, slot[e], kinds, source)
                left[e] -= len(kinds)
                if not left[e] and held.waiting:  # a miss waits for a slot: this one's, once copied
                    sync()
                    held.release(e)
            if during is not None:  # while the stream copies
                during()
            sync()  # the host slots are given back: nothing may still copy out of them

    def _defer(self, tier: GpuTier, layer: int, slot: dict[int, int], misses: list[int]) -> None:
        """`misses`, which the schedule just computed from the host cache, copied into their device slots
        after the next graph (`_flush`), their host slots pinned until then."""
        if not misses:
            return
        sources = self.experts.pin_read(layer, misses)
        tier.forget(layer, [e for e in misses if e not in sources])
        if sources:
            self._deferred.append((layer, {e: slot[e] for e in sources}, sources))

    def _flush(self, tier: GpuTier) -> None:
        """Copy the deferred misses into their slots, then give their host slots back."""
        if not self._deferred:
            return
        for layer, slot, sources in self._deferred:
            kinds = tuple(tier.types[layer].arena.address)
            for e, source in sources.items():
                tier.upload(layer, slot[e], kinds, source)
        self.memory.backend.synchronize()  # the copies out of the host slots are done
        deferred, self._deferred = self._deferred, []
        for layer, _, sources in deferred:
            self.experts.unpin(layer, list(sources))
            if self._exclusive:
                self.experts.demote(layer, list(sources))

    def _drop_deferred(self, tier: GpuTier) -> None:
        """Deferred misses never copied: out of the tier, their host slots given back."""
        deferred, self._deferred = self._deferred, []
        for layer, _, sources in deferred:
            tier.forget(layer, list(sources))
            self.experts.unpin(layer, list(sources))

    def _host_pairs(
        self, layer: int, b: StepBuffers, rows: list[list[int]], misses: set[int], ahead: ReadAhead
    ) -> None:
        """The (token, k) outputs of `misses` computed on the CPU into `b.outputs`, and `b.pick` choosing
        them there and the device's slots elsewhere: by one ggml CPU graph over the host cache's slots
        (`HostMisses`) where the host cache holds every miss, else by the expert runtime (a miss there
        read from disk as the schedule reads one; `ahead` run once its reads are queued). In numpy on the
        step's buffers: a layer's few pairs cost microseconds, not torch's tens of them."""
        n, k = len(rows), len(rows[0])
        routed = [e for row in rows for e in row]  # [n * k], token-major
        index = [i for i, e in enumerate(routed) if e in misses]  # the misses' (token, k) positions
        pairs = np.array(index, dtype=np.int64)
        pick = np.arange(n * k, dtype=np.int32)
        if pairs.size:  # (the experts' input is on the host: it comes back with the routing, `mixed`)
            flat = b.outputs.numpy().reshape(-1, b.outputs.shape[2])
            experts = [routed[i] for i in index]
            if self._first is not None:  # in place for good: no pins
                base = self._first[layer]
                ahead()  # nothing of these to read
                slots = [base + e for e in experts]
                out = self._graphs().compute(layer, b.moe_in.numpy()[:n], pairs // k, slots, experts)
                flat[pairs] = out
                self._host_hits[0] += len(misses)
                self._host_hits[1] += 1
            elif (held := self._held(layer, rows, misses)) is not None:
                ahead()  # nothing of these to read
                try:
                    slots = [held[e] for e in experts]
                    out = self._graphs().compute(layer, b.moe_in.numpy()[:n], pairs // k, slots, experts)
                    flat[pairs] = out
                finally:
                    self.experts.unpin(layer, list(held))
            else:
                index = torch.from_numpy(pairs)
                hidden = b.moe_in[:n][index // k]  # [P, H]: each pair's token
                top = torch.tensor(experts).view(-1, 1)
                weights = b.weights[layer % 2][:n].reshape(-1)[index].view(-1, 1)
                done = self.experts.compute(layer, hidden, top, weights, ahead)  # heard: not again
                outputs = torch.cat([as_f32(done.outputs[e]) for e in done.routing.by_expert])
                flat[pairs[done.routing.tokens.numpy()]] = outputs.numpy()
            pick[pairs] += n * k
        ahead()  # (where there were no pairs: now)
        b.pick.numpy()[:n] = pick.reshape(n, k)

    def _held(self, layer: int, rows: list[list[int]], misses: set[int]) -> dict[int, int] | None:
        """`misses` pinned in their host slots (expert -> slot), or None where the host cache lacks one.
        A cache holding every expert evicts none and its policy has nothing to learn: the slots are
        pinned as a copy pins them (`pin_read`), its hits counted; else as a forward of the misses."""
        if self.experts.holds_all():
            held = self.experts.pin_read(layer, list(misses))
            if len(held) == len(misses):
                self.experts.count_resident(len(held), 1)
                return held
            self.experts.unpin(layer, list(held))
        return self.experts.pin(layer, [[e for e in row if e in misses] for row in rows], heard=True)

    def _graphs(self) -> HostMisses:
        """The CPU graphs of the misses over the host cache's slots (made again after a restream)."""
        key = self.experts.generation
        if self._host is None or self._host[0] != key:
            if self._host is not None:
                self._host[1].close()
            self._host = (key, HostMisses(self.experts.graph_types(), self.spec.hidden, self.threads))
        return self._host[1]

    def _fetch(self, t: torch.Tensor) -> None:
        """The device's bytes of `t` (a view at the start of a device-only buffer) into it (the way
        "host": there already, the graph copied them back)."""
        if self.mixed:
            return
        _, _, region = self.memory.translate(t.data_ptr(), t.nbytes)
        self.memory.download(region, t.data_ptr() - region.host, t.nbytes)
        self.memory.backend.synchronize()

    def counters(self) -> TierCounters:
        """Cumulative over every tier made; with the way of a miss now."""
        c = self._closed if self._tier is None else _added(self._closed, self._tier[1].counters)
        way = self.misses if self.trial is None else f"auto: {self.trial.describe()}"
        return dataclasses.replace(c, way=way)

    def drop(self) -> None:
        """Free the tier (the host slots it copies from are freed next, or moved): made again when used."""
        if self._tier is not None:
            self._closed = self.counters()
            self._tier[1].close()
            self._tier = None
        if self._host is not None:
            self._host[1].close()
            self._host = None


def split_copied(rest: list[int], rows: list[list[int]], share: float) -> list[int]:
    """The way "split": which of a layer's misses `rest` (those the gate kept out, in the order the tier
    placed them) are copied in, `share` of them. A copy costs the same whatever the expert's tokens, the
    CPU's product grows with them: in a step of several rows the most used are copied (ties in that
    order), so that the CPU keeps the fewest (token, expert) pairs; a decoded token's the first ones."""
    count = round(share * len(rest))
    if len(rows) == 1 or count in (0, len(rest)):
        return rest[:count]
    uses = uses_of(rest, rows)
    return sorted(rest, key=lambda e: -uses[e])[:count]  # (a stable sort: ties keep their order)


def row_slots(slot: dict[int, int], row: list[int]) -> list[int]:
    """A token's experts' device slots, in router order; an expert without one (a miss the gate kept out:
    its output on the device is not picked) gets a slot no other of the row has, so that the row's ids are
    distinct as a router's are (ggml's CUDA kernels for mul_mat_id may count on it; the lowest such slots,
    below the row's length, which every class has)."""
    out = [slot.get(e, -1) for e in row]
    if -1 in out:
        used, spare = set(out), 0
        for j, s in enumerate(out):
            if s == -1:
                while spare in used:
                    spare += 1
                out[j], spare = spare, spare + 1
    return out


def tier_split() -> float:
    """MOESTREAM_TIER_SPLIT: the way "split"'s share of a layer's misses copied in (0 to 1; default 0.5).

    Raises:
        GgmlUnavailableError: not a number from 0 to 1.
    """
    asked = os.environ.get("MOESTREAM_TIER_SPLIT", "").strip() or "0.5"
    try:
        share = float(asked)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise GgmlUnavailableError(f"MOESTREAM_TIER_SPLIT={asked!r}: say a share from 0 to 1")
    return share


def tier_misses(tier: bool) -> str:
    """MOESTREAM_TIER_MISSES: "upload" (default), "host" (see the module doc), "split" (a share of each
    layer's misses copied in while the CPU computes the rest) or "auto" (`WayTrial`).

    Raises:
        GgmlUnavailableError: another value, or set without a GPU tier (it would change nothing).
    """
    asked = os.environ.get("MOESTREAM_TIER_MISSES", "").strip()
    if asked and not tier:
        raise GgmlUnavailableError(f"MOESTREAM_TIER_MISSES={asked}: there is no GPU tier (--gpu-tier) here")
    if asked not in ("", "upload", "host", "split", "auto"):
        raise GgmlUnavailableError(f"MOESTREAM_TIER_MISSES={asked!r}: say upload, host, split or auto")
    if asked == "split":
        tier_split()  # a bad share refused at load
    return asked or "upload"


def _added(a: TierCounters, b: TierCounters) -> TierCounters:
    return TierCounters(
        a.hits + b.hits, a.misses + b.misses, a.bytes_uploaded + b.bytes_uploaded, a.lent + b.lent
    )


def as_f32(t: torch.Tensor) -> torch.Tensor:
    """`t` as contiguous float32 (itself when it is)."""
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()
