"""`moestream generate PATH --prompt TEXT`: one completion. The text goes to stdout as it is generated;
the mode line and the stats line go to stderr, so the output can be piped."""

from __future__ import annotations

import argparse
import json
import sys

from moestream.cli._engine_args import (
    add_context_arguments,
    add_engine_arguments,
    add_model_argument,
    add_trace_arguments,
    engine_kwargs,
    model_path,
    read_chat_template,
    use_chat_template,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with experts streamed from disk")
    add_model_argument(p)
    p.add_argument("-p", "--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument(
        "--repeat-penalty",
        "--repetition-penalty",
        dest="repetition_penalty",
        type=float,
        default=1.0,
        help="transformers' repetition penalty over prompt and output (1 = off)",
    )
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the output (0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over the output (0 = off)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_context_arguments(p)
    add_trace_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import moestream

    path, template = model_path(args), read_chat_template(args)
    with moestream.load(path, **engine_kwargs(args)) as engine:
        use_chat_template(engine, template)
        if args.trace:
            engine.start_trace(args.trace, predict=not args.no_trace_predict)
        print(engine.mode_line(), file=sys.stderr, flush=True)
        gen = None
        for gen in engine.stream(
            args.prompt,
            chat=args.chat,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        ):
            if not args.json:
                print(gen.piece, end="", flush=True)
        if args.json:
            print(
                json.dumps(
                    {
                        "text": gen.text,
                        "tokens": gen.tokens,
                        "prompt_tokens": gen.prompt_tokens,
                        "finish_reason": gen.finish_reason,
                        "mode": engine.mode_line(),
                        "stats": gen.stats.to_dict(),
                    }
                )
            )
        else:
            print(flush=True)
        print(gen.stats.line(), file=sys.stderr)
    return 0
