"""DeepSeek-V3 / R1 (BEGIN "function" SEP NAME, then fenced JSON, END) and V3.1 / V3.2 (BEGIN NAME SEP
JSON END), the calls between CALLS_BEGIN and CALLS_END (the markers below: full-width bars, U+FF5C)."""

from __future__ import annotations

import re
from typing import Any

from moestream.engine.grammar import lark_json
from moestream.engine.tools.base import Segmented, json_object

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
BEGIN, SEP, END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCED = re.compile(r"(\S+)\s*```(?:json)?\s*(.*?)\s*```", re.S)


class DeepSeekV3(Segmented):
    name = "deepseek_v3"
    start, end = BEGIN, END
    wrappers = (CALLS_BEGIN, CALLS_END)
    markers = (CALLS_BEGIN, CALLS_END, BEGIN, SEP, END)

    def __init__(self, tools: list[dict[str, Any]], vocab: dict[str, int], fenced: bool = False) -> None:
        super().__init__(tools, vocab)
        self.fenced = fenced  # V3 / R1's "function" + fenced JSON, else V3.1's

    def body(self, text: str) -> list[tuple[str, dict[str, Any]]] | None:
        head, sep, rest = text.partition(SEP)
        if not sep:
            return None
        if head.strip() == "function":
            found = FENCED.fullmatch(rest.strip())
            if found is None:
                return None
            name, args = found.group(1), json_object(found.group(2))
        else:
            name, args = head.strip(), json_object(rest.strip())
        return [(name, args)] if name and isinstance(args, dict) else None

    def grammar(self, names: list[str], parallel: bool) -> str:
        begin, sep, end = self.lit(BEGIN), self.lit(SEP), self.lit(END)
        if self.fenced:
            alts = [
                f'{begin} "function" {sep} "{n}\\n```json\\n" {lark_json(self.parameters(n))} "\\n```" {end}'
                for n in names
            ]
        else:
            alts = [f'{begin} "{n}" {sep} {lark_json(self.parameters(n))} {end}' for n in names]
        calls = "call call*" if parallel else "call"
        return f"start: {self.lit(CALLS_BEGIN)} {calls} {self.lit(CALLS_END)}\ncall: {' | '.join(alts)}\n"
