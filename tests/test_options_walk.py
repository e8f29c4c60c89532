"""No silent no-ops: every option of every verb (found by walking the real parser), every field of the
server's requests and every argument of the Python API either takes effect or is refused or warned about
with the reason. An option nobody classified below fails `test_every_option_is_classified`, naming it.

Each entry of `CLI` says how its option is observed on the CPU: an effect (the mode line, the output, the
stats, a file written, the value reaching the engine's options or a verb's configuration), a refusal
(exit 2 and the one-sentence error) or a warning (one `moestream: warning:` line). Runs are in-process
(`moestream.cli.main`), on the suite's tiny checkpoints, a few tokens each; where only the value's path
matters (options every engine verb shares, whose effects the generate walk observes), the engine is
replaced by one that records its options.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import io
import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import moestream
from moestream.cli import build_parser, main
from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError
from moestream.store.gguf_tokenizer import NEEDS, transformers_builds_gguf_tokenizers

PROMPT = ["-p", "Hello world"]
SMALL = "150KiB"  # 4 slots of the tiny model's 16 experts: evictions, misses, read-ahead
FULL = "1MiB"  # every expert cached
CUDA = torch.cuda.is_available()

# --- how a run is observed ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    rc: int
    out: str
    err: str

    @property
    def warnings(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith("moestream: warning:")]

    @property
    def json(self) -> Any:
        try:
            return json.loads(self.out)
        except json.JSONDecodeError:  # text before the JSON object (a mode line on stdout)
            return json.loads(self.out.strip().splitlines()[-1])

    @property
    def mode(self) -> str:
        lines = (self.err + self.out).splitlines()  # the mode line: "moestream: MODEL on DEVICE | ..."
        return next((line for line in lines if line.startswith("moestream: ") and " | " in line), "")


MEMO: dict[tuple[tuple[str, ...], str | None], Run] = {}


class Walk:
    """What every case needs: the checkpoints, a CLI runner and the verbs' stand-ins."""

    def __init__(self, capsys: Any, monkeypatch: Any, tmp: Path, models: dict[str, Path]) -> None:
        self.capsys, self.monkeypatch, self.tmp, self.m = capsys, monkeypatch, tmp, models
        self.last: Run | None = None  # the last run of `engine_options` or `chat_params`

    def cli(self, *argv: str, stdin: str | None = None, memo: bool = False) -> Run:
        """`moestream ARGV` in-process; with `memo`, a run of the same arguments is done once a module."""
        key = (tuple(str(a) for a in argv), stdin)
        if memo and key in MEMO:
            return MEMO[key]
        self.capsys.readouterr()
        if stdin is not None:
            self.monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        rc = main([str(a) for a in argv])
        out, err = self.capsys.readouterr()
        if memo:
            MEMO[key] = Run(rc, out, err)
        return Run(rc, out, err)

    def gen(self, *extra: str, cache: str = FULL, n: int = 4) -> Run:
        """generate on the tiny safetensors model: JSON out, `n` tokens past EOS."""
        argv = (
            "generate",
            self.m["st"],
            *PROMPT,
            "-n",
            n,
            "--ignore-eos",
            "--json",
            "--cache",
            cache,
            *extra,
        )
        return self.cli(*argv, memo="--trace" not in extra)

    def chat(self, *extra: str, turn: str = "Hello") -> Run:
        stdin = f"{turn}\n/stats\n/quit\n"
        return self.cli("chat", self.m["st"], "--cache", FULL, "-n", "4", *extra, stdin=stdin, memo=True)

    def engine_options(self, verb: str, *argv: str, path: list[Any] | None = None) -> EngineOptions | Run:
        """The EngineOptions `verb` builds from `argv` (the engine itself replaced), or the run that
        refused before that."""
        seen: list[EngineOptions] = []

        class Recorder:
            def __init__(self, path: Any, options: EngineOptions, make_reader: Any = None) -> None:
                seen.append(options)
                raise MoestreamError("walk: engine options recorded")

        self.monkeypatch.setattr("moestream.engine.engine.Engine", Recorder)
        base = {"perplexity": ["--text", self.m["text"]], "serve": ["--port", "0"]}.get(verb, [])
        run = self.last = self.cli(verb, *(path or [self.m["st"]]), *base, "--cache", FULL, *argv, stdin="")
        self.monkeypatch.undo()
        return seen[0] if seen else run

    def bench_config(self, *argv: str) -> Any:
        """The BenchConfig `moestream bench` builds (nothing is run)."""
        seen: list[Any] = []

        def record(config: Any) -> Any:
            seen.append(config)
            raise MoestreamError("walk: bench config recorded")

        self.monkeypatch.setattr("moestream.bench.harness.run_bench", record)
        run = self.cli("bench", "--out", self.tmp / "bench", *argv)
        self.monkeypatch.undo()
        return seen[0] if seen else run

    def synth_kwargs(self, *argv: str) -> tuple[dict[str, Any], Run]:
        """What `moestream synth` passes to `synthesize` (nothing is written), and the run's output."""
        seen: list[dict[str, Any]] = []

        def record(out: Any, **kwargs: Any) -> Any:
            seen.append({"out": out, **kwargs})
            raise MoestreamError("walk: synth arguments recorded")

        self.monkeypatch.setattr("moestream.synth.build.synthesize", record)
        run = self.cli("synth", *argv)
        self.monkeypatch.undo()
        return (seen[0] if seen else {}), run

    def served(self, *argv: str, path: list[str] | None = None) -> dict[str, Any]:
        """`moestream serve` up to the point where it would run uvicorn: its options, uvicorn's config,
        the engine's mode line and trace recorder."""
        seen: dict[str, Any] = {}

        def record(server: Any, sock: Any) -> None:
            state = server.config.app.state.server
            seen.update(
                options=state.options,
                config=server.config,
                address=sock.getsockname(),
                mode=state.engine.mode_line(),
                recorder=state.engine.recorder,
                log_level=logging.getLogger("moestream").level,
            )

        self.monkeypatch.setattr("moestream.cli.serve._run_until_stopped", record)
        loggers = {
            name: (logging.getLogger(name).handlers[:], logging.getLogger(name).level)
            for name in ("moestream", "uvicorn")
        }
        try:
            run = self.cli("serve", *(path or [self.m["st"]]), "--port", "0", "--cache", FULL, *argv)
        finally:
            for name, (handlers, level) in loggers.items():
                logging.getLogger(name).handlers[:] = handlers
                logging.getLogger(name).setLevel(level)
            self.monkeypatch.undo()
        assert run.rc == 0, run.err
        return {**seen, "run": run}


# --- the kinds of observation ---------------------------------------------------------------------


def refused(run: Run, text: str) -> None:
    assert run.rc == 2, (run.rc, run.err[-600:])
    error = [line for line in run.err.splitlines() if line.startswith("moestream: error:")]
    assert error and text in error[-1], run.err[-600:]


def warned(run: Run, text: str) -> None:
    found = [w for w in run.warnings if text in w]
    assert len(found) == 1, (text, run.warnings, run.err[-600:])


def ok(run: Run) -> Run:
    assert run.rc == 0, run.err[-800:]
    return run


def tokens(run: Run) -> list[int]:
    return ok(run).json["tokens"]


def reaches(w: Walk, verb: str, argv: list[str], **fields: Any) -> None:
    options = w.engine_options(verb, *argv)
    assert isinstance(options, EngineOptions), options.err[-600:]
    for name, value in fields.items():
        assert getattr(options, name) == value, (name, getattr(options, name), value)


def refused_before_engine(w: Walk, verb: str, argv: list[str], text: str) -> None:
    run = w.engine_options(verb, *argv)
    assert isinstance(run, Run), f"{verb} {argv} reached the engine: {run}"
    refused(run, text)


# --- the engine options every engine verb shares ---------------------------------------------------

HOT = ["--temperature", "2", "--seed", "1"]
# one run changes every option the mode line shows (each entry checks its own part), and one run with
# every expert cached gives each harmless no-op its warning
MODE_RUN = [
    *("--io-mode", "pagecache", "--io-threads", "2", "--piece", "64KiB", "-t", "2", "--dtype", "bfloat16"),
    *("--no-mlock", "--experts-per-token", "1", "-c", "64", "--policy", "lfu", "--prefetch"),
    *("--trunk", "static", "--gpu-floor", "off", "--no-preload"),
]  # fmt: skip
WARN_RUN = [*("--policy", "lfu", "--prefetch", "--trunk-dtype", "bfloat16", "--seed", "1", "--top-k", "3")]


def greedy(w: Walk) -> list[int]:
    return tokens(w.gen(n=8))


def mode_run(w: Walk) -> str:
    return ok(w.gen(*MODE_RUN, cache=SMALL)).mode


def warn_run(w: Walk) -> Run:
    return ok(w.gen(*WARN_RUN, "--no-trace-predict", "--chat-template", w.m["template"]))


def _in_mode(pattern: str) -> Callable[[Walk], None]:
    def check(w: Walk) -> None:
        assert re.search(pattern, mode_run(w)), (pattern, mode_run(w))

    return check


def _warns(text: str) -> Callable[[Walk], None]:
    return lambda w: warned(warn_run(w), text)


def both(*checks: Callable[[Walk], None]) -> Callable[[Walk], None]:
    def check(w: Walk) -> None:
        for one in checks:
            one(w)

    return check


