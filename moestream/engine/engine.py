"""`load` and `Engine`: a transformers model whose routed experts stream from disk."""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moestream.cache.expert_cache import ExpertCache
from moestream.engine.loop import ForwardStep, token_stream
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler, SamplingParams
from moestream.engine.stats import Counters, GenerationStats, PhaseStats
from moestream.errors import MoestreamError
from moestream.io.reader import Reader
from moestream.model.arch import arch_for, num_experts, text_config, top_k
from moestream.model.loader import build_model, router_modules, streaming_modules
from moestream.runtime.checks import check_experts
from moestream.runtime.experts import ExpertRuntime
from moestream.runtime.families import make_family
from moestream.runtime.formats import describe_formats
from moestream.runtime.streaming import ExpertStreaming, ReaderFactory
from moestream.store.source import open_source
from moestream.units import format_size


@dataclass
class Generation:
    """The result of one request."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    stats: GenerationStats
    finish_reason: str = "length"  # "length", "stop" (eos or a stop string) or "cancelled"
    done: bool = False  # set on the last object `Engine.stream` yields
    extra: dict[str, Any] = field(default_factory=dict)


def load(
    path: str,
    cache: int | str = "512MiB",
    device: str = "cpu",
    io_mode: str = "direct",
    io_threads: int = 4,
    piece: int | str = "128KiB",
    threads: int | None = None,
    make_reader: ReaderFactory | None = None,
    **extra: Any,
) -> Engine:
    """Load a HF MoE checkpoint (local directory or hub id) with its routed experts streamed from disk.

    Args:
        path: checkpoint directory (config.json, *.safetensors, tokenizer files) or hub id.
        cache: expert cache budget in bytes or as "512MiB"/"2GiB".
        device: "cpu".
        io_mode: "direct" (O_DIRECT), "pagecache" (buffered reads) or "mmap" (reads through a memory map).
        io_threads: dedicated I/O threads.
        piece: read size of one I/O, a multiple of 4 KiB.
        threads: torch compute threads (None: torch's default).
        make_reader: builds the reader from (io_mode, io_threads) (default `Reader`; tests inject others).
        extra: the other `EngineOptions` fields: `dtype` ("auto", "float32", "bfloat16", "float16"),
            `lock_memory` (mlock the cache), `policy` ("lru", "lfu"), `prefetch`, `gpu_cache`, `host_cache`,
            `unified`, `experts_per_token`, `gpu_floor`.

    Raises:
        MoestreamError: the checkpoint is missing, malformed or unsupported, or the budget is too small.
    """
    try:
        options = EngineOptions(
            cache=cache,
            device=device,
            io_mode=io_mode,
            io_threads=io_threads,
            piece=piece,
            threads=threads,
            **extra,
        )
    except ValueError as exc:
        raise MoestreamError(str(exc)) from None
    return Engine(path, options, make_reader=make_reader)


class Engine:
    """A loaded model: `generate` / `stream` text, `model` is the transformers model."""

    def __init__(
        self, path: str | Path, options: EngineOptions, make_reader: ReaderFactory | None = None
    ) -> None:
        self.options = options
        self._make_reader = make_reader or Reader
        if options.threads is not None:
            torch.set_num_threads(options.threads)
        self.source = open_source(path)
        self.path = self.source.path
        self.config = self.source.config()
        self.tokenizer = self.source.tokenizer()  # before the model: a broken tokenizer fails in a second
        self.arch = arch_for(self.config)
        self.model_top_k = top_k(self.config)
        if options.experts_per_token is not None:
            _override_top_k(self.config, options.experts_per_token)
        self.emap = self.source.expert_map(self.arch.family, num_experts(self.config))
        check_experts(self.emap, self.config)  # before the trunk is read: a bad expert fails at once
        dtype = "auto" if options.dtype == "auto" else getattr(torch, options.dtype)
        self.model = build_model(self.source, self.config, self.arch, dtype, self.emap)
        self.device = torch.device(options.device)
        if self.device.type == "cuda":
            self.model.to(self.device)  # every non-expert weight; StreamingExperts has none
        self._modules = streaming_modules(self.model)
        self.emap.restrict([layer for layer, _ in self._modules])
        self.top_k = top_k(self.config)
        self.family = make_family(self.config, self.emap, self.device, self.dtype)
        self.streaming = self._stream()
        self._step = ForwardStep(self.model)
        self.floor = self._make_floor()
        self.recorder: Any = None
        self._requests = 0

    @property
    def cache(self) -> ExpertCache:
        return self.streaming.cache

    @property
    def runtime(self) -> ExpertRuntime:
        return self.streaming.runtime

    @property
    def reader(self) -> Reader:
        return self.streaming.reader

    def start_trace(self, path: str | Path, predict: bool = True) -> None:
        """Record every layer's routing (and the stale-gate prediction) of the next requests to `path`."""
        from moestream.engine.tracing import TraceRecorder

        if self.recorder is not None:
            raise MoestreamError("a trace is already being recorded")
        self.recorder = TraceRecorder(self, path, predict=predict)

    def stop_trace(self) -> None:
        """Finish the trace file.

        Raises:
            TraceError: writing the trace failed (during the run or now); the message says what was kept.
        """
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            recorder.detach(self.runtime)
            recorder.close()

    def _stream(self) -> ExpertStreaming:
        """A fresh reader, cache, tier and runtime, bound to every StreamingExperts module."""
        streaming = ExpertStreaming(
            self.emap,
            self.family,
            self.options.stream_config(),
            top_k=self.top_k,
            device=self.device,
            make_reader=self._make_reader,
        )
        if self.options.prefetch:
            streaming.enable_lookahead(router_modules(self.model))
        streaming.bind(self._modules)
        return streaming

    def restream(self, **changes: Any) -> None:
        """Rebuild reader, cache and runtime with other `cache`, `io_mode`, `io_threads`, `piece`,
        `lock_memory`, `policy`, `prefetch` or the CUDA tiers, keeping the loaded model: side-by-side
        comparisons without reloading."""
        unknown = set(changes) - {
            "cache",
            "io_mode",
            "io_threads",
            "piece",
            "lock_memory",
            "gpu_cache",
            "host_cache",
            "prefetch",
            "policy",
        }
        if unknown:
            raise ValueError(f"restream cannot change {', '.join(sorted(unknown))}")
        try:
            options = EngineOptions(**{**vars(self.options), **changes})
        except ValueError as exc:
            raise MoestreamError(str(exc)) from None
        recorder = self.recorder
        if recorder is not None:
            recorder.detach(self.runtime)
        self.streaming.close()
        self.options = options
        self.streaming = self._stream()
        if recorder is not None:
            recorder.attach(self)

    def _make_floor(self) -> Any:
        from moestream.power.floor import make_engine_floor

        try:
            return make_engine_floor(
                self.options.gpu_floor,
                sysfs_root=self.options.sysfs_root,
                experts_off_gpu=self.options.device == "cpu",
            )
        except BaseException:
            self.streaming.close()
            raise

    # --- description -------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def mode_line(self) -> str:
        """What is being run, printed at the start of every run so nobody benchmarks the wrong thing."""
        return (
            f"moestream: {self.config.model_type} on {self.device} | {self.streaming.describe()} of "
            f"{len(self.emap.units)} experts ({format_size(self.emap.expert_bytes)}, "
            f"{describe_formats(self.runtime.formats)}) | "
            f"threads {torch.get_num_threads()} | dtype {str(self.dtype).removeprefix('torch.')} | "
            f"{self.floor.describe() if self.floor is not None else 'gpu floor off'}"
            + (
                f" | LOSSY: {self.top_k} experts per token instead of the model's {self.model_top_k}"
                if self.top_k != self.model_top_k
                else ""
            )
        )

    def counters(self) -> Counters:
        """Cumulative counters. A hit is an expert not read from disk (GPU tier or host cache)."""
        c = self.streaming.counters()
        return Counters(c.bytes_read, c.hits, c.misses, c.read_wait_s, c.prefetches, c.prefetch_used)

    # --- generation --------------------------------------------------------------------------

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Prompt text -> token ids (through the tokenizer's chat template when `chat`)."""
        if self.tokenizer is None:
            raise MoestreamError(f"{self.path} has no tokenizer; pass token ids instead of text")
        if chat:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tokenizer.encode(prompt, add_special_tokens=False)) or [self._bos_or_eos()]

    def _bos_or_eos(self) -> int:
        tok = self.tokenizer
        return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer else ""

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        **sampling: Any,
    ) -> Generation:
        """Generate a completion (greedy unless temperature > 0). Keyword args build SamplingParams."""
        result = None
        for result in self.stream(prompt, params, chat=chat, **sampling):
            pass
        return result

    def stream(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        cancelled: Callable[[], bool] | None = None,
        request_id: str | None = None,
        **sampling: Any,
    ) -> Iterator[Generation]:
        """Yields the growing `Generation` after every token; the last one is final."""
        try:
            params = params or SamplingParams(**sampling)
        except ValueError as exc:
            raise MoestreamError(str(exc)) from None
        ids = self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise MoestreamError("the prompt is empty")
        self._check_ids(ids)
        self._check_context(len(ids), params.max_tokens)
        self.reader.check_files()  # a checkpoint rewritten since load would silently change the output
        self._requests += 1
        yield from self._run(ids, params, cancelled or (lambda: False), request_id or f"req-{self._requests}")

    @property
    def context_length(self) -> int | None:
        """Positions the model was trained for (`max_position_embeddings`; None when the config has none)."""
        value = getattr(text_config(self.config), "max_position_embeddings", None)
        return int(value) if value else None

    def _check_ids(self, ids: list[Any]) -> None:
        """Token ids a caller passed must index the embedding (else an IndexError from deep in torch)."""
        vocab = self.model.get_input_embeddings().num_embeddings
        bad = next(
            (
                t
                for t in ids
                if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab
            ),
            None,
        )
        if bad is not None:
            raise MoestreamError(
                f"token id {bad!r} in the prompt is not a token of this model (0..{vocab - 1})"
            )

    def _check_context(self, prompt_n: int, max_tokens: int) -> None:
        """Positions past the trained context give text that looks like output but is not: refuse them."""
        context = self.context_length
        if context is None:
            return
        if prompt_n >= context:
            raise MoestreamError(
                f"the prompt has {prompt_n} tokens, more than the model's context of {context} tokens "
                f"leaves room for (at most {context - 1})"
            )
        if prompt_n + max_tokens > context:
            raise MoestreamError(
                f"max tokens {max_tokens} plus the prompt's {prompt_n} tokens exceeds the model's context "
                f"of {context} tokens (at most {context - prompt_n} here)"
            )

    def _run(
        self, ids: list[int], params: SamplingParams, cancelled: Callable[[], bool], request_id: str
    ) -> Iterator[Generation]:
        if self.floor is not None:
            self.floor.begin()
        try:
            yield from self._tokens(ids, params, cancelled, self._stepper(request_id))
        finally:
            if self.recorder is not None:
                self.recorder.flush()  # a process killed later loses none of this request's rows
            if self.floor is not None:
                self.floor.end()

    def _stepper(self, request_id: str) -> Callable[[list[int], Any], tuple[torch.Tensor, Any]]:
        """The forward step, telling the trace recorder (if any) what each forward covers."""
        if self.recorder is None:
            return self._step
        position = 0

        def step(ids: list[int], cache: Any) -> tuple[torch.Tensor, Any]:
            nonlocal position
            self.recorder.forward(request_id, "prefill" if cache is None else "decode", position)
            position += len(ids)
            return self._step(ids, cache)

        return step

    def _tokens(
        self,
        ids: list[int],
        params: SamplingParams,
        cancelled: Callable[[], bool],
        step: Callable[[list[int], Any], tuple[torch.Tensor, Any]],
    ) -> Iterator[Generation]:
        eos = _eos_ids(self.model, self.tokenizer)
        start, before = time.perf_counter(), self.counters()
        tokens: list[int] = []
        gen = Generation("", tokens, len(ids), GenerationStats(PhaseStats(), PhaseStats()))
        prefill_end, after_prefill = start, before
        for token, _ in token_stream(step, ids, Sampler(params), params.max_tokens):
            now = time.perf_counter()
            if not tokens:
                prefill_end, after_prefill = now, self.counters()
                gen.stats.prefill = after_prefill.since(before, len(ids), now - start)
            else:
                gen.stats.decode = self.counters().since(after_prefill, len(tokens), now - prefill_end)
            if token in eos and not params.ignore_eos:
                gen.finish_reason = "stop"
                break
            tokens.append(token)
            gen.text = self.decode(tokens)
            if _apply_stop(gen, params.stop):
                break
            if cancelled():
                gen.finish_reason = "cancelled"
                break
            yield gen
        gen.done = True
        gen.stats.gpu_floor = (
            "off" if self.floor is None else ("active" if self.floor.was_active else "inactive")
        )
        yield gen

    def close(self) -> None:
        """Finish the trace, stop the I/O threads, close the checkpoint files, restore the GPU clock floor."""
        try:
            self.stop_trace()
        finally:
            try:
                if self.floor is not None:
                    self.floor.close()
            finally:
                self.streaming.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _override_top_k(config: Any, k: int) -> None:
    """Route every token to `k` experts instead of the model's top-k (lossy; the routers read it at build)."""
    cfg = text_config(config)
    if k > num_experts(config):
        raise MoestreamError(
            f"--experts-per-token {k} exceeds the model's {num_experts(config)} routed experts"
        )
    cfg.num_experts_per_tok = k


def _apply_stop(gen: Generation, stops: list[str]) -> bool:
    cut = min((i for i in (gen.text.find(s) for s in stops if s) if i >= 0), default=-1)
    if cut < 0:
        return False
    gen.text, gen.finish_reason = gen.text[:cut], "stop"
    return True


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids = getattr(model.generation_config, "eos_token_id", None) or getattr(
        model.config, "eos_token_id", None
    )
    found = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        found.add(tokenizer.eos_token_id)
    return found
