"""The prompt cache: a second turn that repeats the first one's prompt and output computes only its new
tokens, generates exactly what a cold run generates (itself checked against stock transformers), and
reads fewer expert bytes; a prompt that diverges crops the cache where the architecture allows it; a
failed request never leaves a half-updated cache behind."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as T
from tiny_models import ARCHS, write_tiny

import moestream
from moestream.engine.prompt_cache import PromptCache, common_prefix

FIRST = [5, 17, 33, 2, 41, 9, 12, 60, 7, 88]
NEW_TURN = [3, 19, 44, 101, 6]
# cache budgets of two slots: nearly every expert a layer needs is read again, so bytes track the work
MIN_CACHE = {"gpt_oss": "112KiB", "gpt_oss_mxfp4": "64KiB", "mixtral": "112KiB", "olmoe": "112KiB"}


def _stock_greedy(path, ids: list[int], n: int) -> list[int]:
    ref = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = ref.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


# families whose tiny model's first layer is dense: its one MoE layer is the last, whose experts a prefill
# computes for the last position only (as llama.cpp's graphs do), so a second turn would read no less;
# every layer is MoE for the test that counts bytes
DENSE_FIRST = ("deepseek_v2", "deepseek_v3", "glm4_moe")


def _two_turns(engine):
    """A first turn cached, a second that repeats it and adds NEW_TURN (warnings recorded), and the second
    again, cold: (first, warm, cold, the warm run's warnings)."""
    first = engine.generate(FIRST, max_tokens=6, ignore_eos=True, cache_prompt=True)
    second_prompt = FIRST + first.tokens + NEW_TURN
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warm = engine.generate(second_prompt, max_tokens=8, ignore_eos=True, cache_prompt=True)
    cold = engine.generate(second_prompt, max_tokens=8, ignore_eos=True)
    return first, warm, cold, caught


@pytest.mark.parametrize("arch", ARCHS)
def test_second_turn_equals_a_cold_run_and_reads_less(tiny_dir, tmp_path, arch):
    if arch in DENSE_FIRST:
        path = write_tiny(arch, tmp_path / arch, experts=16, first_k_dense_replace=0)
    else:
        path = tiny_dir(arch, experts=16)
    with moestream.load(str(path), cache=MIN_CACHE.get(arch, "100KiB")) as engine:
        first, warm, cold, caught = _two_turns(engine)
    assert warm.tokens == cold.tokens
    assert not engine.prompt_cache.disabled, caught  # DeepSeek too: the ggml graphs keep their KV cache
    # the cache held the first prompt and every generated token but the last (sampled, never fed back)
    assert warm.cached_tokens == len(FIRST) + len(first.tokens) - 1 and cold.cached_tokens == 0
    second_prompt = FIRST + first.tokens + NEW_TURN
    assert warm.stats.prefill.tokens == len(second_prompt) - warm.cached_tokens == len(NEW_TURN) + 1
    assert warm.stats.prefill.bytes_read < cold.stats.prefill.bytes_read
    assert warm.stats.bytes_read < cold.stats.bytes_read
    if arch == "qwen3_moe":
        assert cold.tokens == _stock_greedy(path, second_prompt, 8)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_on_transformers_path_runs_the_second_turn_cold(tiny_dir, arch):
    # transformers 5.24's DeepSeek attention cannot continue a cache: on its path (trunk eager) the prompt
    # cache turns itself off, says so, and the second turn runs cold with the same tokens
    with moestream.load(str(tiny_dir(arch, experts=16)), cache="100KiB", trunk="eager") as engine:
        _, warm, cold, caught = _two_turns(engine)
    assert engine.prompt_cache.disabled and "cannot continue" in str(caught[-1].message)
    assert warm.cached_tokens == 0 and warm.tokens == cold.tokens


@pytest.mark.parametrize(
    "arch, croppable",
    [
        ("qwen3_moe", True),
        ("mixtral", True),
        ("gpt_oss", True),
        ("qwen3_next", False),
        ("qwen3_5_moe", False),
    ],
)
def test_a_diverging_prompt_reuses_the_common_prefix_where_the_cache_can_be_cropped(
    tiny_dir, arch, croppable
):
    diverging = FIRST[:6] + [77, 78, 79]
    with moestream.load(str(tiny_dir(arch, experts=16)), cache="1MiB") as engine:
        engine.generate(FIRST, max_tokens=4, ignore_eos=True, cache_prompt=True)
        warm = engine.generate(diverging, max_tokens=6, ignore_eos=True, cache_prompt=True)
        cold = engine.generate(diverging, max_tokens=6, ignore_eos=True)
        # the same prompt twice: all but its last token (which must be fed to get logits) is reused
        engine.generate(FIRST, max_tokens=3, ignore_eos=True, cache_prompt=True)
        again = engine.generate(FIRST, max_tokens=3, ignore_eos=True, cache_prompt=True)
    assert warm.tokens == cold.tokens
    # linear-attention (recurrent) layers cannot forget tokens: only an exact continuation reuses them
    assert warm.cached_tokens == (6 if croppable else 0)
    assert again.cached_tokens == (len(FIRST) - 1 if croppable else 0)


@pytest.mark.parametrize("trunk", ["eager", "ggml"])
def test_sliding_window_past_its_window_crops_back_only_in_the_graphs(tiny_dir, trunk):
    # tiny gpt_oss has a 16-token sliding window: past it transformers' cache has dropped the oldest keys,
    # which cannot be cropped back; the ggml graphs' KV cache keeps every position (the window is a mask)
    long = list(range(20, 40))
    with moestream.load(str(tiny_dir("gpt_oss", experts=16)), cache="1MiB", trunk=trunk) as engine:
        first = engine.generate(long, max_tokens=3, ignore_eos=True, cache_prompt=True)
        follow = long + first.tokens + [5, 6]
        cont = engine.generate(follow, max_tokens=4, ignore_eos=True, cache_prompt=True)
        diverge = engine.generate(long[:10] + [7, 8], max_tokens=4, ignore_eos=True, cache_prompt=True)
        assert cont.cached_tokens == len(long) + 2
        assert diverge.cached_tokens == (0 if trunk == "eager" else 10)  # the common prefix
        assert cont.tokens == engine.generate(follow, max_tokens=4, ignore_eos=True).tokens
        assert diverge.tokens == engine.generate(long[:10] + [7, 8], max_tokens=4, ignore_eos=True).tokens


def test_a_failed_forward_drops_the_cache_and_the_engine_stays_usable(tiny_dir, monkeypatch):
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="1MiB") as engine:
        engine.generate(FIRST, max_tokens=4, ignore_eos=True, cache_prompt=True)
        # the runner's forward wrapped (the runner stays: the engine asks it for more than its steps)
        step, calls = engine.runner.forward, []

        def failing(ids, cache, greedy=False):
            calls.append(len(ids))
            if len(calls) == 3:  # the third forward of the next request raises, half-way through the run
                raise RuntimeError("read error")
            return step(ids, cache, greedy)

        monkeypatch.setattr(engine.runner, "forward", failing)
        with pytest.raises(RuntimeError):
            engine.generate(FIRST + [1, 2], max_tokens=6, ignore_eos=True, cache_prompt=True)
        monkeypatch.setattr(engine.runner, "forward", step)
        after = engine.generate(FIRST + [1, 2], max_tokens=6, ignore_eos=True, cache_prompt=True)
        assert after.cached_tokens == 0 and engine.prompt_cache.tokens == len(FIRST) + 2 + 5
        # a request without cache_prompt frees the held cache, and keeps none unless asked to
        assert after.tokens == engine.generate(FIRST + [1, 2], max_tokens=6, ignore_eos=True).tokens
        assert engine.prompt_cache.tokens == 0 and engine.prompt_cache.nbytes() == 0
        engine.generate([4, 5, 6], max_tokens=2, ignore_eos=True, keep_cache=True)
        assert engine.prompt_cache.tokens == 4 and engine.prompt_cache.nbytes() > 0


def test_common_prefix_and_take_leave_one_token_to_feed():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert PromptCache().take([1, 2, 3]).ids == []  # nothing held