def _sampled_differs(*flags: str) -> Callable[[Walk], None]:
    return lambda w: assert_differ(tokens(w.gen(*flags, n=8)), greedy(w))


def _sampled_to_greedy(*flags: str) -> Callable[[Walk], None]:
    """With a hot temperature, `flags` leave only the most likely token: greedy's tokens."""
    return lambda w: assert_equal(tokens(w.gen(*HOT, *flags, n=8)), greedy(w))


def _seed(w: Walk) -> None:
    hot = ("--temperature", "2")
    one = tokens(w.gen(*hot, "--seed", "1", n=8))
    argv = ("generate", w.m["st"], *PROMPT, "-n", "8", "--ignore-eos", "--json", "--cache", FULL, *hot)
    again = tokens(w.cli(*argv, "--seed", "1"))  # not the memo: a second run
    assert one == again != tokens(w.gen(*hot, "--seed", "2", n=8))


def _ignore_eos(w: Walk) -> None:
    # a copy of the model whose end-of-text token is the first one greedy picks
    eos = ("generate", w.m["eos"], *PROMPT, "-n", "4", "--json", "--cache", FULL)
    run = ok(w.cli(*eos))
    assert run.json["finish_reason"] == "stop" and run.json["tokens"] == []
    run = ok(w.cli(*eos, "--ignore-eos"))
    assert run.json["finish_reason"] == "length" and run.json["tokens"][0] == greedy(w)[0]


def _device(w: Walk) -> None:
    if CUDA:
        assert " on cuda" in ok(w.gen("--device", "cuda")).mode
    else:
        refused(w.gen("--device", "cuda"), "sees no CUDA device")


def _cuda_tier(*flags: str) -> Callable[[Walk], None]:
    return lambda w: refused(w.gen(*flags), "to the CUDA tiers (--device cuda) only")


def _trunk(w: Walk) -> None:
    assert "trunk eager (dynamic KV cache)" in ok(w.gen("--trunk", "eager")).mode
    assert "trunk ggml graphs" in ok(w.gen()).mode  # auto's choice on the CPU
    assert "trunk static KV cache" in mode_run(w)
    if not CUDA:
        refused(w.gen("--trunk", "graphs"), "--trunk graphs needs a CUDA device")
        refused(w.gen("--trunk", "layer-graphs"), "--trunk layer-graphs needs a CUDA device")


def _trunk_dtype(w: Walk) -> None:
    if w.m["q8"] is None:
        pytest.skip(NEEDS)
    q8 = ["generate", w.m["q8"], *PROMPT, "-n", "2", "--json", "--cache", FULL]
    assert "in GGUF block types" in ok(w.cli(*q8)).mode
    dequantized = ok(w.cli(*q8, "--trunk-dtype", "float32"))
    assert "in GGUF block types" not in dequantized.mode and not dequantized.warnings
    warned(warn_run(w), "nothing to dequantize")  # a safetensors trunk
    refused(w.gen("--trunk-dtype", "bfloat16", "--dtype", "float32"), "disagree")


ENGINE_GENERATE: dict[str, Callable[[Walk], None]] = {
    "--cache": lambda w: assert_equal("cache 150.0 KiB = 4 slots" in mode_run(w), True),
    "--device": _device,
    "--gpu-cache": _cuda_tier("--gpu-cache", "8MiB"),
    "--host-cache": _cuda_tier("--host-cache", "8MiB"),
    "--unified": _cuda_tier("--unified"),
    # ggml's CUDA backend only (the CPU backend's runs: tests/test_gpu_tier.py)
    "--gpu-tier": lambda w: refused(w.gen("--gpu-tier", "1MiB"), "run with --device cuda"),
    "--io-mode": _in_mode(r"io pagecache"),
    "--io-threads": _in_mode(r"2 io threads"),
    "--piece": _in_mode(r"64 KiB pieces"),
    "--threads": _in_mode(r"threads 2 "),
    "--dtype": _in_mode(r"dtype bfloat16"),
    "--trunk-dtype": _trunk_dtype,
    "--trunk": _trunk,
    "--policy": both(_in_mode(r"LFU eviction"), _warns("--policy lfu: the expert cache holds all")),
    "--no-mlock": _in_mode(r"\(unlocked\)"),
    "--no-preload": both(
        lambda w: assert_equal(
            ("read at load" in ok(w.gen()).mode, "read at load" in ok(w.gen("--no-preload")).mode),
            (True, False),
        ),
        lambda w: warned(ok(w.gen(*MODE_RUN, cache=SMALL)), "--no-preload: the expert cache holds 4 of 16"),
    ),
    "--prefetch": both(_in_mode(r"next-layer prefetch"), _warns("nothing left to read ahead")),
    "--experts-per-token": both(
        _in_mode(r"LOSSY: 1 experts per token"),
        lambda w: warned(w.gen("--experts-per-token", "2"), "is the model's own top-k"),
    ),
    "--gpu-floor": both(
        _in_mode(r"gpu floor off"),
        lambda w: refused(w.gen("--gpu-floor", "900"), "needs a Jetson GPU devfreq"),
    ),
}

# the same options through chat, serve and perplexity: the value reaches EngineOptions (or is refused
# before the engine, as generate's are); their effects are generate's
REACH: dict[str, tuple[list[str], dict[str, Any]]] = {
    "--cache": (["--cache", SMALL], {"cache": 150 << 10}),
    "--gpu-tier": (["--gpu-tier", "1MiB"], {"gpu_tier": 1 << 20}),
    "--io-mode": (["--io-mode", "mmap"], {"io_mode": "mmap"}),
    "--io-threads": (["--io-threads", "3"], {"io_threads": 3}),
    "--piece": (["--piece", "64KiB"], {"piece": 64 << 10}),
    "--threads": (["-t", "2"], {"threads": 2}),
    "--dtype": (["--dtype", "bfloat16"], {"dtype": "bfloat16"}),
    "--trunk-dtype": (["--trunk-dtype", "float32"], {"trunk_dtype": "float32"}),
    "--trunk": (["--trunk", "static"], {"trunk": "static"}),
    "--policy": (["--policy", "predictive"], {"policy": "predictive"}),
    "--no-mlock": (["--no-mlock"], {"lock_memory": False}),
    "--no-preload": (["--no-preload"], {"preload": False}),
    "--prefetch": (["--prefetch", "auto"], {"prefetch": "auto"}),
    "--experts-per-token": (["--experts-per-token", "1"], {"experts_per_token": 1}),
    "--gpu-floor": (["--gpu-floor", "off"], {"gpu_floor": "off"}),
    "--ctx-size": (["-c", "64"], {"ctx_size": 64}),
}
REFUSE: dict[str, tuple[list[str], str]] = {
    "--gpu-cache": (["--gpu-cache", "8MiB"], "CUDA tiers"),
    "--host-cache": (["--host-cache", "8MiB"], "CUDA tiers"),
    "--unified": (["--unified"], "CUDA tiers"),
    "--device": (["--device", "cuda"], "sees no CUDA device"),
}


def _engine_reach(verb: str, option: str) -> Callable[[Walk], None]:
    def check(w: Walk) -> None:
        if option in REFUSE and not (option == "--device" and CUDA):
            argv, text = REFUSE[option]
            refused_before_engine(w, verb, argv, text)
            return
        argv, fields = REACH[option] if option != "--device" else (["--device", "cuda"], {"device": "cuda"})
        if verb == "perplexity" and option == "--experts-per-token":  # lossy: only with --allow-lossy
            refused_before_engine(w, verb, argv, "add --allow-lossy")
            argv = [*argv, "--allow-lossy"]
        if verb == "perplexity" and option == "--trunk":  # perplexity runs transformers' forward
            run = w.engine_options(verb, "--trunk", "ggml")
            assert isinstance(run, EngineOptions) and run.trunk == "eager"
            warned(w.last, "--trunk ggml: perplexity scores every position")
            return
        if option == "--device":  # the torch CUDA path's device (ggml's CUDA backend's: test_gpu_path.py)
            w.monkeypatch.setattr("moestream.ggml.backend.cuda_unavailable", lambda device=0: "the walk's")
        reaches(w, verb, argv, **fields)

    return check


# --- generate's own options -----------------------------------------------------------------------


def _trace(w: Walk) -> None:
    from moestream.trace.reader import load_traces

    trace = load_traces([w.m["trace"]])
    assert trace.has_predictions and len(trace)


def _no_trace_predict(w: Walk) -> None:
    from moestream.trace.reader import load_traces

    warned(warn_run(w), "no --trace was given")
    out = w.tmp / "plain.parquet"
    ok(w.gen("--trace", out, "--no-trace-predict"))
    assert not load_traces([out]).has_predictions


def _replay(w: Walk) -> None:
    run = ok(w.cli("generate", w.m["st"], "--replay-routing", w.m["trace"], "--cache", SMALL, "--json"))
    assert "ROUTING REPLAYED" in run.mode and run.json["requests"] == 1
    refused(
        w.cli("generate", w.m["st"], "--replay-routing", w.m["trace"], *PROMPT),
        "--prompt would change nothing",
    )


def _chat_template(w: Walk) -> None:
    plain = ok(w.gen("--chat")).json["prompt_tokens"]
    assert ok(w.gen("--chat", "--chat-template", w.m["template"])).json["prompt_tokens"] != plain
    warned(warn_run(w), "--chat-template is used with --chat only")


