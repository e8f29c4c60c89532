"""Sampling options shared by generate and chat: one set of flags, one SamplingParams built from them."""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from moestream.errors import MoestreamError


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int | None = 128) -> None:
    """-n/--max-tokens (default `max_tokens`; None: the rest of the context), temperature, top-p/k, min-p,
    the penalties, --seed and --ignore-eos."""
    parser.add_argument(
        "-n",
        "--max-tokens",
        type=int,
        default=max_tokens,
        help=f"tokens to generate (default {max_tokens})"
        if max_tokens is not None
        else "at most this many tokens per answer (default: the rest of the context)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument(
        "--repeat-penalty",
        "--repetition-penalty",
        dest="repetition_penalty",
        type=float,
        default=1.0,
        help="transformers' repetition penalty over prompt and output (1 = off)",
    )
    parser.add_argument(
        "--presence-penalty", type=float, default=0.0, help="OpenAI's, over the output (0 = off)"
    )
    parser.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="OpenAI's, over the output (0 = off)"
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past the end-of-text token"
    )
    parser.add_argument(
        "-j",
        "--json-schema",
        metavar="SCHEMA",
        default=None,
        help="hold the output to valid JSON of this JSON schema (constrained decoding; '{}': any JSON)",
    )
    parser.add_argument(
        "-jf", "--json-schema-file", metavar="FILE", default=None, help="--json-schema read from a file"
    )


def sampling_params(args: argparse.Namespace, **override: Any) -> Any:
    """The SamplingParams of the parsed flags (`override` replaces some, e.g. max_tokens), checked here so
    that a bad value fails before the model loads, which can take minutes.

    Raises:
        MoestreamError: a value out of its range, in SamplingParams' words.
    """
    from moestream.engine.sampling import SamplingParams  # imports torch: not at `moestream --help`

    settings = dict(
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
        json_schema=_json_schema(args),
    )
    try:
        params = SamplingParams(**{**settings, **override})
    except ValueError as exc:
        raise MoestreamError(str(exc)) from None
    unused = params.unused_when_greedy()
    if unused:
        flags = ", ".join("--" + name.replace("_", "-") for name in unused)
        warnings.warn(
            f"{flags} only shape sampling: with --temperature 0 (greedy) they change nothing", stacklevel=2
        )
    return params


def _json_schema(args: argparse.Namespace) -> Any:
    """The schema of --json-schema or --json-schema-file (one of them), or None."""
    import json

    text, where = args.json_schema, "--json-schema"
    if args.json_schema_file is not None:
        if text is not None:
            raise MoestreamError("give --json-schema or --json-schema-file, not both")
        try:
            with open(args.json_schema_file, encoding="utf-8") as f:
                text, where = f.read(), args.json_schema_file
        except OSError as exc:
            raise MoestreamError(f"cannot read {args.json_schema_file}: {exc.strerror}") from None
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise MoestreamError(f"{where} is not JSON: {exc}") from None
