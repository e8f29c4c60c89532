"""Qwen3 (and Qwen2.5, QwQ, Hermes): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

from typing import Any

from moestream.engine.tools.base import Segmented, json_object, named_call, start_rule


class Qwen3(Segmented):
    name = "qwen3"
    start, end = "<tool_call>", "</tool_call>"
    markers = (start, end)

    def body(self, text: str) -> list[tuple[str, dict[str, Any]]] | None:
        call = named_call(json_object(text.strip()))
        return None if call is None else [call]

    def grammar(self, names: list[str], parallel: bool) -> str:
        call = " | ".join(
            f'{self.lit(self.start)} "\\n" {self.json_call(n)} "\\n" {self.lit(self.end)}' for n in names
        )
        return start_rule("call", parallel) + f"call: {call}\n"