def _json(w: Walk) -> None:
    assert set(ok(w.gen()).json) >= {"text", "tokens", "stats", "mode"}
    plain = ok(w.cli("generate", w.m["st"], *PROMPT, "-n", "2", "--cache", FULL))
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.out)


def _hf(w: Walk) -> None:
    asked: list[str] = []

    def fetch(spec: str) -> Path:
        asked.append(spec)
        return Path(w.m["st"])

    w.monkeypatch.setattr("moestream.store.hub.fetch", fetch)
    run = w.cli("generate", "-hf", "tiny/moe:Q8_0", *PROMPT, "-n", "2", "--cache", FULL)
    w.monkeypatch.undo()
    assert ok(run) and asked == ["tiny/moe:Q8_0"]


GENERATE: dict[str, Callable[[Walk], None]] = {
    "path": lambda w: ok(w.gen()),
    "--model": lambda w: ok(w.cli("generate", "-m", w.m["st"], *PROMPT, "-n", "2", "--cache", FULL)),
    "--hf-repo": _hf,
    "--prompt": lambda w: assert_differ(
        ok(w.gen()).json["prompt_tokens"], ok(w.gen("-p", "Hi")).json["prompt_tokens"]
    ),
    "--chat": lambda w: assert_differ(
        ok(w.gen()).json["prompt_tokens"], ok(w.gen("--chat")).json["prompt_tokens"]
    ),
    "--max-tokens": lambda w: assert_equal(len(tokens(w.gen(n=3))), 3),
    "--temperature": _sampled_differs(*HOT),
    "--top-p": _sampled_to_greedy("--top-p", "1e-9"),
    "--top-k": both(_sampled_to_greedy("--top-k", "1"), _warns("--top-k, --seed only shape sampling")),
    "--min-p": _sampled_to_greedy("--min-p", "1"),
    "--repetition-penalty": _sampled_differs("--repeat-penalty", "1.8"),
    "--presence-penalty": _sampled_differs("--presence-penalty", "2"),
    "--frequency-penalty": _sampled_differs("--frequency-penalty", "2"),
    "--seed": both(_seed, _warns("--top-k, --seed only shape sampling")),
    "--ignore-eos": _ignore_eos,
    "--json": _json,
    "--json-schema": lambda w: assert_equal(
        sorted(json.loads(_schema_run(w, "-j", DIGITS_JSON).json["text"])), ["a"]
    ),
    "--json-schema-file": lambda w: assert_equal(
        sorted(json.loads(_schema_run(w, "-jf", _schema_file(w)).json["text"])), ["a"]
    ),
    "--logprobs": lambda w: assert_equal(len(ok(w.gen("--logprobs", "2")).json["logprobs"]), 4),
    "--replay-routing": _replay,
    "--ctx-size": _in_mode(r"context 64 tokens"),
    "--chat-template": _chat_template,
    "--trace": _trace,
    "--no-trace-predict": _no_trace_predict,
    **ENGINE_GENERATE,
}


DIGITS_JSON = json.dumps(
    {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    }
)


def _schema_run(w: Walk, *argv: str) -> Run:
    """generate held to a JSON schema (no --ignore-eos: the grammar ends the output)."""
    return ok(w.cli("generate", w.m["st"], *PROMPT, "-n", "60", "--json", "--cache", FULL, *argv))


def _schema_file(w: Walk) -> str:
    path = w.tmp / "schema.json"
    path.write_text(DIGITS_JSON)
    return str(path)


def _tools_file(w: Walk) -> str:
    path = w.tmp / "tools.json"
    path.write_text(json.dumps([{"type": "function", "function": {"name": "f", "description": "d"}}]))
    return str(path)


def _refused_run(run: Run, text: str) -> None:
    assert run.rc != 0 and text in run.err, run.err[-500:]


def assert_differ(a: Any, b: Any) -> None:
    assert a != b


def assert_equal(a: Any, b: Any) -> None:
    assert a == b, (a, b)


# --- chat -----------------------------------------------------------------------------------------


def _answer(run: Run) -> tuple[str, int, int]:
    """(answer text, prompt tokens, answer tokens) of a one-turn chat."""
    ok(run)
    stats = re.search(r"prompt (\d+) tok .*\| answer (\d+) tok", run.out)
    assert stats, run.out
    text = run.out.split(">>> ", 2)[1].split("\n")[0]
    return text, int(stats[1]), int(stats[2])


def chat_params(w: Walk, *argv: str) -> Any:
    """The SamplingParams chat hands to every turn's `engine.stream` (before any model loads); their
    effects are generate's."""
    from moestream.cli import _sampling_args

    seen: list[Any] = []

    def record(args: Any, **override: Any) -> Any:
        seen.append(_sampling_args.sampling_params(args, **override))
        raise MoestreamError("walk: sampling recorded")

    w.monkeypatch.setattr("moestream.cli.chat.sampling_params", record)
    w.last = w.cli("chat", w.m["st"], *argv, stdin="")
    w.monkeypatch.undo()
    assert seen, w.last.err
    return seen[0]


def _chat_sampling(argv: list[str], **fields: Any) -> Callable[[Walk], None]:
    def check(w: Walk) -> None:
        params = chat_params(w, *argv)
        for name, value in fields.items():
            assert getattr(params, name) == value, (name, getattr(params, name), value)

    return check


CHAT: dict[str, Callable[[Walk], None]] = {
    "path": lambda w: ok(w.chat()),
    "--model": lambda w: ok(w.cli("chat", "-m", w.m["st"], "--cache", FULL, stdin="/quit\n")),
    "--hf-repo": lambda w: _hf_verb(w, "chat"),
    "--system": lambda w: assert_differ(_answer(w.chat("--system", "Be terse."))[1], _answer(w.chat())[1]),
    "--max-tokens": lambda w: assert_equal(_answer(w.chat("--ignore-eos", "-n", "3"))[2], 3),
    "--temperature": _chat_sampling(["--temperature", "0.7"], temperature=0.7),
    "--top-p": _chat_sampling(["--temperature", "1", "--top-p", "0.5"], top_p=0.5),
    "--top-k": _chat_sampling(["--temperature", "1", "--top-k", "5"], top_k=5),
    "--min-p": _chat_sampling(["--temperature", "1", "--min-p", "0.2"], min_p=0.2),
    "--repetition-penalty": _chat_sampling(["--repeat-penalty", "1.3"], repetition_penalty=1.3),
    "--presence-penalty": _chat_sampling(["--presence-penalty", "0.5"], presence_penalty=0.5),
    "--frequency-penalty": _chat_sampling(["--frequency-penalty", "0.5"], frequency_penalty=0.5),
    "--seed": _chat_sampling(["--temperature", "1", "--seed", "9"], seed=9),
    "--ignore-eos": _chat_sampling(["--ignore-eos"], ignore_eos=True),
    "--json-schema": _chat_sampling(["-j", DIGITS_JSON], json_schema=json.loads(DIGITS_JSON)),
    "--json-schema-file": lambda w: assert_equal(
        chat_params(w, "-jf", _schema_file(w)).json_schema, json.loads(DIGITS_JSON)
    ),
    # the tiny model's template renders no tools: refused before the first prompt (tests/test_tool_calls.py
    # talks to a model whose template has them)
    "--tools": lambda w: _refused_run(
        w.cli("chat", w.m["st"], "--cache", FULL, "--tools", _tools_file(w), stdin=""),
        "does not render tools",
    ),
    "--tool-choice": lambda w: _refused_run(
        w.cli("chat", w.m["st"], "--tool-choice", "required", stdin=""), "--tool-choice needs --tools"
    ),
    "--chat-template": lambda w: assert_differ(
        _answer(w.chat("--chat-template", w.m["template"]))[1], _answer(w.chat())[1]
    ),
}


def _hf_verb(w: Walk, verb: str) -> None:
    """-hf REPO: the repo reaches the hub's fetch, and what it fetched reaches the engine."""
    asked: list[str] = []
    loaded: list[Any] = []

    def fetch(spec: str) -> Path:
        asked.append(spec)
        return Path(w.m["st"])

    class Recorder:
        def __init__(self, path: Any, options: EngineOptions, make_reader: Any = None) -> None:
            loaded.append(path)
            raise MoestreamError("walk: engine options recorded")

    w.monkeypatch.setattr("moestream.store.hub.fetch", fetch)
    w.monkeypatch.setattr("moestream.engine.engine.Engine", Recorder)
    extra = {"serve": ["--port", "0"], "perplexity": ["--text", w.m["text"]]}.get(verb, [])
    run = w.cli(verb, "-hf", "tiny/moe:Q8_0", *extra, "--cache", FULL, stdin="")
    w.monkeypatch.undo()
    assert asked == ["tiny/moe:Q8_0"] and [str(p) for p in loaded] == [str(w.m["st"])], run.err[-400:]


# --- serve ----------------------------------------------------------------------------------------


def served(w: Walk) -> dict[str, Any]:
    """One serve, up to uvicorn, with every serve option changed (each checked by its own entry)."""
    if "served" not in MEMO_SERVE:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.2", 0))
            port = probe.getsockname()[1]
        MEMO_SERVE["served"] = w.served(
            "--host", "127.0.0.2", "--port", str(port), "--api-key", "walk-key", "--model-name", "walker",
            "--queue-size", "3", "--max-body", "128KiB", "--max-connections", "5", "--request-timeout", "7",
            "--log-level", "warning", "-c", "96", "--chat-template", w.m["template"],
            "--trace", w.tmp / "served.parquet", "--no-trace-predict",
        )  # fmt: skip
        MEMO_SERVE["port"] = port
    return MEMO_SERVE["served"]


