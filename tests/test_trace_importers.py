"""Importers of others' router logs: hand-built files of known structure, then the real ones when present."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from shared_data import MIXTRAL, QWEN, needs_traces

from moestream.trace import TraceError, load_traces, read_trace


def write_lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def spec_row(layer: int, pos: int, experts: list[int], problem: int = 0) -> dict:
    return {
        "dataset": "he",
        "problem_id": problem,
        "layer": layer,
        "token_pos": pos,
        "experts": experts,
        "gating_probs": [0.6, 0.4],
    }


def test_speculative_moe_prefill_blocks_then_decode_with_zero_positions(tmp_path: Path) -> None:
    rows = [spec_row(0, p, [p, 3]) for p in range(3)]  # prefill layer 0: tokens 0..2
    rows += [spec_row(1, 0, [0, 1]), spec_row(1, 2, [2, 1])]  # layer 1: token 1 missing
    rows += [spec_row(0, 0, [4, 5]), spec_row(1, 0, [5, 6])]  # decode token 3
    rows += [spec_row(1, 0, [6, 7])]  # decode token 4, layer 0 missing
    t = read_trace(write_lines(tmp_path / "m.jsonl", rows))
    assert t.phase.tolist() == [0] * 5 + [1] * 3
    assert t.token.tolist() == [0, 1, 2, 0, 2, 3, 3, 4]
    assert t.step.tolist() == [0] * 5 + [1, 1, 2]
    assert t.header.n_layers == 2 and t.header.n_experts == 8 and t.header.top_k == 2
    notes = " ".join(t.header.notes)
    assert "1 prefill and 1 decode (token, layer) rows are absent" in notes
    assert "token_pos is 0" in notes and "pass --unit-bytes" in notes


def test_speculative_moe_one_token_prompt_and_two_problems(tmp_path: Path) -> None:
    rows = [spec_row(lay, 0, [1, 2], problem=0) for lay in range(2)] * 2  # prompt of 1 token, 1 decode token
    rows += [spec_row(lay, 0, [3, 4], problem=1) for lay in range(2)]
    t = read_trace(write_lines(tmp_path / "m.jsonl", rows))
    assert t.request_names == ["he/0", "he/1"]
    assert t.phase.tolist() == [0, 0, 1, 1, 0, 0]
    assert t.token.tolist() == [0, 0, 1, 1, 0, 0]
    assert t.step.tolist() == [0, 0, 1, 1, 2, 2]


def vllm_file(path: Path, layer: int, batch_sizes: list[int], seed: int) -> Path:
    rng = np.random.default_rng(seed)
    rows = [{"type": "meta", "model_id": "Qwen/x", "layers_logged": [layer], "top_k": 2}]
    for b, size in enumerate(batch_sizes):
        for pos in range(size):
            ids = [0, 1] if b == 0 else rng.choice(16, 2, replace=False).tolist()  # batch 0: dummy run
            rows.append(
                {
                    "type": "route",
                    "req_id": "r1",
                    "token_idx": pos,
                    "layer": layer,
                    "topk_ids": ids,
                    "topk_weights": [0.7, 0.3],
                }
            )
    return write_lines(path, rows)


def test_vllm_logger_files_merge_into_one_model(tmp_path: Path) -> None:
    sizes = [6, 5, 2, 2, 1]  # dummy run, prefill of 5 tokens, then decode steps of 2, 2, 1 tokens
    a = vllm_file(tmp_path / "l0.jsonl", 0, sizes, 1)
    b = vllm_file(tmp_path / "l3.jsonl", 3, sizes, 2)
    t = load_traces([a, b])
    assert t.header.model_id == "Qwen/x" and t.header.n_layers == 4 and not t.header.token_order_known
    assert sorted(set(t.layer.tolist())) == [0, 3]
    assert len(t) == 2 * (5 + 2 + 2 + 1)
    steps = t.step.tolist()
    assert [steps.count(s) for s in range(4)] == [10, 4, 4, 2]
    assert t.phase[t.step == 0].tolist() == [0] * 10 and (t.phase[t.step > 0] == 1).all()
    # a token keeps its index across layers, and indices never repeat between forwards
    assert t.token[(t.layer == 0)].tolist() == t.token[(t.layer == 3)].tolist() == list(range(10))
    notes = " ".join(t.header.notes)
    assert "dropped 1 forward(s) of [6] rows" in notes and "2-layer model" in notes


def test_vllm_logger_mismatched_or_repeated_layers_are_refused(tmp_path: Path) -> None:
    a = vllm_file(tmp_path / "a.jsonl", 0, [6, 5, 2], 1)
    b = vllm_file(tmp_path / "b.jsonl", 1, [6, 5, 2, 2], 2)
    with pytest.raises(TraceError, match="different forward batches"):
        load_traces([a, b])
    with pytest.raises(TraceError, match="repeats layer 0"):
        load_traces([a, vllm_file(tmp_path / "c.jsonl", 0, [6, 5, 2], 3)])
    with pytest.raises(TraceError, match="only vLLM-MoE-Logger files"):
        load_traces([a, write_lines(tmp_path / "m.jsonl", [spec_row(0, 0, [1, 2])])])


@needs_traces
def test_real_mixtral_trace_structure() -> None:
    t = read_trace(MIXTRAL)
    assert len(t) == 6777 and t.header.n_layers == 32 and t.header.n_experts == 8 and t.header.top_k == 2
    assert (t.phase == 0).sum() == 4198 and (t.phase == 1).sum() == 2579
    assert np.unique(t.token[t.phase == 0]).size == 135 and np.unique(t.token[t.phase == 1]).size == 83
    # every decode token's layers appear in increasing order within one step
    for step in np.unique(t.step[t.phase == 1])[:20]:
        layers = t.layer[t.step == step]
        assert (np.diff(layers) > 0).all()


@needs_traces
def test_real_qwen_logs_merge_as_five_layers() -> None:
    t = load_traces(QWEN)
    assert sorted(set(t.layer.tolist())) == [0, 8, 12, 18, 23]
    assert t.header.model_id == "Qwen/Qwen1.5-MoE-A2.7B-Chat" and t.header.top_k == 4
    assert len(t) == 5 * (65 + 1406 + 2886)  # the 8192- and 256-row dummy forwards are gone
    assert np.unique(t.step).size == 129 and (t.phase == 0).sum() == 5 * (65 + 1406)
    assert read_trace(QWEN[0]).header.notes[0].startswith("1 vLLM-MoE-Logger JSONL file(s), layers [0]")
