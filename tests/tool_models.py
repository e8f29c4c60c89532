"""Tiny random-weight models whose tokenizers carry a real model family's chat template and the tokens
its tool calls are written with (tests/chat_templates/), for the tool-call tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tiny_models import write_tiny

TEMPLATES = Path(__file__).parent / "chat_templates"
DEEPSEEK = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"]
DEEPSEEK += [
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]


@dataclass(frozen=True)
class Family:
    template: str
    added: tuple[str, ...] = ()  # added tokens that decode as text (special=False), as in the real tokenizer
    special: tuple[str, ...] = ()  # special tokens
    eos: tuple[str, ...] = ()  # end-of-generation tokens, as the model's generation_config lists them


FAMILIES = {
    "qwen3": Family(
        "Qwen-Qwen3-0.6B.jinja", ("<tool_call>", "</tool_call>", "<think>", "</think>"), (), ("<|im_end|>",)
    ),
    "qwen3_xml": Family(
        "Qwen3.5-4B.jinja", ("<tool_call>", "</tool_call>", "<think>", "</think>"), (), ("<|im_end|>",)
    ),
    "harmony": Family(
        "openai-gpt-oss-120b.jinja",
        (),
        ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"),
        ("<|call|>", "<|return|>"),
    ),
    "glm45": Family(
        "GLM-4.6.jinja",
        ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
        ("<|user|>", "<|observation|>"),
    ),
    "deepseek_v3": Family(
        "deepseek-tools.jinja",
        tuple(DEEPSEEK),
        ("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
        ("<｜end▁of▁sentence｜>",),
    ),
    "mistral": Family(
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        (),
        (
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        (),
    ),
    "mistral_args": Family(
        "Mistral-Small-3.2-24B-Instruct-2506.jinja",
        (),
        (
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[ARGS]",
            "[CALL_ID]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
            "[TOOL_CONTENT]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
        ),
        (),
    ),
}


def write_tool_model(family: str, out: Path, seed: int = 0) -> Path:
    """A tiny qwen3_moe checkpoint whose tokenizer has `family`'s template and tokens."""
    from transformers import AutoTokenizer

    write_tiny("qwen3_moe", out, seed=seed, max_position_embeddings=4096)
    spec = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens(list(spec.added), special_tokens=False)
    tok.add_special_tokens({"additional_special_tokens": list(spec.special)})
    tok.chat_template = (TEMPLATES / spec.template).read_text(encoding="utf-8")
    tok.save_pretrained(out)
    eos = [0] + [tok.convert_tokens_to_ids(t) for t in spec.eos]
    assert len(tok) <= 320 and all(isinstance(t, int) for t in eos), (len(tok), eos)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out