MEMO_SERVE: dict[str, Any] = {}


def _serve_chat_template(w: Walk) -> None:
    engine = served(w)["config"].app.state.server.engine
    assert engine.tokenizer.chat_template == Path(w.m["template"]).read_text()


def _serve_no_trace_predict(w: Walk) -> None:
    assert served(w)["recorder"].predict is False
    assert isinstance(w.engine_options("serve", "--no-trace-predict"), EngineOptions)
    warned(w.last, "no --trace was given")


SERVE: dict[str, Callable[[Walk], None]] = {
    "path": lambda w: assert_equal(served(w)["options"].aliases, [str(w.m["st"])]),
    "--model": lambda w: assert_equal(
        isinstance(w.engine_options("serve", path=["-m", w.m["st"]]), EngineOptions), True
    ),
    "--hf-repo": lambda w: _hf_verb(w, "serve"),
    "--host": lambda w: assert_equal(served(w)["address"][0], "127.0.0.2"),
    "--port": lambda w: assert_equal(served(w)["address"][1], MEMO_SERVE["port"]),
    "--api-key": lambda w: assert_equal(served(w)["options"].api_key, "walk-key"),
    "--model-name": lambda w: assert_equal(served(w)["options"].model_id, "walker"),
    "--queue-size": lambda w: assert_equal(served(w)["options"].queue_size, 3),
    "--parallel": lambda w: assert_equal(w.engine_options("serve", "-np", "3").parallel, 3),
    "--max-body": lambda w: assert_equal(served(w)["options"].max_body, 128 << 10),
    "--max-connections": lambda w: assert_equal(served(w)["options"].max_connections, 5),
    "--request-timeout": lambda w: assert_equal(served(w)["options"].request_timeout, 7),
    "--log-level": lambda w: assert_equal(served(w)["log_level"], logging.WARNING),
    "--ctx-size": lambda w: assert_equal("context 96 tokens" in served(w)["mode"], True),
    "--chat-template": _serve_chat_template,
    "--trace": lambda w: assert_equal(served(w)["recorder"] is not None, True),
    "--no-trace-predict": _serve_no_trace_predict,
}


# --- bench ----------------------------------------------------------------------------------------


def _bench(argv: list[str], check: Callable[[Any], bool]) -> Callable[[Walk], None]:
    def run(w: Walk) -> None:
        config = w.bench_config(*argv)
        assert not isinstance(config, Run), config.err[-600:]
        assert check(config), config

    return run


def _bench_engine(option: str) -> Callable[[Walk], None]:
    """bench passes the engine options to the `moestream serve` it starts (refused with --target)."""
    argv = {**{k: v[0] for k, v in REACH.items()}, **{k: v[0] for k, v in REFUSE.items()}}[option]

    def check(w: Walk) -> None:
        config = w.bench_config("--model", w.m["st"], *argv)
        assert not isinstance(config, Run), config.err[-600:]
        assert {"-t": "--threads", "-c": "--ctx-size"}.get(argv[0], argv[0]) in config.server_argv
        refused(w.bench_config("--target", "http://127.0.0.1:9", *argv), "apply to --model only")

    return check


BENCH: dict[str, Callable[[Walk], None]] = {
    "--target": _bench(["--target", "http://127.0.0.1:9/v1"], lambda c: c.target == "http://127.0.0.1:9/v1"),
    "--model": lambda w: _bench(["--model", w.m["st"]], lambda c: str(w.m["st"]) in c.server_argv)(w),
    "--hf-repo": lambda w: _fetched(w, "bench", "--out", w.tmp / "bench"),
    "--prompts": _bench(["--target", "http://x", "--prompts", "p.txt"], lambda c: c.prompts == "p.txt"),
    "--max-tokens": _bench(["--target", "http://x", "--max-tokens", "9"], lambda c: c.max_tokens == 9),
    "--stop-at-eos": _bench(["--target", "http://x", "--stop-at-eos"], lambda c: c.ignore_eos is False),
    "--baseline": _bench(["--target", "http://x", "--baseline", "b.json"], lambda c: c.baseline == "b.json"),
    "--fit-with": _bench(
        ["--target", "http://x", "--fit-with", "a", "--fit-with", "b"], lambda c: c.fit_with == ["a", "b"]
    ),
    "--memory-limit": lambda w: _bench_memory_limit(w),
    "--drop-caches": _bench(["--target", "http://x", "--drop-caches"], lambda c: c.drop_caches is True),
    "--readahead-kb": _bench(
        ["--target", "http://x", "--readahead-kb", "64"], lambda c: c.readahead_kb == 64
    ),
    "--disk-of": _bench(["--target", "http://x", "--disk-of", "/"], lambda c: c.disk_of == "/"),
    "--trace": lambda w: _bench_trace(w),
    "--api-key": lambda w: _bench_api_key(w),
    "--label": _bench(["--target", "http://x", "--label", "run-a"], lambda c: c.label == "run-a"),
    "--no-plots": _bench(["--target", "http://x", "--no-plots"], lambda c: c.plots is False),
    "--out": _bench(["--target", "http://x"], lambda c: c.out.name == "bench"),
}


def _bench_memory_limit(w: Walk) -> None:
    config = w.bench_config("--model", w.m["st"], "--memory-limit", "1GiB")
    assert config.memory_limit == 1 << 30
    refused(w.bench_config("--target", "http://x", "--memory-limit", "1GiB"), "cannot limit a server")


def _bench_trace(w: Walk) -> None:
    config = w.bench_config("--model", w.m["st"], "--trace", "t.parquet")
    assert config.server_argv[-2:] == ["--trace", "t.parquet"]
    refused(w.bench_config("--target", "http://x", "--trace", "t.parquet"), "use --model PATH")


def _bench_api_key(w: Walk) -> None:
    assert w.bench_config("--target", "http://x", "--api-key", "k").api_key == "k"
    config = w.bench_config("--model", w.m["st"], "--api-key", "k")  # the server it starts requires it
    assert config.api_key == "k" and config.server_env["MOESTREAM_API_KEY"] == "k"


# --- perplexity, info, demo -----------------------------------------------------------------------


def ppl(w: Walk, *extra: str) -> dict[str, Any]:
    base = ["--text", w.m["text"], "--ctx", "8", "--chunks", "1", "--cache", FULL, "--json"]
    run = ok(w.cli("perplexity", w.m["st"], *base, *extra, memo=True))
    return {**run.json, "run": run}


PERPLEXITY: dict[str, Callable[[Walk], None]] = {
    "path": lambda w: assert_equal(ppl(w)["chunks"], 1),
    "--model": lambda w: assert_equal(
        isinstance(w.engine_options("perplexity", path=["-m", w.m["st"]]), EngineOptions), True
    ),
    "--hf-repo": lambda w: _hf_verb(w, "perplexity"),
    "--text": lambda w: refused(
        w.cli("perplexity", w.m["st"], "--text", w.tmp / "none.txt"), "cannot read --text"
    ),
    "--ctx": lambda w: assert_equal(ppl(w, *LOSSY_PPL)["ctx"], 6),
    "--chunks": lambda w: assert_equal(ppl(w, *LOSSY_PPL)["chunks"], 2),
    "--allow-lossy": lambda w: _allow_lossy(w),
    "--json": lambda w: assert_equal("perplexity" in ppl(w), True),
}
LOSSY_PPL = ["--ctx", "6", "--chunks", "2", "--experts-per-token", "1", "--allow-lossy"]


def _allow_lossy(w: Walk) -> None:
    assert "LOSSY" in ppl(w, *LOSSY_PPL)["mode"]
    refused(
        w.cli("perplexity", w.m["st"], "--text", w.m["text"], "--experts-per-token", "1"), "add --allow-lossy"
    )
    assert isinstance(w.engine_options("perplexity", "--allow-lossy"), EngineOptions)
    warned(w.last, "--allow-lossy accepts --experts-per-token")


INFO: dict[str, Callable[[Walk], None]] = {
    "path": lambda w: assert_equal(
        ok(w.cli("info", w.m["st"], "--no-routing", "--json")).json["model_type"], "qwen3_moe"
    ),
    "--no-routing": lambda w: assert_equal(
        "routing" in ok(w.cli("info", w.m["st"], "--no-routing", "--json")).json, False
    ),
    "--cache": lambda w: _info_cache(w),
    "--json": lambda w: assert_equal(ok(w.cli("info", w.m["st"], "--no-routing", "--json")).json["top_k"], 2),
    "--model": lambda w: assert_equal(
        ok(w.cli("info", "-m", w.m["st"], "--no-routing", "--json")).json["top_k"], 2
    ),
    "--hf-repo": lambda w: _fetched(w, "info", "--no-routing", "--json"),
}


def _info_cache(w: Walk) -> None:
    refused(w.cli("info", w.m["st"], "--cache", "8KiB"), "cache budget 8.0 KiB is below")  # the routing run's
    assert "routing" in ok(w.cli("info", w.m["st"], "--cache", FULL, "--json")).json
    warned(ok(w.cli("info", w.m["st"], "--no-routing", "--cache", FULL)), "which --no-routing skips")


