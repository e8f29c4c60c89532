"""`moestream perplexity PATH --text FILE`: perplexity in chunks of --ctx tokens, as llama.cpp scores it."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from moestream.cli._engine_args import add_engine_arguments, add_model_argument, engine_kwargs, model_path
from moestream.errors import MoestreamError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a text file, experts streamed from disk")
    add_model_argument(p)
    p.add_argument(
        "--text", required=True, metavar="FILE", help="UTF-8 text to score (e.g. wikitext-2's test split)"
    )
    p.add_argument(
        "--ctx", type=int, default=512, help="tokens per chunk; the second half is scored (default 512)"
    )
    p.add_argument(
        "--chunks", type=int, default=8, help="chunks to score from the start of the text (default 8)"
    )
    p.add_argument(
        "--allow-lossy",
        action="store_true",
        help="accept --experts-per-token (the figure is then not the model's perplexity)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    add_engine_arguments(p)
    p.set_defaults(func=run)


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MoestreamError(f"cannot read --text {path}: {getattr(exc, 'strerror', None) or exc}") from None


def run(args: argparse.Namespace) -> int:
    import moestream
    from moestream.bench.perplexity import PerplexityResult, model_logits, perplexity

    if args.experts_per_token is not None and not args.allow_lossy:
        raise MoestreamError(
            "--experts-per-token changes the model, so its perplexity is not the model's; "
            "add --allow-lossy to measure it anyway"
        )
    if args.allow_lossy and args.experts_per_token is None:
        warnings.warn(
            "--allow-lossy accepts --experts-per-token, and none was given: the run is lossless", stacklevel=2
        )
    if args.trunk not in ("auto", "eager"):
        warnings.warn(
            f"--trunk {args.trunk}: perplexity scores every position of a chunk in one transformers forward "
            "(the trunk's graphs compute a step's last position only), so it runs --trunk eager",
            stacklevel=2,
        )
    text = _read_text(args.text)
    path = model_path(args)
    # transformers' forward over whole chunks: no ggml graphs, CUDA graphs or static cache built unused
    with moestream.load(path, **{**engine_kwargs(args), "trunk": "eager"}) as engine:
        mode = engine.mode_line()
        print(mode, file=sys.stderr if args.json else sys.stdout, flush=True)
        limit = getattr(engine.config, "max_position_embeddings", None)
        if limit is not None and args.ctx > limit:
            raise MoestreamError(f"--ctx {args.ctx} exceeds the model's context of {limit} tokens")
        ids = engine.encode(text)

        def progress(i: int, so_far: PerplexityResult) -> None:
            print(f"[{i + 1}] {so_far.running[-1]:.4f}", file=sys.stderr, flush=True)

        result = perplexity(model_logits(engine.model), ids, args.ctx, args.chunks, progress)
        if result.chunks < args.chunks:
            print(
                f"moestream: warning: the text holds only {result.chunks} chunks of {args.ctx} tokens",
                file=sys.stderr,
            )
    if args.json:
        print(json.dumps({**result.to_dict(), "mode": mode, "text": args.text}))
    else:
        print(
            f"perplexity {result.perplexity:.6f} over {result.chunks} chunks of {args.ctx} tokens "
            f"({result.scored_tokens} scored)"
        )
    return 0
