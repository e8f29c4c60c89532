"""The context cap (--ctx-size) and the KV-cache memory of the mode line: the formula against the bytes of
transformers' real caches for every architecture, the default cap, and requests beyond it refused with
both numbers named, from the Python API and the CLI."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from tiny_models import ARCHS, tiny_config

import moestream
from moestream.cli import main
from moestream.engine.kvcache import kv_cache_bytes
from moestream.engine.prompt_cache import cache_bytes
from moestream.errors import MoestreamError


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gpt_oss_mxfp4"])  # same attention as gpt_oss
def test_kv_cache_formula_equals_transformers_cache(arch):
    config = tiny_config(arch)
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        model = T.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        # 3 tokens, and 40: past tiny gpt_oss' 16-token sliding window
        for tokens in (3, 40):
            with torch.inference_mode():
                cache = model(input_ids=torch.randint(2, 300, (1, tokens)), use_cache=True).past_key_values
            element = torch.tensor([], dtype=dtype).element_size()
            assert kv_cache_bytes(config, tokens, element) == cache_bytes(cache), (arch, dtype, tokens)


def test_context_cap_default_mode_line_and_refusal(tiny_dir, capsys):
    path = str(tiny_dir("qwen3_moe"))
    with moestream.load(path, cache="1MiB") as engine:
        assert engine.ctx_size == 256  # the model's maximum, below 8192
        kv = kv_cache_bytes(engine.config, 256, 4)  # float32
        assert engine.mode_line().endswith(
            f"| context 256 tokens, KV cache {kv / 1024:.1f} KiB when full, parallel 1"
        )
        with pytest.raises(
            MoestreamError, match="max tokens 7 plus the prompt's 250 tokens exceeds the model's"
        ):
            engine.generate([5] * 250, max_tokens=7)
        assert len(engine.generate([5] * 250, max_tokens=6, ignore_eos=True).tokens) == 6
    with moestream.load(path, cache="1MiB", ctx_size=32) as engine:
        assert "| context 32 tokens" in engine.mode_line()
        with pytest.raises(
            MoestreamError, match="max tokens 3 plus the prompt's 30 tokens exceeds the context of 32"
        ):
            engine.generate([5] * 30, max_tokens=3)
        with pytest.raises(
            MoestreamError, match="the prompt has 40 tokens, more than the context of 32 tokens"
        ):
            engine.generate([5] * 40, max_tokens=1)
    code = main(["generate", path, "-c", "16", "-p", "Hello", "-n", "40"])
    err = capsys.readouterr().err
    assert (
        code == 2 and "max tokens 40 plus the prompt's" in err and "context of 16 tokens (--ctx-size)" in err
    )
    assert "Traceback" not in err


def test_context_beyond_the_model_is_refused(tiny_dir):
    with pytest.raises(MoestreamError, match="--ctx-size 1024 is beyond the model's trained context of 256"):
        moestream.load(str(tiny_dir("qwen3_moe")), cache="1MiB", ctx_size=1024)