DEMO_RUN: dict[str, Run] = {}


def demo(w: Walk) -> Run:
    if not DEMO_RUN:
        w.monkeypatch.setenv("MOESTREAM_HOME", str(w.tmp / "home"))
        DEMO_RUN["run"] = ok(
            w.cli(
                "demo", "--dir", w.m["demo"], "--cache", SMALL, "--max-tokens", "3", "--io-mode", "pagecache"
            )
        )
        w.monkeypatch.undo()
    return DEMO_RUN["run"]


DEMO: dict[str, Callable[[Walk], None]] = {
    "--dir": lambda w: assert_equal(("qwen3_moe" in demo(w).out, (w.tmp / "home").exists()), (True, False)),
    "--cache": lambda w: assert_equal(f"{SMALL} = 4 slots" in demo(w).out, True),
    "--max-tokens": lambda w: assert_equal("(3 generated)" in demo(w).out, True),
    "--io-mode": lambda w: assert_equal("io pagecache" in demo(w).out, True),
}


# --- synth ----------------------------------------------------------------------------------------


def _synth(argv: list[str], **expected: Any) -> Callable[[Walk], None]:
    def check(w: Walk) -> None:
        kwargs, run = w.synth_kwargs(w.tmp / "s", *argv)
        assert kwargs, run.err
        for name, value in expected.items():
            assert kwargs[name] == value, (name, kwargs[name], value)

    return check


def _synth_threads(w: Walk) -> None:
    _synth(["--quant", "Q8_0", "--threads", "3"], threads=3)(w)
    warned(w.synth_kwargs(w.tmp / "s", "--threads", "3")[1], "--threads quantizes a GGUF synth")


def _synth_shard_size(w: Walk) -> None:
    _synth(["--shard-size", "1MiB"], shard_bytes=1 << 20)(w)
    warned(w.synth_kwargs(w.tmp / "s.gguf", "--shard-size", "1MiB")[1], "--format gguf writes one file")


SYNTH: dict[str, Callable[[Walk], None]] = {
    "out": lambda w: assert_equal(str(w.synth_kwargs(w.tmp / "o")[0]["out"]), str(w.tmp / "o")),
    "--format": _synth(["--format", "gguf"], format="gguf"),
    "--quant": _synth(["--quant", "Q8_0"], quant="Q8_0", format="gguf"),
    "--threads": _synth_threads,
    "--preset": _synth(["--preset", "demo"], preset="demo"),
    "--arch": _synth(["--arch", "olmoe"], arch="olmoe"),
    "--layers": _synth(["--layers", "3"], layers=3),
    "--experts": _synth(["--experts", "6"], experts=6),
    "--top-k": _synth(["--top-k", "3"], top_k=3),
    "--hidden": _synth(["--hidden", "96"], hidden=96),
    "--moe-intermediate": _synth(["--moe-intermediate", "48"], moe_intermediate=48),
    "--dtype": _synth(["--dtype", "fp16"], dtype="fp16"),
    "--seed": _synth(["--seed", "7"], seed=7),
    "--shard-size": _synth_shard_size,
    "--vocab-size": _synth(["--vocab-size", "400"], vocab_size=400),
    "--mxfp4": _synth(["--mxfp4"], mxfp4=True),
    "--plain-init": _synth(["--plain-init"], realistic_routing=False),
    "--force": _synth(["--force"], force=True),
}


# --- traces: simulate, predict-eval, trace-convert -------------------------------------------------


def sim(w: Walk, *argv: str) -> Run:
    return ok(w.cli("simulate", w.m["trace"], "--budgets", "100KiB,200KiB", "--json", *argv, memo=True))


def _sim_prefetch(flag: str, value: str) -> Callable[[Walk], None]:
    def check(w: Walk) -> None:
        base = sim(w, "--policy", "lru-prefetch").json
        assert sim(w, "--policy", "lru-prefetch", flag, value).json != base
        warned(sim(w, "--policy", "lru", flag, value), f"{flag}")

    return check


SIMULATE: dict[str, Callable[[Walk], None]] = {
    "trace": lambda w: assert_equal(bool(sim(w).json), True),
    "--budgets": lambda w: assert_equal(len({r["budget_bytes"] for r in sim(w).json}), 2),
    "--policy": lambda w: assert_equal({r["policy"] for r in sim(w, "--policy", "lfu").json}, {"lfu"}),
    "--unit-bytes": lambda w: assert_differ(
        sim(w, "--policy", "lru").json, sim(w, "--policy", "lru", "--unit-bytes", "70000").json
    ),
    "--prefetch-top": _sim_prefetch("--prefetch-top", "1"),
    "--prefetch-min-score": _sim_prefetch("--prefetch-min-score", "0.9"),
    "--parallel": lambda w: assert_equal(
        "forwards regrouped as 2 requests at once" in sim(w, "--policy", "lru", "-np", "2").err, True
    ),
    "--plot": lambda w: (
        ok(w.cli("simulate", w.m["trace"], "--policy", "lru", "--plot", w.tmp / "c.png"))
        and assert_equal((w.tmp / "c.png").exists(), True)
    ),
    "--json": lambda w: assert_equal(isinstance(sim(w).json, list), True),
    "--gpu-tier": lambda w: assert_equal(
        {r.get("gpu_tier_bytes") for r in sim(w, "--gpu-tier", "100KiB").json}, {100 << 10}
    ),
}
PREDICT_EVAL: dict[str, Callable[[Walk], None]] = {
    "trace": lambda w: assert_equal("recall" in ok(w.cli("predict-eval", w.m["trace"])).out, True),
    "--json": lambda w: assert_equal(
        isinstance(json.loads(ok(w.cli("predict-eval", w.m["trace"], "--json")).out), list), True
    ),
}


def _converted(w: Walk, *argv: str) -> Any:
    from moestream.trace.reader import load_traces

    out = w.tmp / "converted.jsonl"
    out.unlink(missing_ok=True)
    ok(w.cli("trace-convert", w.m["trace"], out, *argv))
    return load_traces([out]).header


TRACE_CONVERT: dict[str, Callable[[Walk], None]] = {
    "inputs": lambda w: assert_equal(_converted(w).n_layers, 2),
    "out": lambda w: _converted(w) and assert_equal((w.tmp / "converted.jsonl").exists(), True),
    "--unit-bytes": lambda w: assert_equal(
        _converted(w, "--unit-bytes", "70000").expert_bytes, [70000, 70000]
    ),
    "--dtype": lambda w: assert_equal(_converted(w, "--dtype", "fp8").dtype, "fp8"),
}


# --- gpu-floor ------------------------------------------------------------------------------------


def _floor_installed(w: Walk, *argv: str) -> str:
    root = w.tmp / "floor-root"
    shutil.rmtree(root, ignore_errors=True)
    ok(w.cli("gpu-floor", "install", "--root", root, "--config", w.tmp / "none", *argv))
    return (root / "etc/default/moestream-gpu-floor").read_text()


def _floor_setting(argv: list[str], line: str) -> Callable[[Walk], None]:
    def check(w: Walk) -> None:
        assert line in _floor_installed(w, *argv)
        warned(w.cli("gpu-floor", "uninstall", "--root", w.tmp / "floor-root", *argv), "does not read")

    return check


def _floor_config(w: Walk) -> None:
    config = w.tmp / "floor.conf"
    config.write_text("HOLD_SECONDS=4\n")
    root = w.tmp / "floor-root"
    ok(w.cli("gpu-floor", "install", "--root", root, "--config", config))
    assert "HOLD_SECONDS=4" in (root / "etc/default/moestream-gpu-floor").read_text()


def _floor_check(w: Walk) -> None:
    from moestream.power.testing import make_fake_jetson

    root = w.tmp / "jetson"
    make_fake_jetson(root, min_mhz=408)
    run = w.cli("gpu-floor", "--check", "--sysfs-root", root, "--config", w.tmp / "none")
    assert "17000000.gpu" in run.out, run.out
    refused(w.cli("gpu-floor", "install", "--check"), "--check reports what the daemon would use")


