"""`moestream generate PATH --prompt TEXT`: one completion. The text goes to stdout as it is generated;
the mode line and the stats line go to stderr, so the output can be piped."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import warnings
from typing import Any

from moestream.cli._engine_args import (
    add_context_arguments,
    add_engine_arguments,
    add_model_argument,
    add_trace_arguments,
    engine_kwargs,
    model_path,
    read_chat_template,
    use_chat_template,
    warn_trace_predict,
)
from moestream.cli._sampling_args import add_sampling_arguments, sampling_params
from moestream.errors import MoestreamError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with experts streamed from disk")
    add_model_argument(p)
    p.add_argument("-p", "--prompt", help="prompt text (required unless --replay-routing)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    add_sampling_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        default=None,
        help="with --json: every token's log-probability and the N likeliest alternatives' (0..20)",
    )
    p.add_argument(
        "--replay-routing",
        metavar="TRACE",
        help="BENCHMARK ONLY: run the trace's requests with its routing (and with --prefetch its stale-gate "
        "guesses) instead of the model's routers, on a checkpoint with the same MoE layers, experts and "
        "top-k (a synthetic one of real expert size); the text is meaningless; prints one stats line "
        "for all requests",
    )
    add_context_arguments(p)
    add_trace_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import moestream

    if args.replay_routing:
        from moestream.cli._replay import replay_routing

        return replay_routing(args)
    if args.prompt is None:
        raise MoestreamError("generate needs --prompt TEXT (or --replay-routing TRACE)")
    if args.chat_template is not None and not args.chat:
        warnings.warn(
            "--chat-template is used with --chat only: without it the prompt goes in as plain text",
            stacklevel=2,
        )
    warn_trace_predict(args)
    # everything a user can get wrong is checked before the model loads, which can take minutes
    if args.logprobs is not None and not args.json:
        raise MoestreamError("--logprobs are reported in the --json object: add --json")
    params = sampling_params(args, logprobs=args.logprobs)
    path, template = model_path(args), read_chat_template(args)
    if args.trace:
        from moestream.trace.atomic import check_output_path

        check_output_path(args.trace)
    previous = _on_sigterm(_exit_on_sigterm)  # the trace is finished on the way out
    try:
        with moestream.load(path, **engine_kwargs(args)) as engine:
            use_chat_template(engine, template)
            if args.trace:
                engine.start_trace(args.trace, predict=not args.no_trace_predict)
            print(engine.mode_line(), file=sys.stderr, flush=True)
            gen = None
            for gen in engine.stream(args.prompt, params, chat=args.chat):
                if not args.json:
                    print(gen.piece, end="", flush=True)
            _print(args, engine, gen)
            engine.stop_trace()  # a trace that could not be written is an error, after the text is out
    finally:
        _on_sigterm(previous)
    return 0


def _on_sigterm(handler: Any) -> Any:
    """Install a SIGTERM handler (only the main thread may); returns the previous one."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler if handler is not None else signal.SIG_DFL)


def _print(args: argparse.Namespace, engine: Any, gen: Any) -> None:
    """The JSON object, or the end of the streamed text; the stats line on stderr either way."""
    if args.json:
        print(
            json.dumps(
                {
                    "text": gen.text,
                    "tokens": gen.tokens,
                    "prompt_tokens": gen.prompt_tokens,
                    "finish_reason": gen.finish_reason,
                    **(
                        {"logprobs": [_logprob(engine, e) for e in gen.logprobs]}
                        if args.logprobs is not None
                        else {}
                    ),
                    "mode": engine.mode_line(),
                    "stats": gen.stats.to_dict(),
                }
            ),
            flush=True,
        )
    else:
        print(flush=True)
    print(gen.stats.line(), file=sys.stderr, flush=True)


def _logprob(engine: Any, entry: Any) -> dict[str, Any]:
    def text(token: int) -> str:
        return engine.tokenizer.decode([token], skip_special_tokens=False) if engine.tokenizer else ""

    return {
        "token": entry.token,
        "text": text(entry.token),
        "logprob": entry.logprob,
        "top": [{"token": t, "text": text(t), "logprob": lp} for t, lp in entry.top],
    }


def _exit_on_sigterm(signum: int, frame: object) -> None:
    print(
        "moestream: terminated; finishing the trace and closing the checkpoint", file=sys.stderr, flush=True
    )
    raise SystemExit(128 + signum)
