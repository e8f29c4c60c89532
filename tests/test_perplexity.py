"""Perplexity: equal across cache budgets and io modes (1e-6 relative), equal to stock transformers on the
same chunks (an independent cross-entropy), and the CLI refuses a lossy top-k unless asked."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers as T
from tiny_models import CORPUS

import moestream
from moestream.bench.perplexity import model_logits, perplexity, split_chunks
from moestream.cache.size_classes import budget_requirements
from moestream.cli import main
from moestream.errors import MoestreamError

CTX, CHUNKS = 64, 3


def _text() -> str:
    # a deterministic shuffle of the tokenizer's corpus, long enough for CHUNKS chunks
    order = [(i * 7) % len(CORPUS) for i in range(40)]
    return " ".join(CORPUS[i] for i in order)


def stock_perplexity(path, text: str, ctx: int, chunks: int) -> float:
    """Oracle: stock transformers, cross-entropy over the second half of each chunk."""
    model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = T.AutoTokenizer.from_pretrained(path).encode(text, add_special_tokens=False)
    total, count = 0.0, 0
    for c in range(chunks):
        chunk = torch.tensor([ids[c * ctx : (c + 1) * ctx]])
        with torch.no_grad():
            logits = model(chunk).logits[0].double()
        half = ctx // 2
        total += F.cross_entropy(logits[half:-1], chunk[0, half + 1 :], reduction="sum").item()
        count += ctx - 1 - half
    return math.exp(total / count)


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    path = tiny_dir("qwen3_moe")
    text_file = tmp_path_factory.mktemp("ppl") / "text.txt"
    text_file.write_text(_text(), encoding="utf-8")
    return path, text_file, stock_perplexity(path, _text(), CTX, CHUNKS)


def test_equal_across_budgets_and_io_modes_and_to_stock(setup):
    path, _, reference = setup
    seen = []
    with moestream.load(str(path), cache="64MiB", threads=1) as engine:
        ids = engine.encode(_text())
        assert len(ids) >= CTX * CHUNKS
        minimum, _ = budget_requirements(engine.emap, engine.top_k)
        everything = engine.cache.slot_bytes * len(engine.emap.units)
        for budget in (minimum, everything):
            for io_mode in ("direct", "pagecache", "mmap"):
                engine.restream(cache=budget, io_mode=io_mode)
                result = perplexity(model_logits(engine.model), ids, CTX, CHUNKS)
                assert (result.chunks, result.scored_tokens) == (CHUNKS, CHUNKS * (CTX - 1 - CTX // 2))
                seen.append(result.perplexity)
                if budget == minimum:
                    assert engine.cache.stats.misses > len(engine.emap.units)  # experts were read again
    assert math.isfinite(reference) and reference > 1.0  # a real figure, not a degenerate one
    for value in seen:
        assert value == pytest.approx(reference, rel=1e-6)
        assert value == pytest.approx(seen[0], rel=1e-6)


def test_cli_prints_the_same_figure(setup, capsys):
    path, text_file, reference = setup
    base = [
        "perplexity",
        str(path),
        "--text",
        str(text_file),
        "--ctx",
        str(CTX),
        "--cache",
        "1MiB",
        "--threads",
        "1",
        "--json",
    ]
    assert main([*base, "--chunks", str(CHUNKS)]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["perplexity"] == pytest.approx(reference, rel=1e-6) and "io direct" in out["mode"]
    assert main([*base, "--chunks", "99"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["chunks"] == len(_ids(path)) // CTX < 99
    assert "holds only" in captured.err


def _ids(path) -> list[int]:
    return T.AutoTokenizer.from_pretrained(path).encode(_text(), add_special_tokens=False)


def test_cli_refuses_lossy_top_k_unless_allowed(setup, capsys):
    path, text_file, _ = setup
    base = [
        "perplexity",
        str(path),
        "--text",
        str(text_file),
        "--ctx",
        str(CTX),
        "--chunks",
        "1",
        "--cache",
        "1MiB",
        "--experts-per-token",
        "1",
    ]
    assert main(base) == 2
    assert "--allow-lossy" in capsys.readouterr().err
    assert main([*base, "--allow-lossy", "--json"]) == 0
    out = capsys.readouterr()
    assert "LOSSY" in json.loads(out.out.strip().splitlines()[-1])["mode"]


def test_chunking_errors():
    assert split_chunks(list(range(10)), 4, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(MoestreamError, match="fewer than one chunk"):
        split_chunks([1, 2, 3], 4, 1)
    with pytest.raises(MoestreamError, match="--ctx"):
        split_chunks(list(range(10)), 2, 1)
