"""--experts-per-token: a labelled, lossy top-k override, equal to stock transformers with that top-k."""

from __future__ import annotations

import torch
import transformers as T

import moestream

PROMPT = [5, 17, 33, 2, 99, 41]


def test_override_matches_stock_model_with_that_top_k(tiny_dir):
    path = tiny_dir("qwen3_moe", experts=8, top_k=2)
    config = T.AutoConfig.from_pretrained(path)
    config.num_experts_per_tok = 1
    ref = T.AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
    expected = ref.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    with moestream.load(str(path), cache="1MiB", experts_per_token=1) as engine:
        assert "LOSSY: 1 experts per token instead of the model's 2" in engine.mode_line()
        assert (
            engine.generate(PROMPT, max_tokens=16, ignore_eos=True).tokens
            == expected[0, len(PROMPT) :].tolist()
        )
    with moestream.load(str(path), cache="1MiB") as engine:
        assert "LOSSY" not in engine.mode_line()
        assert (
            engine.generate(PROMPT, max_tokens=16, ignore_eos=True).tokens
            != expected[0, len(PROMPT) :].tolist()
        )
