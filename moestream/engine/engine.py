"""`load` and `Engine`: a transformers model whose routed experts stream from disk.

The `Engine` keeps what requests need: the tokenizer, prompts and the context check, the prompt cache,
sampling, traces and routing replays, and the token loop (engine/requests.py). What the load took (the
model, the expert streaming, the runner, ...) is its `LoadedModel` (engine/loaded.py), `engine.loaded`;
the attributes many callers read are properties here."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from moestream.cache.expert_cache import ExpertCache
from moestream.engine.batch import Batcher, generate_all
from moestream.engine.chat import render_chat
from moestream.engine.grammar import Grammars
from moestream.engine.loaded import LoadedModel, context_length
from moestream.engine.options import EngineOptions
from moestream.engine.prompt_cache import PromptCache
from moestream.engine.prompts import check_context, prompt_ids
from moestream.engine.requests import Generation, eos_ids, run_request
from moestream.engine.runners import ModelRunner
from moestream.engine.sampling import SamplingParams, model_sampling_defaults
from moestream.engine.stats import Counters
from moestream.engine.tools import tool_session, with_grammar
from moestream.engine.unused import refuse_unused, warn_unused
from moestream.errors import MoestreamError
from moestream.io.reader import Reader
from moestream.model.arch import text_config
from moestream.runtime.experts import ExpertRuntime
from moestream.runtime.streaming import ExpertStreaming, ReaderFactory
from moestream.store.experts import ExpertMap
from moestream.store.source import CheckpointSource, open_source


def load(
    path: str,
    cache: int | str = "auto",
    device: str = "cpu",
    io_mode: str = "direct",
    io_threads: int | None = None,
    piece: int | str = "128KiB",
    threads: int | None = None,
    make_reader: ReaderFactory | None = None,
    **extra: Any,
) -> Engine:
    """Load a MoE checkpoint (HF directory, GGUF file, model by name), its routed experts streamed from disk.

    Args:
        path: checkpoint directory (config.json, *.safetensors, tokenizer files), GGUF file (the first
            part of a split GGUF) or a directory holding one, or a model by name, `REPO[:QUANT]` (as
            `-hf` takes it: downloaded into the HF cache first where it is not there, `store/hub.py`).
        cache: expert cache budget in bytes, as "512MiB"/"2GiB", or "auto" (the default): the largest
            cache the machine's memory leaves after the rest of the run, every expert when they all fit
            (`engine/auto_budget.py`; `mode_line()` says what was chosen and from which limit).
        device: "cpu" (the default), or "cuda" / "cuda:N": ggml's CUDA backend where it runs this model
            here, else the torch CUDA path, and the mode line says why (`engine/gpu_path.py`); there
            `cache` is the host expert cache (`host_cache` its synonym) and the GPU tier `gpu_tier`
            (`gpu_cache` its synonym, auto by default).
        io_mode: "direct" (O_DIRECT), "pagecache" (buffered reads) or "mmap" (reads through a memory map).
        io_threads: dedicated I/O threads (None: 4, or 8 on ggml's CUDA backend, `engine/options.py`).
        piece: read size of one I/O, a multiple of 4 KiB.
        threads: torch compute threads (None: torch's default).
        make_reader: builds the reader from (io_mode, io_threads) (default `Reader`; tests inject others).
        extra: the other `EngineOptions` fields: `dtype` ("auto", "float32", "bfloat16", "float16"),
            `lock_memory` (mlock the cache), `policy` ("lru", "lfu", "predictive"), `prefetch` ("off",
            "on", "auto"), `gpu_cache`, `host_cache`, `unified` (the torch CUDA path's tiers;
            on ggml's CUDA backend synonyms as above), `gpu_tier` (ggml's CUDA backend: bytes of device
            expert slots, or auto, filled from the host cache, which reads from disk what it lacks;
            `engine/gpu_tier.py`),
            `experts_per_token`, `gpu_floor`,
            `ctx_size` (tokens of prompt plus generation a request may use; default the smaller of the
            model's maximum and 8192), `preload` (default True: when the cache holds every expert, read
            them all at load; False: each on first use), `parallel` (requests decoded together, each
            in a KV-cache slot; default 1; "auto": 4, 2 or 1, chosen at load by the memory plan,
            `engine/auto_budget.py` `choose_parallel`, the mode line says why).

    Raises:
        MoestreamError: the checkpoint is missing, malformed or unsupported, the budget is too small, or
            an option cannot take effect here (a CUDA tier size on the CPU, say: `engine/unused.py`).
    """
    internal = sorted({"ggml_device", "gpu_path_why"} & set(extra))
    if internal:
        raise MoestreamError(f"{', '.join(internal)}: set at load by --device cuda, not given")
    given = {**extra, "cache": cache}
    where: str | Path | CheckpointSource = path
    if str(device).startswith("cuda"):  # ggml's CUDA backend, or the torch CUDA path where it cannot run
        from moestream.engine.gpu_path import resolve

        where = open_source(path)
        device, given, _ = resolve(where.config(), device, given)
    refuse_unused(device, given)
    try:
        options = EngineOptions(
            device=device,
            io_mode=io_mode,
            io_threads=io_threads,
            piece=piece,
            threads=threads,
            **given,
        )
    except ValueError as exc:
        raise MoestreamError(str(exc)) from None
    return Engine(where, options, make_reader=make_reader)


class Engine:
    """A loaded model: `generate` / `stream` text, `model` is the transformers model."""

    def __init__(
        self,
        path: str | Path | CheckpointSource,
        options: EngineOptions,
        make_reader: ReaderFactory | None = None,
    ) -> None:
        """`path`: what `open_source` opens, or the source already opened."""
        source = open_source(path) if isinstance(path, (str, Path)) else path
        config = source.config()
        self.path = source.path
        self.tokenizer = source.tokenizer()  # before the model: a broken tokenizer fails in a second
        self.loaded = LoadedModel(source, config, options, make_reader)
        try:
            self.prompt_cache = PromptCache()
            self.sampling_defaults = model_sampling_defaults(self.path)  # the model's own
            vocab = int(text_config(self.config).vocab_size)  # the grammars' view of the tokenizer
            self.grammars = Grammars(self.tokenizer, vocab, eos_ids(self.model, self.tokenizer))
            self.recorder: Any = None
            self.replay: Any = None  # a `RoutingReplay` (benchmark only), see `replay_routing`
            # several requests at once (--parallel N > 1): their forwards batched (engine/batch.py)
            self.batch = None
            if self.options.parallel > 1:  # each round's forward checks the files once (`checked`)
                self.batch = Batcher(
                    self.runner, lambda step: self.streaming.checked(step), lambda: self.recorder
                )
            self._requests = 0
            self._closed = False
            warn_unused(self.loaded)
        except BaseException:
            self.loaded.close()
            raise

    # --- what the load took (`LoadedModel`), read by many callers ---------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The transformers model (its routed experts `StreamingExperts` modules)."""
        return self.loaded.model

    @property
    def config(self) -> Any:
        return self.loaded.config

    @property
    def source(self) -> CheckpointSource:
        return self.loaded.source

    @property
    def options(self) -> EngineOptions:
        """The options in use (auto budgets sized, a lock refused turned off)."""
        return self.loaded.options

    @property
    def emap(self) -> ExpertMap:
        return self.loaded.emap

    @property
    def top_k(self) -> int:
        """Experts per token in use (the model's, or --experts-per-token)."""
        return self.loaded.top_k

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    @property
    def ctx_size(self) -> int:
        return self.loaded.ctx_size

    @property
    def dtype(self) -> torch.dtype:
        return self.loaded.dtype

    @property
    def runner(self) -> ModelRunner:
        return self.loaded.runner

    @property
    def floor(self) -> Any:
        return self.loaded.floor

    @property
    def streaming(self) -> ExpertStreaming:
        return self.loaded.streaming

    @property
    def cache(self) -> ExpertCache:
        return self.loaded.streaming.cache

    @property
    def runtime(self) -> ExpertRuntime:
        return self.loaded.streaming.runtime

    @property
    def reader(self) -> Reader:
        return self.loaded.streaming.reader

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

    def replay_routing(self, path: str | Path) -> list[Any]:
        """Benchmark only: take every layer's routing (and, with prefetch, the stale-gate guesses) from
        the trace at `path` instead of the model's routers; returns its requests (`ReplayRequest`: run
        each with `replay_requests`). The checkpoint must have the trace's MoE layers, experts and top-k."""
        from moestream.trace.reader import load_traces
        from moestream.trace.routing_replay import RoutingReplay

        if self.recorder is not None:
            raise MoestreamError("a trace is being recorded; routing cannot be replayed at the same time")
        if self.batch is not None:
            raise MoestreamError(
                "a routing replay runs one request at a time: load with parallel=1 (--parallel 1)"
            )
        replay = RoutingReplay(load_traces([path]), name=Path(path).name)
        replay.check(self.emap.layers, self.emap.num_experts, self.top_k)
        self.replay = replay
        self.runtime.replay = replay
        return replay.requests()

    def replay_requests(self, **sampling: Any) -> Iterator[Generation]:
        """Run every request of the replayed trace: its prompt length in (meaningless) token ids, then
        its decode forwards, EOS ignored, no prompt cache. Yields each request's final `Generation`."""
        if self.replay is None:
            raise MoestreamError("no routing is being replayed (call replay_routing first)")
        for request in self.replay.requests():
            ids = [0] * request.prompt_tokens  # any token: the routing is the trace's
            yield self.generate(
                ids,
                max_tokens=request.decode_tokens + 1,
                ignore_eos=True,
                request_id=request.name,
                **sampling,
            )

    def restream(self, **changes: Any) -> None:
        """Rebuild reader, cache and runtime with other `cache`, `io_mode`, `io_threads`, `piece`,
        `lock_memory`, `policy`, `prefetch`, `preload` or the CUDA tiers, keeping the loaded model:
        side-by-side comparisons without reloading (`LoadedModel.restream`; a trace being recorded goes
        on in the new setup)."""
        recorder = self.recorder
        if recorder is not None:
            recorder.detach(self.runtime)
        try:
            self.loaded.restream(**changes)
        finally:
            if recorder is not None and self.loaded.broken is None:
                recorder.attach(self)

    @property
    def notices(self) -> list[str]:
        """What was said once about the checkpoint files while the engine serves on: a file replaced on
        disk or removed since it was opened (the engine reads the file it opened; a restart loads the new
        one)."""
        return list(self.loaded.files.notices.values())

    @property
    def unavailable(self) -> str | None:
        """Why this engine cannot serve a request (closed, or left without a working streaming setup), or
        None when it can."""
        if self._closed:
            return "the engine is closed"
        return self.loaded.unavailable

    def check_usable(self) -> None:
        """Raises MoestreamError when the engine cannot serve (see `unavailable`)."""
        reason = self.unavailable
        if reason is not None:
            raise MoestreamError(reason)

    # --- description -------------------------------------------------------------------------

    def mode_line(self) -> str:
        """What is being run, printed at the start of every run so nobody benchmarks the wrong thing."""
        notes = []
        if self.replay is not None:
            name = self.replay.name
            notes.append(f"ROUTING REPLAYED from {name} (benchmark only: outputs are not the model's)")
        return self.loaded.describe(notes)

    def counters(self) -> Counters:
        """Cumulative counters. A hit is an expert not read from disk (GPU tier or host cache)."""
        return self.loaded.counters()

    # --- generation --------------------------------------------------------------------------

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Prompt text -> token ids (through the tokenizer's chat template when `chat`)."""
        if chat:
            return self.encode_messages([{"role": "user", "content": prompt}])
        if self.tokenizer is None:
            raise MoestreamError(f"{self.path} has no tokenizer; pass token ids instead of text")
        return list(self.tokenizer.encode(prompt, add_special_tokens=False)) or [self._bos_or_eos()]

    def encode_messages(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Chat messages (and tools) -> token ids through the chat template, the assistant turn opened."""
        return render_chat(self.tokenizer, messages, template_kwargs, tools)

    def _bos_or_eos(self) -> int:
        tok = self.tokenizer
        return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer else ""

    def generate(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        chat: bool = False,
        **options: Any,
    ) -> Generation:
        """Generate a completion (greedy unless temperature > 0). Takes what `stream` takes."""
        result = None
        for result in self.stream(prompt, params, messages=messages, chat=chat, **options):
            pass
        return result

    def stream(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        chat: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        cache_prompt: bool = False,
        keep_cache: bool | None = None,
        cancelled: Callable[[], bool] | None = None,
        request_id: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] = "auto",
        parallel_tool_calls: bool = True,
        **sampling: Any,
    ) -> Iterator[Generation]:
        """Yields the growing `Generation` after every token, its `piece` the new text; the last one is final.

        `prompt` is text or token ids; `messages` (chat messages) go through the chat template instead,
        as does a text prompt with `chat`. With `cache_prompt` the KV cache kept by the previous request
        is reused for the longest common prefix. This request's cache is kept for the next one when
        `keep_cache` (default: `cache_prompt`); at most one is held, and a request that reuses none frees
        the held one before it starts.
        Keyword args build SamplingParams (max_tokens, temperature, top_p, top_k, min_p, ..., stop,
        response_format / json_schema, logprobs).
        `tools` (OpenAI's shape) are rendered by the chat template and the calls the model writes are
        read into `Generation.tool_calls` (`text` is then the content beside them); `tool_choice` is
        "auto", "none", "required" or {"name": ...} (the last two hold the output to a call by a
        grammar), `parallel_tool_calls` False ends the answer after its first call.

        Raises:
            MoestreamError: bad sampling values, an empty prompt, or prompt + max_tokens beyond the context,
                a schema or tool that cannot be used.
        """
        self.check_usable()
        if params is not None and sampling:
            raise MoestreamError(
                f"give the sampling settings as params or as keywords ({', '.join(sorted(sampling))}), not "
                "both: the keywords would be ignored"
            )
        try:
            given, params = params is None, params or SamplingParams(**sampling)
        except (ValueError, TypeError) as exc:
            raise MoestreamError(str(exc)) from None
        if given and params.unused_when_greedy():
            warnings.warn(
                f"{', '.join(params.unused_when_greedy())} only shape sampling: greedy decoding "
                "(temperature 0) does not use them",
                stacklevel=2,
            )
        session = tool_session(self.tokenizer, tools, tool_choice, parallel_tool_calls)
        if session is not None and session.grammar is not None:
            params = with_grammar(params, session.grammar)
        ids = prompt_ids(self, prompt, messages, chat, chat_template_kwargs, tools if session else None)
        self.check_context(len(ids), params.max_tokens)
        self.streaming.check_files()  # a checkpoint rewritten since load would silently change the output
        if self.streaming.suspect:  # changed, then restored: slots may hold bytes read in between
            if self.batch is not None and self.batch.busy:  # the streaming is in use by the others
                raise MoestreamError(
                    "a checkpoint file changed under a running request: the expert cache is rebuilt once "
                    "the requests running now have ended; send this one again then"
                )
            self.restream()
        self._requests += 1
        slot = self.batch.acquire(ids) if self.batch is not None else None
        try:
            yield from run_request(
                self,
                ids,
                params,
                cancelled or (lambda: False),
                request_id or f"req-{self._requests}",
                cache_prompt,
                cache_prompt if keep_cache is None else keep_cache,
                session,
                slot,
            )
        finally:
            if slot is not None:
                self.batch.release(slot)

    def generate_batch(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        **options: Any,
    ) -> list[Generation]:
        """Generate a completion of each prompt, up to `--parallel` of them at once (their decode steps
        batched; one after another with parallel 1), each as `generate` gives it alone; `params`: one
        `SamplingParams` for all or one per prompt, `options`: `generate`'s keywords (`engine/batch.py`).

        Raises:
            MoestreamError: what `generate` raises for a prompt (once the others have ended).
        """
        return generate_all(self, prompts, params, **options)

    @property
    def context_length(self) -> int | None:
        """Positions the model was trained for (`max_position_embeddings`; None when the config has none)."""
        return context_length(self.config)

    def check_context(self, prompt_n: int, max_tokens: int) -> None:
        """Refuse a prompt and max_tokens that do not fit the context (`prompts.check_context`)."""
        check_context(prompt_n, max_tokens, self.ctx_size, self.context_length)

    def close(self) -> None:
        """Finish the trace, drop the prompt cache, then close what the load took (`LoadedModel.close`:
        the GPU clock floor restored, the I/O threads stopped, the checkpoint files closed, the expert
        cache and the trunk unlocked and the cache's memory freed at once)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.stop_trace()
        finally:
            try:
                self.prompt_cache.clear()
                for cache in self.batch.caches if self.batch is not None else []:
                    cache.clear()
            finally:
                self.loaded.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
