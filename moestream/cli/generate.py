"""`moestream generate PATH --prompt TEXT`: one completion, with the mode line and the stats line."""

from __future__ import annotations

import argparse
import json

from moestream.cli._engine_args import add_engine_arguments, add_trace_arguments, engine_kwargs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with experts streamed from disk")
    p.add_argument("path", help="checkpoint directory or hub id")
    p.add_argument("--prompt", help="prompt text (required unless --replay-routing)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--replay-routing",
        metavar="TRACE",
        help="BENCHMARK ONLY: run the trace's requests with its routing (and with --prefetch its stale-gate "
        "guesses) instead of the model's routers, on a checkpoint with the same MoE layers, experts and "
        "top-k (a synthetic one of real expert size); the text is meaningless; prints one stats line "
        "for all requests",
    )
    add_trace_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import moestream
    from moestream.errors import MoestreamError

    if args.replay_routing:
        if args.trace:
            raise MoestreamError("--replay-routing and --trace cannot be used together")
        return replay(args)
    if args.prompt is None:
        raise MoestreamError("generate needs --prompt TEXT (or --replay-routing TRACE)")
    with moestream.load(args.path, **engine_kwargs(args)) as engine:
        if args.trace:
            engine.start_trace(args.trace, predict=not args.no_trace_predict)
        if not args.json:
            print(engine.mode_line(), flush=True)
        gen = engine.generate(
            args.prompt,
            chat=args.chat,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
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
            print(gen.text, flush=True)
            print(gen.stats.line())
    return 0


def replay(args: argparse.Namespace) -> int:
    """Every request of a recorded trace with its routing; one summed stats line (or JSON object)."""
    import moestream
    from moestream.engine.stats import GenerationStats, PhaseStats

    with moestream.load(args.path, **engine_kwargs(args)) as engine:
        requests = engine.replay_routing(args.replay_routing)
        if not args.json:
            print(engine.mode_line(), flush=True)
        total = GenerationStats(PhaseStats(), PhaseStats())
        for gen in engine.replay_requests():
            for mine, theirs in ((total.prefill, gen.stats.prefill), (total.decode, gen.stats.decode)):
                for name, value in vars(theirs).items():
                    setattr(mine, name, getattr(mine, name) + value)
        replayed, own = engine.replay.replayed, engine.replay.own
        if args.json:
            out = {"mode": engine.mode_line(), "requests": len(requests), "stats": total.to_dict()}
            print(json.dumps({**out, "rows_replayed": replayed, "rows_own_routing": own}))
        else:
            print(
                f"replayed {len(requests)} requests: {replayed} token rows from the trace, {own} by the model"
            )
            print(total.line())
    return 0
