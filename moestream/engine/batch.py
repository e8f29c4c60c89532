"""Several requests at once (`--parallel N`): their forwards batched, a round at a time.

Each request runs its own token loop (`engine/requests.py`) on a thread of its own, in a KV-cache slot
of the ggml runner it holds from its first forward to its end (`acquire`, `release`); its forward (`step`)
is handed to the `Batcher` and waits. When every request holding a slot has handed one over, the thread
whose forward completed the set runs a round for all, while the others sleep on an event of their own,
each woken once, when its forward is done (no polling; a request leaving wakes one waiter to lead):

- the single tokens (decoding) as one step of B rows (`GgmlRunner.decode`): each MoE layer acquires the
  union of their experts and computes each expert once over the rows routed to it (from 8 rows, a
  K-quant expert once for each group of at most 7 rows that routes to it, `ggml/tiled.py`);
- then the waiting prompts' next chunks, oldest first, as many as fit in one chunk's tokens (the runner's
  `chunk`; the oldest's always), each a forward of its own: prompts that arrive together are all fed
  before their streams decode (as llama-server feeds them in one batch), and a running stream never
  waits for more than one chunk's tokens of prefill a token;
- where the runner streams experts on the host (`lockstep`), the step and the chunks side by side, a
  layer at a time (`GgmlRunner.together`): each computes its bits alone, and the experts a layer reads
  for one are hits for the others (one after the other, the layers in between would evict them).

Requests join and leave at token boundaries: a new one joins the next round, one that ends (max tokens,
a stop, a cancel, an error) leaves it. Each computes what it computes alone: its prompt in the chunks
it has alone, each token decoded beside others with the bits it gets alone (`tests/test_batch.py`; from
8 rows, a K-quant matrix's products in groups of at most 7: `ggml/tiled.py`, tests/test_batch_tiled.py).
The slot's prompt cache is the slot's own (`PromptCache` per slot): a request takes the free slot whose
held tokens share the longest prefix with its prompt.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from moestream.engine.logits import DeviceLogits
from moestream.engine.prompt_cache import PromptCache, common_prefix
from moestream.errors import MoestreamError

Step = Callable[..., tuple[torch.Tensor, Any]]
T = TypeVar("T")


@dataclass
class _Call:
    """One request's forward, waiting for its round: `ids` after what `kv` (its slot) holds."""

    kv: Any
    ids: list[int]
    order: int  # arrival: the oldest prefill goes first
    request: str = ""  # its name in traces
    phase: str = "decode"  # "prefill": the request's prompt (traces)
    greedy: bool = False  # the request takes the argmax alone (`Sampler.plain`)
    fed: int = 0  # tokens of `ids` fed so far (a prefill takes several rounds)
    logits: torch.Tensor | DeviceLogits | None = None
    error: BaseException | None = None
    done: bool = False
    lead: bool = False  # its thread is to run the next round
    event: threading.Event = field(default_factory=threading.Event)  # set when done (or told to lead)


