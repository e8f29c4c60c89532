"""GGUF files of every architecture, written the way llama.cpp's converter writes them, against the HF
checkpoint they were written from: the config, stock transformers' tokens and logits, the tokenizer."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from tiny_gguf import GGUF_ARCHS
from tiny_models import CORPUS

import moestream
from moestream.cache.size_classes import budget_requirements
from moestream.store.source import open_source

PROMPT = [5, 17, 33, 2, 99, 41, 7, 250]
NEW_TOKENS = 32
# config fields that name the file rather than define the model
_NOT_THE_MODEL = {"architectures", "_name_or_path", "transformers_version"}


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_config_round_trip(arch, tiny_gguf):
    """Every field of the HF config, defaults included, comes back from the GGUF metadata."""
    hf_dir, path = tiny_gguf(arch)
    ours = open_source(path).config().to_dict()
    theirs = T.AutoConfig.from_pretrained(hf_dir).to_dict()
    for key in sorted((set(ours) | set(theirs)) - _NOT_THE_MODEL):
        assert ours.get(key) == theirs.get(key), (arch, key, ours.get(key), theirs.get(key))


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_streamed_gguf_equals_stock_transformers(arch, tiny_gguf):
    """F32 GGUF streamed by moestream == stock transformers on the HF checkpoint, minimum budget to all."""
    hf_dir, path = tiny_gguf(arch)
    model = T.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    full = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
    )
    with torch.inference_mode():
        ref_logits = model(full).logits[0]
    # the transformers path: the oracle is stock transformers on the HF checkpoint, bit for bit
    with moestream.load(str(path), cache="64MiB", trunk="eager") as engine:
        minimum, _ = budget_requirements(engine.emap, engine.top_k)
        everything = engine.cache.slot_bytes * len(engine.emap.units)
        runs = ((minimum, "direct"), ((minimum + everything) // 2, "pagecache"), (everything, "mmap"))
        for budget, io_mode in runs:
            engine.restream(cache=budget, io_mode=io_mode)
            gen = engine.generate(PROMPT, max_tokens=NEW_TOKENS, ignore_eos=True)
            assert gen.tokens == full[0, len(PROMPT) :].tolist(), (arch, budget, io_mode)
            with torch.inference_mode():
                diff = (engine.model(full).logits[0] - ref_logits).abs().max().item()
            assert diff <= 1e-5, (arch, budget, io_mode, diff)
            if budget == minimum:
                assert engine.cache.stats.misses > len(engine.emap.units), "the minimum budget must re-read"


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_tokenizer_from_gguf_metadata_encodes_like_hf(arch, tiny_gguf):
    hf_dir, path = tiny_gguf(arch)
    ours, theirs = open_source(path).tokenizer(), T.AutoTokenizer.from_pretrained(hf_dir)
    for text in [*CORPUS, "<|im_start|>user\nhi<|im_end|>\n", "  two spaces\tand a tab"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == theirs.decode(ids), text
    chat = [{"role": "user", "content": "Why is the sky blue?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
