"""Per-token cost of a JSON-schema token mask: xgrammar against llguidance, on one tokenizer.

    python benchmarks/grammar_mask.py [TOKENIZER] [--runs 20] [--tokens 160] [--threads 1]

xgrammar is no dependency of moestream: `pip install xgrammar` into the environment first (or pass
`--engines llguidance`).

TOKENIZER is a directory a transformers tokenizer loads from, or a GGUF file (its tokenizer metadata; a
vocabulary-only GGUF such as llama.cpp's `models/ggml-vocab-qwen2.gguf`, 151,936 tokens, does). Without
it, the Qwen2 vocabulary is taken from the llama.cpp sources that `make setup` downloads
(`.venv/ggml-sdist/llama_cpp_python-*.tar.gz`).

For each engine: the tokenizer's one-time preparation, the schema's compile, and per generated token
the mask (computed into a bitmask) plus its application to float32 logits of the vocabulary's size
(what the sampler does), and the token's acceptance. Two walks through the grammar:

- `document`: the tokens of a valid document as the tokenizer splits it (what a trained model writes);
- `random`: at every step the largest of seeded random logits under the mask (what the test suite's
  random-weight models write: long strings, deep nesting), `--runs` seeds of `--tokens` tokens.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "status": {"type": "string", "enum": ["active", "inactive", "pending"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "total": {"type": "number"},
                    "items": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["id", "total", "items"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "email", "status", "address", "tags", "orders"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "status": "active",
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
    "tags": ["mathematics", "engines", "poetry"],
    "orders": [
        {"id": 1843, "total": 12.5, "items": ["notes on the analytical engine", "translation"]},
        {"id": 1852, "total": 3.75, "items": ["letters"]},
    ],
}
SEPARATORS = (", ", ": ")


def load_tokenizer(path: str | None) -> Any:
    if path is None:
        path = _qwen2_vocab()
    if path.endswith(".gguf"):
        from moestream.store.gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(Path(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _qwen2_vocab() -> str:
    found = sorted(glob.glob(".venv/ggml-sdist/llama_cpp_python-*.tar.gz"))
    if not found:
        raise SystemExit("no tokenizer given and no llama.cpp sdist under .venv/ggml-sdist (run make setup)")
    out = Path(tempfile.gettempdir()) / "moestream-grammar-bench"
    with tarfile.open(found[-1]) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("models/ggml-vocab-qwen2.gguf"))
        target = out / Path(member.name).name
        if not target.exists():
            out.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src:
                target.write_bytes(src.read())
    return str(target)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=SEPARATORS, strict_mode=True
        )

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any) -> None:
        matcher.fill_next_token_bitmask(self.bitmask)

    def apply(self, logits: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, self.bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher: Any) -> bool:
        return matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.words = (vocab + 31) // 32
        self.bitmask = torch.zeros(self.words, dtype=torch.int32)
        self.vocab = vocab

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        )
        # the grammar text is checked here; its tables are built lazily by the matcher
        err = self.ll.LLMatcher.validate_grammar(grammar, self.tok)
        assert not err, err
        return grammar

    def matcher(self, compiled: Any) -> Any:
        m = self.ll.LLMatcher(self.tok, compiled, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, matcher: Any) -> None:
        matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.words * 4)

    def apply(self, logits: torch.Tensor) -> None:
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), bitorder="little")[: self.vocab]
        logits.masked_fill_(torch.from_numpy(bits) == 0, float("-inf"))

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher: Any) -> bool:
        return matcher.is_stopped()


def walk(
    engine: Any, compiled: Any, vocab: int, tokens: list[int] | None, seed: int, limit: int
) -> list[tuple[float, float, float]]:
    """Seconds per token of one walk: (mask computed, mask applied, token accepted)."""
    matcher = engine.matcher(compiled)
    gen = torch.Generator().manual_seed(seed)
    times, i = [], 0
    while not engine.done(matcher) and i < limit:
        logits = torch.randn(vocab, generator=gen)
        t0 = time.perf_counter()
        engine.fill(matcher)
        t1 = time.perf_counter()
        engine.apply(logits)
        t2 = time.perf_counter()
        token = tokens[i] if tokens is not None else int(torch.argmax(logits))
        t3 = time.perf_counter()
        ok = engine.accept(matcher, token)
        times.append((t1 - t0, t2 - t1, time.perf_counter() - t3))
        assert ok, f"{engine.name} refused token {token} at step {i}"
        assert tokens is None or logits[token] != float("-inf"), f"{engine.name} masked the document"
        i += 1
    return times


def summary(times: list[tuple[float, float, float]]) -> str:
    ms = sorted(sum(t) * 1e3 for t in times)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    parts = [statistics.fmean(t[k] for t in times) * 1e3 for k in range(3)]
    return (
        f"mean {statistics.fmean(ms):.3f} ms (compute {parts[0]:.3f} + apply {parts[1]:.3f} + accept "
        f"{parts[2]:.3f}), p50 {ms[len(ms) // 2]:.3f}, p99 {p99:.3f}, max {ms[-1]:.3f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("tokenizer", nargs="?")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the sampler's)")
    p.add_argument("--engines", default="xgrammar,llguidance")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.tokenizer)
    vocab = len(tok)
    doc = tok.encode(json.dumps(DOCUMENT, separators=SEPARATORS), add_special_tokens=False)
    print(
        f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch threads {a.threads}; vocabulary {vocab} tokens; document {len(doc)} tokens"
    )
    for name in a.engines.split(","):
        cls = {"xgrammar": XGrammar, "llguidance": LLGuidance}[name]
        start = time.perf_counter()
        engine = cls(tok, vocab)
        prep = time.perf_counter() - start
        start = time.perf_counter()
        compiled = engine.compile(SCHEMA)
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        first = walk(engine, compiled, vocab, doc, 0, len(doc))  # the first walk builds lazy tables
        first_s = time.perf_counter() - start
        docs = [t for _ in range(5) for t in walk(engine, compiled, vocab, doc, 0, len(doc))]
        rand = [t for s in range(a.runs) for t in walk(engine, compiled, vocab, None, s, a.tokens)]
        print(
            f"{name}: tokenizer prepared in {prep:.2f} s; schema compiled in {compile_s * 1e3:.1f} ms; "
            f"first document walk {first_s * 1e3:.1f} ms ({len(first)} tokens)"
        )
        print(f"  document walk, per token: {summary(docs)}")
        print(f"  random walk ({a.runs} x up to {a.tokens} tokens), per token: {summary(rand)}")


if __name__ == "__main__":
    main()
