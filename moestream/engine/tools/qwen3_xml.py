"""Qwen3.5 and Qwen3-Coder: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...
</function>\n</tool_call>`, each value as plain text (JSON for a parameter that is not a string)."""

from __future__ import annotations

import re
from typing import Any

from moestream.engine.tools.base import Segmented, start_rule

FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class Qwen3Xml(Segmented):
    name = "qwen3_xml"
    start, end = "<tool_call>", "</tool_call>"
    markers = (start, end, "<function=", "</function>", "<parameter=", "</parameter>")

    def body(self, text: str) -> list[tuple[str, dict[str, Any]]] | None:
        found = FUNCTION.fullmatch(text.strip())
        if found is None:
            return None
        name = found.group(1).strip()
        args = {k.strip(): self.value(name, k.strip(), v) for k, v in PARAMETER.findall(found.group(2))}
        return [(name, args)]

    def grammar(self, names: list[str], parallel: bool) -> str:
        rules, calls = [], []
        for i, name in enumerate(names):
            params = self.parameters(name)
            required = set(params.get("required") or [])
            parts = []
            for key in params.get("properties") or {}:
                part = f'"<parameter={key}>\\n" {self.value_rule(name, key)} "\\n</parameter>\\n"'
                parts.append(part if key in required else f"({part})?")
            rules.append(f'f{i}: "<function={name}>\\n" {" ".join(parts)} "</function>"')
            calls.append(f"f{i}")
        call = f'{self.lit(self.start)} "\\n" ({" | ".join(calls)}) "\\n" {self.lit(self.end)}'
        head = start_rule("call", parallel) + f"call: {call}\n"
        return head + "\n".join(rules) + "\n"
