"""Trace header, writer -> Parquet -> reader round trip, JSONL export/import, format detection and errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from moestream.cli import main
from moestream.trace import TraceError, TraceHeader, TraceWriter, detect_format, read_trace
from moestream.trace.jsonl import write_jsonl
from moestream.trace.reader import JSONL, MIXTRAL, PARQUET, VLLM


def header(**kw) -> TraceHeader:
    return TraceHeader(
        **{
            "model_id": "tiny",
            "n_layers": 2,
            "n_experts": 4,
            "top_k": 2,
            "dtype": "bf16",
            "expert_bytes": 1000,
            **kw,
        }
    )


def write_small(path: Path, **kw) -> None:
    """Prefill of 3 tokens (2 layers, predictions on layer 0), then 2 decode tokens."""
    with TraceWriter(path, header(), **kw) as w:
        w.append_forward(
            "r0",
            [0, 1, 2],
            "prefill",
            0,
            np.array([[0, 1], [1, 2], [3, 0]]),
            [[0.6, 0.4]] * 3,
            pred_experts=[[1, 2, 3, 0]] * 3,
            pred_scores=[[4.0, 3.0, 2.0, 1.0]] * 3,
        )
        w.append_forward("r0", [0, 1, 2], "prefill", 1, [[2, 1], [1, 2], [3, 0]], [[0.5, 0.5]] * 3)
        for token in (3, 4):
            for layer in (0, 1):
                w.append("r0", token, "decode", layer, [token % 4, (token + 1) % 4], [0.9, 0.1])


def test_header_validation_and_round_trip() -> None:
    h = header(slot_bytes=[4096, 8192], notes=["n"])
    assert h.expert_bytes == [1000, 1000]  # one size broadcast to every layer
    assert TraceHeader.from_dict(json.loads(h.to_json())) == h
    with pytest.raises(ValueError, match="top_k"):
        header(top_k=5)
    with pytest.raises(ValueError, match="expert_bytes"):
        header(expert_bytes=[1, 2, 3])
    with pytest.raises(ValueError, match="newer"):
        TraceHeader.from_dict({**h.to_dict(), "version": 99})


def test_writer_round_trip_through_parquet(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    write_small(path, flush_rows=3)
    assert detect_format(path) == PARQUET and not (tmp_path / "t.parquet.partial").exists()
    t = read_trace(path)
    assert t.header == dataclasses.replace(
        header(), source="t.parquet"
    )  # the file name is the default source
    assert len(t) == 10 and t.request_names == ["r0"]
    assert t.phase.tolist() == [0] * 6 + [1] * 4
    assert t.token.tolist() == [0, 1, 2, 0, 1, 2, 3, 3, 4, 4]
    # derived steps: the prefill is one forward per layer, each decode token its own step
    assert t.step.tolist() == [0] * 6 + [1, 1, 2, 2]
    assert t.experts[:3].tolist() == [[0, 1], [1, 2], [3, 0]]
    assert t.pred_experts[0].tolist() == [1, 2, 3, 0] and (t.pred_experts[3:] == -1).all()
    assert np.isnan(t.pred_scores[5]).all() and t.pred2_experts is None


def test_explicit_steps_and_row_validation(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "t.parquet", header()) as w:
        w.append("a", 0, "decode", 0, [1, 2], [0.5, 0.5], step=7)
        w.append("b", 0, "decode", 0, [1, 3], [0.5, 0.5], step=7)  # batched with a
        with pytest.raises(ValueError, match="top_k"):
            w.append("a", 1, "decode", 0, [1], [1.0])
        with pytest.raises(ValueError, match="phase"):
            w.append("a", 1, "generate", 0, [1, 2], [0.5, 0.5])
    t = read_trace(tmp_path / "t.parquet")
    assert t.step.tolist() == [7, 7] and t.request_names == ["a", "b"]


def test_jsonl_export_import_is_lossless(tmp_path: Path) -> None:
    write_small(tmp_path / "t.parquet")
    a = read_trace(tmp_path / "t.parquet")
    write_jsonl(a, tmp_path / "t.jsonl")
    assert detect_format(tmp_path / "t.jsonl") == JSONL
    first = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])
    assert first["type"] == "header" and first["n_experts"] == 4
    b = read_trace(tmp_path / "t.jsonl")
    assert b.header == a.header
    for name in ("request", "token", "phase", "layer", "step", "experts", "weights", "pred_experts"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert np.allclose(a.pred_scores, b.pred_scores, equal_nan=True)


def test_convert_verb_both_ways(tmp_path: Path) -> None:
    write_small(tmp_path / "t.parquet")
    assert main(["trace-convert", str(tmp_path / "t.parquet"), str(tmp_path / "t.jsonl")]) == 0
    assert (
        main(["trace-convert", str(tmp_path / "t.jsonl"), str(tmp_path / "u.parquet"), "--dtype", "mxfp4"])
        == 0
    )
    t = read_trace(tmp_path / "u.parquet")
    assert (
        t.header.dtype == "mxfp4"
        and t.experts.tolist() == read_trace(tmp_path / "t.parquet").experts.tolist()
    )
    assert main(["trace-convert", str(tmp_path / "t.jsonl"), str(tmp_path / "u.csv")]) == 2


def test_detects_foreign_jsonl(tmp_path: Path) -> None:
    mix = tmp_path / "m.jsonl"
    mix.write_text(
        json.dumps({"layer": 0, "token_pos": 0, "experts": [1, 2], "gating_probs": [0.5, 0.5]}) + "\n"
    )
    vl = tmp_path / "v.jsonl"
    vl.write_text(json.dumps({"type": "meta", "model_id": "m", "top_k": 2}) + "\n")
    assert detect_format(mix) == MIXTRAL and detect_format(vl) == VLLM


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "empty"),
        ('{"hello": 1}\n', "cannot tell the trace format"),
        ("not json at all\n", "neither Parquet"),
        ("[1, 2]\n", "not an object"),
    ],
)
def test_unknown_content_is_a_clear_error(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError, match=message) as info:
        read_trace(path)
    assert str(path) in str(info.value)


def test_missing_file_and_cut_jsonl_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="does not exist"):
        read_trace(tmp_path / "nope.parquet")
    write_small(tmp_path / "t.parquet")
    write_jsonl(read_trace(tmp_path / "t.parquet"), tmp_path / "t.jsonl")
    text = (tmp_path / "t.jsonl").read_text()
    (tmp_path / "t.jsonl").write_text(text[: len(text) - 30])  # the last row loses its end
    with pytest.raises(TraceError, match=r"line 11 is not valid JSON.*cut"):
        read_trace(tmp_path / "t.jsonl")


def test_ragged_expert_rows_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [json.dumps({"type": "header", **header().to_dict()})]
    for n in (2, 1):
        lines.append(
            json.dumps(
                {
                    "request": "r",
                    "token": 0,
                    "phase": "decode",
                    "layer": 0,
                    "step": 0,
                    "experts": list(range(n)),
                    "weights": [0.5] * n,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match="top_k"):
        read_trace(path)


def test_ids_outside_the_header_and_empty_traces_are_refused(tmp_path: Path) -> None:
    from moestream.trace.simulator import simulate

    with TraceWriter(tmp_path / "empty.parquet", header()):
        pass
    with pytest.raises(TraceError, match=r"empty\.parquet holds no rows"):
        simulate(read_trace(tmp_path / "empty.parquet"), ["lru"], [10_000])
    with TraceWriter(tmp_path / "t.parquet", header()) as w:
        w.append("r", 0, "decode", 5, [1, 2], [0.5, 0.5])  # layer 5 of a 2-layer model
    with pytest.raises(TraceError, match="layer id 5"):
        simulate(read_trace(tmp_path / "t.parquet"), ["lru"], [10_000])


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_convert_refuses_a_trace_without_rows_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture, suffix: str
) -> None:
    """A header and no rows: trace-convert refuses it in one sentence, as simulate and predict-eval do,
    and leaves OUT as it was (absent, or an earlier file untouched)."""
    source = tmp_path / f"empty{suffix}"
    if suffix == ".jsonl":
        source.write_text(json.dumps({"type": "header", **header().to_dict()}) + "\n")
    else:
        with TraceWriter(source, header()):
            pass
    for verb in ("simulate", "predict-eval"):  # the verbs it now agrees with
        assert main([verb, str(source)]) == 2
        assert "holds no rows" in capsys.readouterr().err
    for out in (tmp_path / "out.parquet", tmp_path / "out.jsonl"):
        assert main(["trace-convert", str(source), str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("moestream: error:") and err.count("\n") == 1 and "Traceback" not in err
        assert f"{source} holds no rows" in err and f"nothing was written to {out}" in err
        assert not out.exists()
    earlier = tmp_path / "kept.jsonl"
    earlier.write_text("an earlier file\n")
    assert main(["trace-convert", str(source), str(earlier)]) == 2
    assert earlier.read_text() == "an earlier file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([source.name, "kept.jsonl"])


def test_malformed_foreign_rows_are_a_trace_error(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"layer": 0, "token_pos": 0, "experts": [1, 2]}) + "\n")  # no gating_probs
    with pytest.raises(TraceError, match="speculative-moe"):
        read_trace(path)