def _floor_daemon(w: Walk, *argv: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def make(settings: Any, sysfs_root: str, state_dir: Any) -> Any:
        seen.update(sysfs_root=sysfs_root, state_dir=state_dir)
        return object()

    def serve(settings: Any, floor: Any, sysfs_root: str) -> int:
        return 0

    w.monkeypatch.setattr("moestream.power.daemon.make_daemon_floor", make)
    w.monkeypatch.setattr("moestream.power.daemon.serve", serve)
    w.monkeypatch.setattr("logging.basicConfig", lambda **kwargs: seen.update(level=kwargs["level"]))
    try:
        ok(w.cli("gpu-floor", "--config", w.tmp / "none", *argv))
    finally:
        w.monkeypatch.undo()
    return seen


def _floor_uninstall(w: Walk) -> None:
    _floor_installed(w)
    ok(w.cli("gpu-floor", "uninstall", "--root", w.tmp / "floor-root"))
    assert not (w.tmp / "floor-root/etc/default/moestream-gpu-floor").exists()


GPU_FLOOR: dict[str, Callable[[Walk], None]] = {
    "action": _floor_uninstall,
    "--check": _floor_check,
    "--config": _floor_config,
    "--floor-mhz": _floor_setting(["--floor-mhz", "900"], "GPU_FLOOR_MHZ=900"),
    "--hold-s": _floor_setting(["--hold-s", "3"], "HOLD_SECONDS=3"),
    "--library": _floor_setting(["--library", "/opt/libllama.so"], 'LIBRARIES="/opt/libllama.so"'),
    "--moe-flag": _floor_setting(["--moe-flag=--cpu-moe"], 'MOE_FLAGS="--cpu-moe"'),
    "--symbol": _floor_setting(["--symbol", "llama_decode"], 'SYMBOLS="llama_decode"'),
    "--bpftrace": _floor_setting(["--bpftrace", "/opt/bpftrace"], "BPFTRACE=/opt/bpftrace"),
    "--sysfs-root": lambda w: assert_equal(_floor_daemon(w, "--sysfs-root", "/x")["sysfs_root"], "/x"),
    "--state-dir": lambda w: assert_equal(_floor_daemon(w, "--state-dir", "/s")["state_dir"], "/s"),
    "--root": lambda w: assert_equal("GPU_FLOOR_MHZ" in _floor_installed(w), True),
    "--verbose": lambda w: assert_equal(_floor_daemon(w, "-v")["level"], logging.DEBUG),
}


# --- plan -----------------------------------------------------------------------------------------

PLAN_GIVEN = [
    *("--read-rate", "1GiB", "-p", "Hello world", "-n", "3", "--budgets", "100KiB,200KiB", "--policy", "lfu"),
    *("--json", "-t", "2", "--dtype", "bfloat16", "--trunk", "eager"),
    *("--io-threads", "2", "--piece", "64KiB"),
]  # fmt: skip


def plan_given(w: Walk) -> Run:
    """plan on the fixture's trace at a given read rate, with every option of that path changed."""
    return ok(
        w.cli("plan", w.m["st"], "--trace", w.m["trace"], *PLAN_GIVEN, "--plot", w.m["plan_png"], memo=True)
    )


def plan_recorded(w: Walk) -> Run:
    """plan recording its own trace on a prompts file, measuring the read rate briefly."""
    argv = [
        "--prompts",
        w.m["prompts"],
        "-n",
        "2",
        "--read-seconds",
        "0.2",
        "--save-trace",
        w.m["plan_trace"],
    ]
    return ok(w.cli("plan", w.m["st"], *argv, "--json", "--budgets", "200KiB", memo=True))


def _fetched(w: Walk, verb: str, *argv: Any) -> Run:
    """-hf REPO: the name reaches the hub's fetch, and the checkpoint it returns is what the verb opens."""
    asked: list[str] = []

    def fetch(spec: str) -> Path:
        asked.append(spec)
        return Path(w.m["st"])

    w.monkeypatch.setattr("moestream.store.hub.fetch", fetch)
    if verb == "bench":
        config = w.bench_config("-hf", "tiny/moe", *argv[2:])
        assert str(w.m["st"]) in config.server_argv
    else:
        run = w.cli(verb, "-hf", "tiny/moe", *argv)
        assert ok(run)
    w.monkeypatch.undo()
    assert asked == ["tiny/moe"]


PLAN: dict[str, Callable[[Walk], None]] = {
    "path": lambda w: assert_equal(plan_given(w).json["model"], str(w.m["st"])),
    "--model": lambda w: refused(w.cli("plan", "-m", w.tmp / "nowhere"), "nowhere"),
    "--hf-repo": lambda w: _plan_hf(w),
    "--trace": lambda w: assert_equal(str(w.m["trace"]) in plan_given(w).err, True),
    "--prompt": lambda w: assert_equal("on 1 prompt(s)" in plan_given(w).err, True),
    "--prompts": lambda w: assert_equal("on 2 prompt(s)" in plan_recorded(w).err, True),
    "--max-tokens": lambda w: assert_equal("generating 3 tokens" in plan_given(w).err, True),
    "--save-trace": lambda w: plan_recorded(w) and assert_equal(Path(w.m["plan_trace"]).exists(), True),
    "--budgets": lambda w: assert_equal(
        [r["budget_bytes"] for r in plan_given(w).json["rows"]][:2], [100 << 10, 200 << 10]
    ),
    "--policy": lambda w: assert_equal(plan_given(w).json["policy"], "lfu"),
    "--plot": lambda w: plan_given(w) and assert_equal(Path(w.m["plan_png"]).exists(), True),
    "--json": lambda w: assert_equal(plan_given(w).json["rows"][0]["budget_bytes"], 100 << 10),
    "--read-rate": lambda w: assert_equal(plan_given(w).json["read_bytes_per_s"], float(1 << 30)),
    "--read-seconds": lambda w: assert_equal("read rate for 0.2 s" in plan_recorded(w).err, True),
    "--io-threads": lambda w: assert_equal("2 io threads" in plan_given(w).err, True),
    "--piece": lambda w: assert_equal("64 KiB pieces" in plan_given(w).err, True),
    "--threads": lambda w: assert_equal("threads 2" in plan_given(w).err, True),
    "--dtype": lambda w: assert_equal("dtype bfloat16" in plan_given(w).err, True),
    "--trunk": lambda w: assert_equal("trunk eager" in plan_given(w).err, True),
}


def _plan_hf(w: Walk) -> None:
    asked: list[str] = []

    def fetch(spec: str) -> Path:
        asked.append(spec)
        return w.tmp / "fetched"

    w.monkeypatch.setattr("moestream.store.hub.fetch", fetch)
    refused(w.cli("plan", "-hf", "tiny/moe"), "fetched")
    w.monkeypatch.undo()
    assert asked == ["tiny/moe"]


def _version(w: Walk) -> None:
    w.capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and w.capsys.readouterr().out.strip() == f"moestream {moestream.__version__}"


# --- the table ------------------------------------------------------------------------------------

ENGINE_OPTIONS = [*REACH, *REFUSE]
CLI: dict[str, dict[str, Callable[[Walk], None]]] = {
    "generate": GENERATE,
    "chat": {**CHAT, **{o: _engine_reach("chat", o) for o in ENGINE_OPTIONS}},
    "serve": {**{o: _engine_reach("serve", o) for o in ENGINE_OPTIONS}, **SERVE},
    "bench": {**BENCH, **{o: _bench_engine(o) for o in ENGINE_OPTIONS if o != "--ctx-size"}},
    "perplexity": {
        **PERPLEXITY,
        **{o: _engine_reach("perplexity", o) for o in ENGINE_OPTIONS if o != "--ctx-size"},
    },
    "info": INFO,
    "demo": DEMO,
    "synth": SYNTH,
    "simulate": SIMULATE,
    "predict-eval": PREDICT_EVAL,
    "trace-convert": TRACE_CONVERT,
    "gpu-floor": GPU_FLOOR,
    "plan": PLAN,
    "moestream": {"--version": lambda w: _version(w)},
}


@functools.cache
def parser_options() -> dict[str, list[str]]:
    """verb -> its options as the parser has them (the longest spelling; a positional's name)."""
    parser = build_parser([])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))

    def names(p: argparse.ArgumentParser) -> list[str]:
        skip = (argparse._HelpAction, argparse._SubParsersAction)
        return [
            max(a.option_strings, key=len) if a.option_strings else a.dest
            for a in p._actions
            if not isinstance(a, skip)
        ]

    return {"moestream": names(parser), **{verb: names(p) for verb, p in sub.choices.items()}}


def test_every_option_is_classified():
    """A new option (or verb) must say here how it takes effect, or how it is refused or warned about."""
    found = parser_options()
    missing = [
        f"{verb} {o}" for verb, options in found.items() for o in options if o not in CLI.get(verb, {})
    ]
    assert not missing, (
        f"unclassified options (add each to CLI in {Path(__file__).name} with how it is observed on the "
        f"CPU, or refuse/warn where it cannot take effect): {', '.join(missing)}"
    )
    stale = [f"{verb} {o}" for verb, table in CLI.items() for o in table if o not in found.get(verb, [])]
    assert not stale, f"options in the table that no parser has: {', '.join(stale)}"


# --- fixtures and the walk ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tiny_dir, tiny_gguf, tmp_path_factory) -> dict[str, Path]:
    from gguf import GGMLQuantizationType as Q

    root = tmp_path_factory.mktemp("walk")
    st = tiny_dir("qwen3_moe")
    # transformers 5.17 builds no GGUF tokenizer, and moestream refuses GGUF files there (_trunk_dtype skips)
    q8 = tiny_gguf("qwen3_moe", ftype=Q.Q8_0)[1] if transformers_builds_gguf_tokenizers() else None
    # the same model whose end-of-text tokens are the first ones greedy picks after PROMPT and after a
    # chat's first turn "Hello"
    with moestream.load(str(st), cache=FULL) as engine:
        first = [
            engine.generate(PROMPT[1], max_tokens=1, ignore_eos=True).tokens[0],
            engine.generate(messages=[{"role": "user", "content": "Hello"}], max_tokens=1).tokens[0],
        ]
    eos = root / "eos"
    shutil.copytree(st, eos)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((eos / name).read_text())
        data["eos_token_id"] = first
        (eos / name).write_text(json.dumps(data))
    demo = root / "demo"
    shutil.copytree(st, demo)
    (demo / "moestream_synth.json").write_text("{}")
    template = root / "template.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    )
    text = root / "text.txt"
    text.write_text("The history of the printing press shows how a new machine can change " * 4)
    trace = root / "run.parquet"
    assert main(["generate", str(st), *PROMPT, "-n", "3", "--cache", SMALL, "--trace", str(trace)]) == 0
    prompts = root / "prompts.txt"
    prompts.write_text("Hello world\nThe printing press\n")
    return {
        **dict(st=st, q8=q8, eos=eos, demo=demo, template=template, text=text, trace=trace, prompts=prompts),
        **dict(plan_png=root / "plan.png", plan_trace=root / "plan-trace.parquet"),
    }


