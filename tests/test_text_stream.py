"""Incremental detokenisation: the pieces a stream hands out join to exactly the whole-text decode (the
oracle: the tokenizer's own `decode` of all tokens), cut before the first stop string, and a piece is never
taken back: an incomplete character or the start of a stop string is held until it is settled."""

from __future__ import annotations

import random

import pytest
import transformers as T

from moestream.engine.detokenize import TextStream


class _Pieces:
    """A decode-only tokenizer: token i decodes to PIECES[i] (no backend, so the whole-text path)."""

    PIECES = ("he", "llo ", "S", "T", "O", "P", "X", "y", "\n", "#", "z")

    def decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.PIECES[t] for t in tokens)


def _run(stream: TextStream, tokens: list[int]) -> tuple[list[str], str]:
    pieces = []
    for t in tokens:
        if stream.push(t):
            break
        pieces.append(stream.piece())
    pieces.append(stream.finish())
    return pieces, stream.text


def test_stop_prefixes_are_held_back_and_released():
    # "hello STOP" arriving over several tokens: no prefix of STOP is ever sent, the text ends before it
    pieces, text = _run(TextStream(_Pieces(), ["STOP"]), [0, 1, 2, 3, 4, 5, 6])
    assert text == "hello " and pieces[:4] == ["he", "llo ", "", ""] and "".join(pieces) == "hello "
    # a held prefix that turns out not to be the stop string is released
    pieces, text = _run(TextStream(_Pieces(), ["STOP"]), [1, 2, 6, 7])
    assert text == "llo SXy" and "".join(pieces) == text and pieces[1] == ""
    pieces, _ = _run(TextStream(_Pieces(), ["\n\n", "###"]), [10, 8, 9, 7])
    assert pieces == ["z", "", "\n", "#y", ""]


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return T.AutoTokenizer.from_pretrained(tiny_dir("qwen3_moe"))


def _oracle(tok, tokens: list[int], stops: list[str]) -> str:
    """The text the old whole-text loop produced: decode after every token, cut at the first stop."""
    for k in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:k], skip_special_tokens=True)
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return text[: min(found)]
    return tok.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("incremental", [True, False], ids=["DecodeStream", "whole-text"])
def test_random_tokens_join_to_the_decode(tokenizer, incremental):
    rng = random.Random(5)
    vocab = len(tokenizer)
    corpus_ids = tokenizer.encode(
        "The quick brown fox 안녕하세요 오늘은 Hello, world! 0123456789", add_special_tokens=False
    )
    for case in range(60):
        # random ids (lone UTF-8 bytes, special tokens) and real text, with and without stop strings
        tokens = (
            [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
            if case % 2
            else corpus_ids[: rng.randint(1, 40)]
        )
        whole = tokenizer.decode(tokens, skip_special_tokens=True)
        stops = [] if case % 3 == 0 else [whole[len(whole) // 3 : len(whole) // 3 + rng.randint(1, 3)]]
        stream = TextStream(tokenizer, stops)
        if not incremental:
            stream._stream = None
        pieces, text = _run(stream, tokens)
        assert text == "".join(pieces) == _oracle(tokenizer, tokens, [s for s in stops if s]), (tokens, stops)
        assert all(p is not None for p in pieces)