class Batcher:
    """The rounds of a runner with `len(runner.seqs)` KV-cache slots; one per engine (`Engine.batch`).
    `checked` wraps a round's forward as `ExpertStreaming.checked` wraps a request's (the checkpoint
    files checked once a round, for every request in it)."""

    def __init__(
        self,
        runner: Any,
        checked: Callable[[Step], Step] = lambda step: step,
        recorder: Callable[[], Any] = lambda: None,
    ) -> None:
        self.runner, self.checked = runner, checked
        self.recorder = recorder  # the trace recorder now (or None): told which request each row is
        self.slots = len(runner.seqs)
        self.caches = [PromptCache() for _ in range(self.slots)]  # one per slot
        self._lock = threading.Lock()
        self._free = list(range(self.slots))
        self._held: set[int] = set()
        self._calls: dict[int, _Call] = {}  # slot -> the forward it waits for
        self._leading = False  # a thread is running a round (or was told to)
        self._arrivals = 0
        self.rounds = 0  # rounds run (counted for /metrics, tests and benchmarks)
        self.decode_steps = 0  # decode steps run in them (one a round at most)
        self.decode_rows = 0  # tokens those steps decoded (rows / steps: the mean batch)
        self.together_rounds = 0  # rounds whose steps ran side by side (`runner.together`)

    @property
    def busy(self) -> int:
        """Slots held by requests."""
        with self._lock:
            return len(self._held)

    def acquire(self, ids: list[int]) -> int:
        """A free slot for a request of prompt `ids` (the one whose prompt cache shares the longest prefix).

        Raises:
            MoestreamError: every slot is held (the caller runs at most `slots` requests at once).
        """
        with self._lock:
            if not self._free:
                raise MoestreamError(
                    f"all {self.slots} slots are in use: at most {self.slots} requests run at once "
                    f"(--parallel {self.slots})"
                )
            slot = max(self._free, key=lambda s: (common_prefix(self.caches[s].held.ids, ids), -s))
            self._free.remove(slot)
            self._held.add(slot)
            return slot

    def release(self, slot: int) -> None:
        """The request in `slot` ended: the rounds no longer wait for it."""
        with self._lock:
            self._held.discard(slot)
            self._calls.pop(slot, None)
            self._free.append(slot)
            self._kick()

    def step(self, slot: int, request: str = "") -> Step:
        """The forward of the request in `slot` (named `request` in traces): (ids, its cache or None) ->
        (logits [V], its cache); its first forward is its prompt's. A round hands each request its logits
        as a tensor (a batch's decode step copies back [B, V]), but a greedy request decoding alone in its
        round, whose step is the one it runs alone (`GgmlRunner.forward`'s `greedy`: on a backend, the
        argmax copied back, `DeviceLogits`)."""
        kv = self.runner.seqs[slot]
        phase = ["prefill"]

        def forward(
            ids: list[int], cache: Any, greedy: bool = False
        ) -> tuple[torch.Tensor | DeviceLogits, Any]:
            if cache is None:  # a request from scratch in this slot
                kv.tokens = 0
            elif cache is not kv:
                raise RuntimeError("a request continues only its own slot's KV cache")
            out = self._wait(slot, _Call(kv, list(ids), 0, request, phase[0], greedy=greedy))
            phase[0] = "decode"
            return out

        return forward

    def _wait(self, slot: int, call: _Call) -> tuple[torch.Tensor | DeviceLogits, Any]:
        """Hand the forward over; run a round where it completes the batch (or this thread is told to);
        else sleep on the call's own event until its forward is done (each thread woken once a round)."""
        with self._lock:
            self._arrivals += 1
            call.order = self._arrivals
            self._calls[slot] = call
            lead = not self._leading and self._ready()
            self._leading = self._leading or lead
        while True:
            if lead:
                self._lead()
            call.event.wait()
            with self._lock:
                call.event.clear()
                lead, call.lead = call.lead, False
                if call.done and not lead:
                    break
        if call.error is not None:
            raise call.error
        return call.logits, call.kv

    def _ready(self) -> bool:
        """Every request holding a slot has handed its forward over."""
        return bool(self._held) and all(s in self._calls for s in self._held)

    def _kick(self) -> None:
        """(Holding the lock.) Where no round runs and every request waits: tell one of them to run one."""
        if self._leading or not self._ready():
            return
        call = next(iter(self._calls.values()))
        self._leading = call.lead = True
        call.event.set()

    def _lead(self) -> None:
        """Run a round over the calls handed over, then wake the threads whose forward it completed."""
        with self._lock:
            calls = dict(self._calls)
        try:
            self._round(list(calls.values()))
        finally:
            with self._lock:
                self._leading = False
                for s, c in calls.items():
                    if c.done:
                        if self._calls.get(s) is c:
                            del self._calls[s]
                        c.event.set()
                self._kick()  # a prefill goes on: its chunks run a round each, nobody else waiting

    @torch.inference_mode()
    def _round(self, calls: list[_Call]) -> None:
        """The decoding calls as one step, and the waiting prefills' next chunks that one chunk's tokens
        hold: side by side, a layer at a time, where the runner streams experts (`lockstep`); else the
        step first, then each chunk."""
        self.rounds += 1
        # in slot order: a device's step graphs are keyed by the slots it uses, in order (a set built once
        # serves every round of the same requests)
        decoding = sorted((c for c in calls if len(c.ids) == 1), key=lambda c: c.kv.slot)
        # the prefills' next chunks, oldest first, as many as one chunk's tokens hold (the oldest always):
        # prompts that arrive together are fed before their streams decode, not one a round between their
        # steps; each still in the chunks it has alone (a forward of its own, from its first token)
        budget, prefills = self.runner.chunk, []
        for c in sorted((c for c in calls if len(c.ids) > 1), key=lambda c: c.order):
            chunk = c.ids[c.fed : c.fed + self.runner.chunk]
            if len(chunk) > budget:  # never the oldest's (a chunk is at most the budget)
                continue  # not this round: a younger prompt's shorter chunk may still fit
            budget -= len(chunk)
            prefills.append((c, chunk))
        recorder = self.recorder()
        lockstep = getattr(self.runner, "lockstep", None)
        if len(prefills) + bool(decoding) > 1 and lockstep is not None and lockstep():
            self._together(decoding, prefills, recorder)
            return
        if decoding:
            self._decode(decoding, recorder)
        for c, chunk in prefills:
            if recorder is not None:
                recorder.forward(c.request, c.phase, c.kv.tokens)
            try:
                # no one reads a chunk's logits but the last's, and a greedy request its argmax alone
                greedy = c.greedy or c.fed + len(chunk) < len(c.ids)
                c.logits, _ = self.checked(self.runner)(chunk, c.kv, greedy=greedy)
                c.fed += len(chunk)
                c.done = c.fed == len(c.ids)
            except BaseException as exc:
                c.error, c.done = exc, True

    def _decode(self, decoding: list[_Call], recorder: Any) -> None:
        """The decoding calls' step of one row each."""
        step = self.checked(lambda seqs, _: (self.runner.decode(seqs), None))
        if recorder is not None:  # each row's request
            recorder.forward_rows([(c.request, c.kv.tokens, c.phase) for c in decoding])
        try:
            if len(decoding) == 1 and decoding[0].greedy:  # the step it runs alone, its argmax asked
                (c,) = decoding
                c.logits = self.checked(self.runner)(c.ids, c.kv, greedy=True)[0]
            else:
                logits = step([(c.kv, c.ids[0]) for c in decoding], None)[0]
                for c, row in zip(decoding, logits):
                    c.logits = row
            self.decode_steps += 1
            self.decode_rows += len(decoding)
        except BaseException as exc:  # each request raises it; the next round goes on without them
            for c in decoding:
                c.error = exc
        for c in decoding:
            c.done = True

    def _together(
        self, decoding: list[_Call], prefills: list[tuple[_Call, list[int]]], recorder: Any
    ) -> None:
        """The round's decode step and chunks side by side (`runner.together`: each computes its bits
        alone; the experts one reads for a layer are hits for the others); a trace told, before each
        step's layer, whose rows come (each step its own, as one after the other). An error ends every
        call of the round with it."""
        self.together_rounds += 1
        before = None
        if recorder is not None:
            contexts = []
            if decoding:
                recorder.forward_rows([(c.request, c.kv.tokens, c.phase) for c in decoding])
                contexts.append(recorder.context())
            for c, _ in prefills:
                recorder.forward(c.request, c.phase, c.kv.tokens)
                contexts.append(recorder.context())
            before = lambda i: recorder.resume(contexts[i])  # noqa: E731
        step = self.checked(
            lambda _ids, _cache: (
                self.runner.together(
                    [(c.kv, c.ids[0]) for c in decoding], [(chunk, c.kv) for c, chunk in prefills], before
                ),
                None,
            )
        )
        try:
            out = step([], None)[0]
        except BaseException as exc:  # each request raises it; the next round goes on without them
            for c in [*decoding, *(c for c, _ in prefills)]:
                c.error, c.done = exc, True
            return
        finally:  # the round's last step (its highest), whichever ran last: the next forward numbers on
            if recorder is not None:
                recorder.resume(contexts[-1])
        if decoding:
            for c, row in zip(decoding, out.pop(0)):
                c.logits, c.done = row, True
            self.decode_steps += 1
            self.decode_rows += len(decoding)
        for (c, chunk), logits in zip(prefills, out):
            c.logits = logits
            c.fed += len(chunk)
            c.done = c.fed == len(c.ids)


def run_all(jobs: Sequence[Callable[[], T]], workers: int) -> list[T]:
    """Each job on one of `workers` threads (each with the caller's torch thread count, which OpenMP
    keeps per thread); their results in order. A job that raised: the first such error, once every
    job has ended."""
    threads = torch.get_num_threads()

    def run(job: Callable[[], T]) -> T:
        torch.set_num_threads(threads)
        return job()

    if workers == 1:
        return [job() for job in jobs]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moestream-batch") as pool:
        futures = [pool.submit(run, job) for job in jobs]
        return [f.result() for f in futures]


def generate_all(engine: Any, prompts: Sequence[Any], params: Any = None, **options: Any) -> list[Any]:
    """`Engine.generate_batch`: each prompt's `Generation`, up to `engine.batch.slots` at once."""
    if isinstance(params, list) and len(params) != len(prompts):
        raise MoestreamError(f"{len(params)} sampling params were given for {len(prompts)} prompts")
    each = params if isinstance(params, list) else [params] * len(prompts)
    jobs = [lambda p=p, s=s: engine.generate(p, s, **options) for p, s in zip(prompts, each)]
    return run_all(jobs, engine.batch.slots if engine.batch is not None else 1)