CASES = [(verb, option) for verb, table in CLI.items() for option in table]


@pytest.mark.parametrize("verb, option", CASES, ids=[f"{v} {o}" for v, o in CASES])
def test_option_takes_effect_or_is_refused(verb, option, models, capsys, monkeypatch, tmp_path_factory):
    if option not in parser_options().get(verb, []):
        pytest.skip(f"{verb} has no {option} on this tree")
    walk = Walk(capsys, monkeypatch, tmp_path_factory.mktemp("case"), models)
    CLI[verb][option](walk)


# --- the Python API -------------------------------------------------------------------------------

# moestream.load's arguments and EngineOptions' fields: the CLI option whose walk observes it, or how
PYTHON_LOAD = {
    "path": "generate path",
    "cache": "generate --cache",
    "device": "generate --device",
    "io_mode": "generate --io-mode",
    "io_threads": "generate --io-threads",
    "piece": "generate --piece",
    "threads": "generate --threads",
    "make_reader": "test_python_api_arguments (the reader factory is called)",
    "dtype": "generate --dtype",
    "trunk_dtype": "generate --trunk-dtype",
    "lock_memory": "generate --no-mlock",
    "preload": "generate --no-preload",
    "gpu_cache": "generate --gpu-cache",
    "host_cache": "generate --host-cache",
    "unified": "generate --unified",
    "gpu_tier": "generate --gpu-tier",
    "ggml_device": "tests/test_gpu_path.py (set at load by --device cuda; a caller's refused)",
    "gpu_path_why": "tests/test_gpu_path.py (set at load by --device cuda; a caller's refused)",
    "policy": "generate --policy",
    "prefetch": "generate --prefetch",
    "experts_per_token": "generate --experts-per-token",
    "gpu_floor": "generate --gpu-floor",
    "ctx_size": "generate --ctx-size",
    "trunk": "generate --trunk",
    "parallel": "tests/test_batch_runner.py, tests/test_batch.py (KV slots, rounds; refusals), "
    "tests/test_parallel_auto.py (auto)",
    "sysfs_root": "tests/test_engine_floor.py (a fake Jetson tree under it gets the floor)",
}
# Engine.stream's arguments and SamplingParams' fields
PYTHON_STREAM = {
    "prompt": "generate --prompt",
    "params": "generate (every CLI run passes one)",
    "messages": "test_python_api_arguments",
    "chat": "generate --chat",
    "chat_template_kwargs": "test_python_api_arguments",
    "cache_prompt": "test_python_api_arguments",
    "keep_cache": "test_python_api_arguments",
    "cancelled": "test_python_api_arguments",
    "request_id": "test_python_api_arguments",
    "max_tokens": "generate --max-tokens",
    "temperature": "generate --temperature",
    "top_p": "generate --top-p",
    "top_k": "generate --top-k",
    "min_p": "generate --min-p",
    "repetition_penalty": "generate --repetition-penalty",
    "presence_penalty": "generate --presence-penalty",
    "frequency_penalty": "generate --frequency-penalty",
    "logit_bias": "test_python_api_arguments",
    "seed": "generate --seed",
    "stop": "test_python_api_arguments",
    "ignore_eos": "generate --ignore-eos",
    "response_format": "tests/test_structured_output.py",
    "json_schema": "generate --json-schema",
    "grammar": "tests/test_tool_calls.py (a forced call's grammar)",
    "output_grammar": "(derived from the three above: no argument)",
    "logprobs": "generate --logprobs",
    "tools": "chat --tools",
    "tool_choice": "chat --tool-choice",
    "parallel_tool_calls": "tests/test_tool_calls.py",
}


def test_every_python_argument_is_classified():
    from moestream.engine.engine import Engine, load
    from moestream.engine.sampling import SamplingParams

    load_args = {n for n in inspect.signature(load).parameters if n != "extra"}
    load_args |= {f.name for f in dataclasses.fields(EngineOptions)}
    stream_args = {n for n in inspect.signature(Engine.stream).parameters if n not in ("self", "sampling")}
    stream_args |= {f.name for f in dataclasses.fields(SamplingParams)}
    assert not load_args - set(PYTHON_LOAD), f"unclassified load arguments: {load_args - set(PYTHON_LOAD)}"
    assert not stream_args - set(PYTHON_STREAM), (
        f"unclassified stream arguments: {stream_args - set(PYTHON_STREAM)}"
    )
    for where in [*PYTHON_LOAD.values(), *PYTHON_STREAM.values()]:
        verb, _, option = where.partition(" ")
        if verb in CLI and option and not option.startswith("("):
            assert option in CLI[verb], where


def test_python_api_arguments(models, recwarn):
    from moestream.io.reader import Reader

    made: list[tuple[str, int]] = []

    def reader(io_mode: str, io_threads: int) -> Reader:
        made.append((io_mode, io_threads))
        return Reader(io_mode, io_threads)

    with moestream.load(str(models["st"]), cache=FULL, make_reader=reader) as engine:
        assert made == [("direct", 4)]
        with pytest.raises(MoestreamError, match="CUDA tiers"):
            engine.restream(gpu_cache="8MiB")  # what load refuses, restream refuses too
    from moestream.engine.unused import refuse_unused

    with pytest.warns(UserWarning, match="the other is unused"):  # CUDA: --cache or --gpu-cache sizes nothing
        refuse_unused("cuda", {"cache": "64MiB", "gpu_cache": "1MiB"})
    with pytest.raises(MoestreamError, match="--unified replaces"):
        refuse_unused("cuda", {"unified": True, "host_cache": "1GiB"})
    with moestream.load(str(models["st"]), cache=FULL, make_reader=reader) as engine:
        plain = engine.generate("Hello world", max_tokens=4, ignore_eos=True)
        assert (
            engine.generate("Hello world", max_tokens=4, ignore_eos=True, logit_bias={9: 100}).tokens
            == [9] * 4
        )
        text = engine.decode(plain.tokens)
        stopped = engine.generate(
            "Hello world", max_tokens=4, ignore_eos=True, stop=[text[1:3]] if len(text) > 2 else [text]
        )
        assert stopped.finish_reason == "stop" and len(stopped.text) < len(text)
        chat = engine.generate(messages=[{"role": "user", "content": "Hello world"}], max_tokens=2)
        assert chat.prompt_tokens > plain.prompt_tokens
        with pytest.raises(MoestreamError, match="reads no such variable"):
            engine.generate(messages=[{"role": "user", "content": "Hi"}], chat_template_kwargs={"nope": 1})
        engine.tokenizer.chat_template = "{{ messages[0]['content'] }}{% if extra %}!!!{% endif %}"
        with_extra = engine.generate(
            messages=[{"role": "user", "content": "Hi"}], max_tokens=1, chat_template_kwargs={"extra": True}
        )
        assert (
            with_extra.prompt_tokens
            > engine.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=1).prompt_tokens
        )
        engine.generate("Hello world", max_tokens=2, cache_prompt=True)
        assert engine.generate("Hello world, again", max_tokens=2, cache_prompt=True).cached_tokens > 0
        engine.generate("Hello world", max_tokens=2, cache_prompt=True, keep_cache=False)
        assert engine.generate("Hello world", max_tokens=2, cache_prompt=True).cached_tokens == 0
        assert (
            engine.generate(
                "Hello world", max_tokens=4, ignore_eos=True, cancelled=lambda: True
            ).finish_reason
            == "cancelled"
        )
        engine.start_trace(models["st"].parent / "py.parquet")
        engine.generate("Hi", max_tokens=2, request_id="walk-42")
        engine.stop_trace()
        # arguments that would be ignored where they are given are refused
        from moestream.engine.sampling import SamplingParams

        with pytest.raises(MoestreamError, match="not both"):
            engine.generate("Hi", SamplingParams(max_tokens=2), temperature=1.0)
        with pytest.raises(MoestreamError, match="token ids are used as given"):
            engine.generate([5, 6], max_tokens=2, chat=True)
        with pytest.raises(MoestreamError, match="goes through no template"):
            engine.generate("Hi", max_tokens=2, chat_template_kwargs={"extra": True})
        as_chat = engine.generate("Hi", max_tokens=1, chat=True, chat_template_kwargs={"extra": True})
        assert as_chat.prompt_tokens == with_extra.prompt_tokens
        recwarn.clear()
        engine.generate("Hi", max_tokens=2, top_k=5)
        assert any("top_k only shape sampling" in str(w.message) for w in recwarn)
    from moestream.trace.reader import load_traces

    assert "walk-42" in load_traces([models["st"].parent / "py.parquet"]).request_names


# --- the server's request fields ------------------------------------------------------------------

COMPLETIONS, CHAT_PATH = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hello world"}]


