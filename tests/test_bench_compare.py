"""Baseline text diff (character for character, first differing position) and the prompt sets."""

from __future__ import annotations

import json

import pytest

from moestream.bench.compare import compare_runs, diff_texts, first_difference, load_baseline
from moestream.bench.prompts import BUILTIN, load_prompts
from moestream.errors import MoestreamError


def test_first_difference_positions_are_characters():
    assert first_difference("same text", "same text") is None
    assert first_difference("abcdef", "abcxef") == 3
    assert first_difference("abc", "abcdef") == 3  # a prefix differs where it ends
    assert first_difference("abcdef", "abc") == 3
    assert first_difference("", "x") == 0
    assert first_difference("가나다라", "가나마라") == 2  # characters, not UTF-8 bytes (that would be 6)


def test_diff_quotes_both_sides_around_the_difference():
    d = diff_texts(4, "The quick brown fox", "The quick brawn fox", context=3)
    assert (d.index, d.identical, d.first_diff, d.length, d.baseline_length) == (4, False, 12, 19, 19)
    assert (d.excerpt, d.baseline_excerpt) == (" brown", " brawn")
    assert diff_texts(0, "x", "x").identical


def _results(texts: dict[str, str]) -> dict:
    return {"requests": [{"index": i, "prompt": p, "text": t} for i, (p, t) in enumerate(texts.items())]}


def test_compare_runs_matches_prompts_not_positions(tmp_path):
    base = _results({"p1": "alpha beta", "p2": "gamma", "p3": "delta epsilon"})
    (tmp_path / "results.json").write_text(json.dumps(base))
    loaded = load_baseline(tmp_path)  # a directory works as well as the file
    run = [
        {"index": 0, "prompt": "p3", "text": "delta epsilon"},
        {"index": 1, "prompt": "p1", "text": "alpha bets"},
        {"index": 2, "prompt": "p2", "text": "gamma and more"},
    ]
    diffs = compare_runs(run, loaded)
    assert [d.identical for d in diffs] == [True, False, False]
    assert [d.first_diff for d in diffs] == [None, 9, 5]
    with pytest.raises(MoestreamError, match="no request with prompt 1"):
        compare_runs([{"index": 0, "prompt": "other", "text": ""}], loaded)


def test_baseline_that_is_not_a_results_file(tmp_path):
    with pytest.raises(MoestreamError, match="cannot read the baseline"):
        load_baseline(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text('{"text": "no requests"}')
    with pytest.raises(MoestreamError, match=r"not a `moestream bench` results\.json"):
        load_baseline(tmp_path / "x.json")


def test_builtin_prompts_six_korean_six_english():
    prompts = load_prompts("builtin")
    assert len(prompts) == 12 and len({p.text for p in prompts}) == 12
    assert [p.lang for p in prompts].count("ko") == 6 and [p.lang for p in prompts].count("en") == 6
    hangul = lambda s: sum("\uac00" <= c <= "\ud7a3" for c in s)  # noqa: E731
    assert all(hangul(p.text) > 20 for p in prompts if p.lang == "ko")
    assert all(hangul(p.text) == 0 and len(p.text.split()) >= 15 for p in prompts if p.lang == "en")
    assert prompts == list(BUILTIN)


def test_prompt_files(tmp_path):
    lines = tmp_path / "p.txt"
    lines.write_text("first prompt\n\n  second prompt  \n")
    assert [p.text for p in load_prompts(str(lines))] == ["first prompt", "second prompt"]
    js = tmp_path / "p.json"
    js.write_text(json.dumps(["a", {"prompt": "b", "lang": "en"}]))
    assert [(p.text, p.lang) for p in load_prompts(str(js))] == [("a", ""), ("b", "en")]
    js.write_text(json.dumps([1]))
    with pytest.raises(MoestreamError, match="neither a string"):
        load_prompts(str(js))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(MoestreamError, match="holds no prompt"):
        load_prompts(str(tmp_path / "empty.txt"))
    with pytest.raises(MoestreamError, match="cannot read the prompts file"):
        load_prompts(str(tmp_path / "nope.txt"))
