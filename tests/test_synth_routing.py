"""Routing measures: hand-computed values on fake router outputs, and the hooks on real models."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moestream.synth.routing import SAMPLE_TEXT, adjacent_overlap, hot_share, routing_measures, routing_stats

# 8 tokens x top-2 over experts 0..12: expert 0 picked 3 times, expert 1 twice, 11 others once (16 picks)
PICKS = torch.tensor([[0, 1], [1, 0], [0, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]])
HOT8 = (3 + 2 + 6 * 1) / 16
# consecutive pairs share 2, 1, 0, 0, 0, 0, 0 experts of 2
ADJ = (2 / 2 + 1 / 2) / 7


def test_hand_computed_measures():
    assert hot_share(PICKS) == pytest.approx(HOT8)
    assert adjacent_overlap(PICKS) == pytest.approx(ADJ)
    assert hot_share(torch.tensor([[0, 1], [0, 1]])) == 1.0
    assert math.isnan(adjacent_overlap(PICKS[:1]))


def test_measures_per_layer_and_means():
    other = torch.tensor([[0, 1]] * 8)  # a collapsed layer: hot8 1.0, overlap 1.0
    r = routing_measures({3: other, 1: PICKS}, num_experts=64)
    assert [row["layer"] for row in r["layers"]] == [1, 3]
    assert r["layers"][0]["hot8_share"] == pytest.approx(HOT8)
    assert r["hot8_share"] == pytest.approx((HOT8 + 1.0) / 2)
    assert r["adjacent_overlap"] == pytest.approx((ADJ + 1.0) / 2)
    assert r["tokens"] == 8 and r["top_k"] == 2
    assert r["uniform_hot8_share"] == 8 / 64 and r["uniform_adjacent_overlap"] == 2 / 64


class _FakeRouter(nn.Module):
    """Returns fixed picks the way transformers 5.x routers do, or only logits."""

    def __init__(self, picks: torch.Tensor, num_experts: int, logits_only: bool = False) -> None:
        super().__init__()
        self.picks, self.num_experts, self.logits_only = picks, num_experts, logits_only

    def forward(self, x: torch.Tensor):
        logits = torch.full((x.shape[0], self.num_experts), -1.0)
        logits.scatter_(1, self.picks, 1.0)  # the picked experts have the largest logits
        if self.logits_only:
            return logits
        return logits, torch.full(self.picks.shape, 0.5), self.picks


class _FakeModel(nn.Module):
    """model.layers.{0,1}.mlp.gate (layer 1 a different table), plus a gpt-oss style .router on layer 2."""

    def __init__(self, logits_only: bool = False) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_experts_per_tok=2, num_experts=16)
        reverse = PICKS.flip(0)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module() for _ in range(3)])
        for i, table in enumerate((PICKS, reverse)):
            self.model.layers[i].mlp = nn.Module()
            self.model.layers[i].mlp.gate = _FakeRouter(table, 16, logits_only)
        self.model.layers[2].mlp = nn.Module()
        self.model.layers[2].mlp.router = _FakeRouter(PICKS, 16, logits_only)
        self.device = torch.device("cpu")

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False):
        x = torch.zeros(input_ids.shape[1], 4)
        self.model.layers[0].mlp.gate(x)
        self.model.layers[1].mlp.gate(x)
        self.model.layers[2].mlp.router(x)


def _tokenizer(text: str, return_tensors: str = "pt"):
    return {"input_ids": torch.arange(8)[None]}


@pytest.mark.parametrize("logits_only", [False, True])
def test_routing_stats_reads_router_hooks(logits_only):
    r = routing_stats(_FakeModel(logits_only), _tokenizer, "eight tokens")
    assert [row["layer"] for row in r["layers"]] == [0, 1, 2]
    for row in r["layers"]:
        assert row["hot8_share"] == pytest.approx(HOT8)
        assert row["adjacent_overlap"] == pytest.approx(ADJ)
    assert r["num_experts"] == 16 and r["top_k"] == 2 and r["tokens"] == 8


def test_no_routers_is_an_error():
    with pytest.raises(ValueError, match="no router modules"):
        routing_stats(nn.Linear(2, 2), _tokenizer, "x")


def test_sample_text_is_a_few_hundred_words():
    assert 300 <= len(SAMPLE_TEXT.split()) <= 600


@pytest.mark.parametrize("arch,moe_layers", [("deepseek_v3", [1]), ("gpt_oss", [0, 1])])
def test_routing_stats_on_stock_models(arch, moe_layers, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moestream.synth.build import synthesize

    out = synthesize(
        tmp_path / arch, arch=arch, layers=2, experts=16, top_k=4, hidden=64, moe_intermediate=32
    )
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    r = routing_stats(model, AutoTokenizer.from_pretrained(out), SAMPLE_TEXT, max_tokens=200)
    assert [row["layer"] for row in r["layers"]] == moe_layers
    assert r["tokens"] == 200 and r["top_k"] == 4 and r["num_experts"] == 16
    assert 0.5 <= r["hot8_share"] <= 1.0 and 0.0 <= r["adjacent_overlap"] <= 1.0
