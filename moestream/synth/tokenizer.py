"""Byte-level BPE tokenizer for synthetic checkpoints, trained at synth time on `corpus.py`.

Byte-level means every UTF-8 byte has a token, so any text round-trips exactly, whatever the corpus
covered. Training is deterministic: the same corpus and vocabulary size give the same tokenizer.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moestream.synth.corpus import corpus_lines

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)
DEFAULT_VOCAB = 1024

# ChatML: one <|im_start|>role\ncontent<|im_end|>\n block per message, then an open assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on the embedded corpus and wrap it as a transformers fast tokenizer.

    The result has at most `vocab_size` tokens (fewer if the corpus runs out of pairs to merge),
    the three ChatML special tokens with ids 0, 1, 2, and `<|endoftext|>` as eos and pad token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus_lines(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tokenizer(out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB) -> dict[str, int]:
    """Train and save the tokenizer into `out_dir`; return its size and special-token ids."""
    tok = build_tokenizer(vocab_size)
    tok.save_pretrained(str(out_dir))
    ids = {name: tok.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS}
    return {"size": len(tok), "eos": ids[EOS_TOKEN], "im_start": ids[IM_START], "im_end": ids[IM_END]}