def _post(server: Any, path: str, **body: Any) -> Any:
    base = {"prompt": "Hello world"} if path == COMPLETIONS else {"messages": USER}
    if "max_completion_tokens" not in body:
        base["max_tokens"] = 6
    return server.http.post(path, json={"temperature": 0, "ignore_eos": True, **base, **body})


def _text(server: Any, path: str = COMPLETIONS, **body: Any) -> str:
    res = _post(server, path, **body)
    assert res.status_code == 200, res.text[:300]
    choice = res.json()["choices"][0]
    return choice["text"] if path == COMPLETIONS else choice["message"]["content"]


DIGIT_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}


def _json_text(server: Any, **body: Any) -> str:
    """A completion held to a JSON format (a grammar ends the output: no ignore_eos)."""
    return _text(server, ignore_eos=False, max_tokens=60, **body)


def _refused_field(field: str, value: Any, path: str = COMPLETIONS, **more: Any) -> Callable[[Any], None]:
    def check(server: Any) -> None:
        res = _post(server, path, **{field: value, **more})
        assert res.status_code == 400 and res.json()["error"]["param"] == field, res.text[:300]

    return check


def both_(*checks: Callable[[Any], None]) -> Callable[[Any], None]:
    def check(server: Any) -> None:
        for one in checks:
            one(server)

    return check


def _field_differs(**body: Any) -> Callable[[Any], None]:
    return lambda server: assert_differ(_text(server, **body), _text(server))


def _field_to_greedy(**body: Any) -> Callable[[Any], None]:
    return lambda server: assert_equal(_text(server, temperature=2, seed=1, **body), _text(server))


def _usage(path: str, field: str) -> Callable[[Any], None]:
    def check(server: Any) -> None:
        res = _post(server, path, **{field: 3})
        assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 3, res.text[:300]

    return check


def _field_seed(server: Any) -> None:
    one = _text(server, temperature=2, seed=1)
    assert one == _text(server, temperature=2, seed=1) != _text(server, temperature=2, seed=2)


def _field_stop(server: Any) -> None:
    full = _text(server)
    res = _post(server, COMPLETIONS, stop=[full[2:4]])
    assert res.json()["choices"][0]["finish_reason"] == "stop" and len(
        res.json()["choices"][0]["text"]
    ) < len(full)


def _field_stream(server: Any) -> None:
    res = _post(server, COMPLETIONS, stream=True)
    assert res.headers["content-type"].startswith("text/event-stream") and res.text.rstrip().endswith(
        "[DONE]"
    )


def _field_stream_options(server: Any) -> None:
    res = _post(server, COMPLETIONS, stream=True, stream_options={"include_usage": True})
    chunks = [json.loads(line[6:]) for line in res.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def _field_ignore_eos(server: Any) -> None:
    eos = {"logit_bias": {"0": 100}}  # the tiny model's end of text, made certain
    assert _post(server, COMPLETIONS, ignore_eos=False, **eos).json()["usage"]["completion_tokens"] == 0
    assert _post(server, COMPLETIONS, ignore_eos=True, **eos).json()["usage"]["completion_tokens"] == 6


def _field_cache_prompt(server: Any) -> None:
    _post(server, COMPLETIONS, cache_prompt=True)
    assert _post(server, COMPLETIONS, cache_prompt=True).json()["timings"]["cache_n"] > 0
    _post(server, COMPLETIONS, cache_prompt=True)
    assert _post(server, COMPLETIONS, cache_prompt=False).json()["timings"]["cache_n"] == 0


def _prompt_tokens(server: Any, path: str, **body: Any) -> int:
    return _post(server, path, **body).json()["usage"]["prompt_tokens"]


SERVER_FIELDS: dict[str, Callable[[Any], None]] = {
    "model": lambda server: assert_equal(_post(server, COMPLETIONS, model="nope").status_code, 404),
    "max_tokens": _usage(COMPLETIONS, "max_tokens"),
    "temperature": _field_differs(temperature=2, seed=1),
    "top_p": _field_to_greedy(top_p=1e-9),
    "top_k": _field_to_greedy(top_k=1),
    "min_p": _field_to_greedy(min_p=1.0),
    "repetition_penalty": _field_differs(repetition_penalty=1.8, max_tokens=8),
    "presence_penalty": _field_differs(presence_penalty=2, max_tokens=8),
    "frequency_penalty": _field_differs(frequency_penalty=2, max_tokens=8),
    "logit_bias": _field_differs(logit_bias={"9": 100}),
    "seed": _field_seed,
    "stop": _field_stop,
    "stream": _field_stream,
    "stream_options": both_(_field_stream_options, _refused_field("stream_options", {"include_usage": True})),
    "n": _refused_field("n", 2),
    "ignore_eos": _field_ignore_eos,
    "cache_prompt": _field_cache_prompt,
    # /v1/completions
    "prompt": lambda server: assert_differ(
        _prompt_tokens(server, COMPLETIONS), _prompt_tokens(server, COMPLETIONS, prompt=[5])
    ),
    "echo": _refused_field("echo", True),
    "suffix": _refused_field("suffix", "!"),
    "best_of": _refused_field("best_of", 2),
    # /v1/chat/completions
    "messages": lambda server: assert_differ(
        _prompt_tokens(server, CHAT_PATH),
        _prompt_tokens(server, CHAT_PATH, messages=[{"role": "user", "content": "Hi"}]),
    ),
    "max_completion_tokens": both_(
        _usage(CHAT_PATH, "max_completion_tokens"),
        lambda server: assert_equal(
            _post(server, CHAT_PATH, max_tokens=4, max_completion_tokens=3).status_code, 400
        ),
    ),
    "chat_template_kwargs": _refused_field("chat_template_kwargs", {"enable_thinking": False}, CHAT_PATH),
    # structured output, log-probabilities, tools (tests/test_server_tools.py covers them in depth)
    "response_format": both_(
        lambda server: assert_equal(_json_text(server, response_format={"type": "json_object"})[:1], "{"),
        _refused_field("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}),
    ),
    "json_schema": lambda server: assert_equal(
        sorted(json.loads(_json_text(server, json_schema=DIGIT_SCHEMA))), ["a"]
    ),
    "logprobs": both_(
        lambda server: assert_equal(
            len(_post(server, COMPLETIONS, logprobs=2).json()["choices"][0]["logprobs"]["tokens"]), 6
        ),
        lambda server: assert_equal(
            len(_post(server, CHAT_PATH, logprobs=True).json()["choices"][0]["logprobs"]["content"]), 6
        ),
    ),
    "top_logprobs": lambda server: assert_equal(
        {
            len(t["top_logprobs"])
            for t in _post(server, CHAT_PATH, logprobs=True, top_logprobs=3).json()["choices"][0]["logprobs"][
                "content"
            ]
        },
        {3},
    ),
    "tools": _refused_field(
        "tools", [{"type": "function", "function": {"name": "f"}}], CHAT_PATH
    ),  # no tools in its template
    "tool_choice": _refused_field("tool_choice", "required", CHAT_PATH),  # and no tools to call
    "parallel_tool_calls": lambda server: assert_equal(
        _text(server, CHAT_PATH, parallel_tool_calls=False), _text(server, CHAT_PATH)
    ),
    # what the server cannot honour: 400 naming the field
    "functions": _refused_field("functions", [{"name": "f"}], CHAT_PATH),
    "function_call": _refused_field("function_call", "auto", CHAT_PATH),
    "audio": _refused_field("audio", {"voice": "alloy"}, CHAT_PATH),
    "prediction": _refused_field("prediction", {"type": "content", "content": "x"}, CHAT_PATH),
    "web_search_options": _refused_field("web_search_options", {}, CHAT_PATH),
    "modalities": _refused_field("modalities", ["audio"], CHAT_PATH),
    # what changes nothing a server computes: accepted, the same text
    "user": lambda server: assert_equal(_text(server, user="u-1"), _text(server)),
    "metadata": lambda server: assert_equal(_text(server, metadata={"k": "v"}), _text(server)),
    "store": lambda server: assert_equal(_text(server, store=False), _text(server)),
    "service_tier": lambda server: assert_equal(_text(server, service_tier="auto"), _text(server)),
    "repeat_penalty": both_(
        lambda server: assert_equal(
            _text(server, repeat_penalty=1.8, max_tokens=8),
            _text(server, repetition_penalty=1.8, max_tokens=8),
        ),
        _refused_field("repeat_penalty", 1.8, repetition_penalty=1.2),
    ),
    # and a field of another server's API is no silent no-op either
    "(unknown)": _refused_field("typical_p", 0.5),
}


def test_every_request_field_is_classified():
    from moestream.server.protocol import IGNORED, UNSUPPORTED, ChatRequest, CompletionRequest

    fields = {*CompletionRequest.model_fields, *ChatRequest.model_fields, *UNSUPPORTED, *IGNORED, "(unknown)"}
    assert not fields - set(SERVER_FIELDS), (
        f"unclassified request fields: {sorted(fields - set(SERVER_FIELDS))}"
    )
    assert not set(SERVER_FIELDS) - fields, f"fields no request has: {sorted(set(SERVER_FIELDS) - fields)}"


@pytest.fixture(scope="module")
def server(tiny_dir):
    from test_server_harness import shared_server

    return shared_server(tiny_dir("qwen3_moe"))


@pytest.mark.parametrize("field", list(SERVER_FIELDS))
def test_request_field_takes_effect_or_is_refused(field, server):
    SERVER_FIELDS[field](server)
