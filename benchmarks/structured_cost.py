"""Decode speed with a JSON schema against without, on one checkpoint: what the grammar's mask costs.

    python benchmarks/structured_cost.py CHECKPOINT [--tokens 128] [--rounds 3] [--threads 1] [--cache auto]

Each round runs the same prompt twice, plain and held to `SCHEMA` (an object with at least 64 strings,
so that both decode --tokens tokens), alternately so that a busy host hurts both alike, and
prints decode tok/s of each. The masked run also times the grammar's own work per token (the mask
computed and applied, the token accepted: `Constraint.mask` + `accept`, measured inside the sampler),
which is the cost itself without the noise of two runs' difference. Greedy, EOS ignored for the plain
run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import moestream
from moestream.engine import grammar

# at least 64 strings: the JSON cannot close before --tokens, so both runs decode as many tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "lines": {"type": "array", "items": {"type": "string"}, "minItems": 64},
    },
    "required": ["name", "lines"],
    "additionalProperties": False,
}
PROMPT = "def read_config(path):"


class Timed:
    """Wraps Constraint.mask and .accept with a clock: `per_token` holds each token's seconds."""

    def __init__(self) -> None:
        self.per_token: list[float] = []
        self._mask, self._accept = grammar.Constraint.mask, grammar.Constraint.accept

    def __enter__(self) -> Timed:
        timed = self

        def mask(self: Any, scores: Any) -> None:
            start = time.perf_counter()
            timed._mask(self, scores)
            timed.per_token.append(time.perf_counter() - start)

        def accept(self: Any, token: int) -> None:
            start = time.perf_counter()
            timed._accept(self, token)
            timed.per_token[-1] += time.perf_counter() - start

        grammar.Constraint.mask, grammar.Constraint.accept = mask, accept
        return self

    def __exit__(self, *exc: Any) -> None:
        grammar.Constraint.mask, grammar.Constraint.accept = self._mask, self._accept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", default="auto")
    a = p.parse_args()
    with moestream.load(a.checkpoint, cache=a.cache, threads=a.threads) as engine:
        print(engine.mode_line())
        print(
            f"{platform.node()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; vocabulary "
            f"{engine.grammars.vocab_size} (model), "
            f"{len(engine.tokenizer)} (tokenizer)"
        )
        start = time.perf_counter()
        engine.grammars.tokenizer  # noqa: B018 (built once, on first use)
        print(f"grammar tokenizer prepared in {time.perf_counter() - start:.2f} s")
        engine.generate(PROMPT, max_tokens=8, ignore_eos=True)  # warm-up
        engine.generate(PROMPT, max_tokens=8, json_schema=SCHEMA)
        plain, masked, share = [], [], []
        for _ in range(a.rounds):
            out = engine.generate(PROMPT, max_tokens=a.tokens, ignore_eos=True)
            plain.append(out.stats.decode.tok_s)
            with Timed() as timed:
                out = engine.generate(PROMPT, max_tokens=a.tokens, json_schema=SCHEMA)
            masked.append(out.stats.decode.tok_s)
            median, mean = statistics.median(timed.per_token), statistics.fmean(timed.per_token)
            token_s = 1 / plain[-1]  # the plain run's decode token
            share.append(median / token_s)
            print(
                f"plain {plain[-1]:.1f} tok/s | schema {masked[-1]:.1f} tok/s ({len(out.tokens)} tokens, "
                f"{out.finish_reason}) | grammar per token: median {median * 1e3:.3f} ms "
                f"(mean {mean * 1e3:.3f}) = {share[-1]:.1%} of a plain token"
            )
        print(
            f"median of rounds: plain {statistics.median(plain):.1f} tok/s, schema "
            f"{statistics.median(masked):.1f} tok/s, grammar {statistics.median(share):.1%} of a token"
        )


if __name__ == "__main__":
    main()
