"""The Python API habits of mlx-lm and transformers users: `stream` yields each new text piece,
`generate(messages=...)` applies the chat template, the engine is a context manager, and
`engine.model.generate(...)` (stock transformers generation over the streamed experts) gives the engine's
tokens."""

from __future__ import annotations

import torch
import transformers as T

import moestream


def test_stream_pieces_messages_and_model_generate(tiny_dir):
    path = tiny_dir("qwen3_moe")
    tok = T.AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    with moestream.load(str(path), cache="1MiB") as engine:
        pieces, last = [], None
        for last in engine.stream("The quick brown", max_tokens=24, ignore_eos=True):
            pieces.append(last.piece)
        assert last.done and "".join(pieces) == last.text == tok.decode(last.tokens, skip_special_tokens=True)
        assert sum(1 for p in pieces if p) > 3  # text arrives as it is generated, not all at the end

        chat = engine.generate(messages=messages, max_tokens=6, ignore_eos=True)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert (
            chat.prompt_tokens == len(ids)
            and chat.tokens == engine.generate(ids, max_tokens=6, ignore_eos=True).tokens
        )

        prompt = tok.encode("Mixture of experts", add_special_tokens=False)
        ours = engine.generate(prompt, max_tokens=10, ignore_eos=True).tokens
        out = engine.model.generate(
            torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False
        )
        assert out[0, len(prompt) :].tolist() == ours
