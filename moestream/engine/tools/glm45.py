"""GLM-4.5 / 4.6 / 4.7: `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n...
</tool_call>`, each value as plain text (JSON for a parameter that is not a string)."""

from __future__ import annotations

import re
from typing import Any

from moestream.engine.tools.base import Segmented, start_rule

ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm45(Segmented):
    name = "glm45"
    start, end = "<tool_call>", "</tool_call>"
    markers = (start, end, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

    def body(self, text: str) -> list[tuple[str, dict[str, Any]]] | None:
        name, _, rest = text.partition("<arg_key>")
        name = name.strip()
        if not name or "<" in name or "\n" in name:
            return None
        rest = "<arg_key>" + rest if rest else ""
        args = {k.strip(): self.value(name, k.strip(), v) for k, v in ARG.findall(rest)}
        if ARG.sub("", rest).strip():  # something that is no argument
            return None
        return [(name, args)]

    def grammar(self, names: list[str], parallel: bool) -> str:
        key, val = (
            (self.lit(t) for t in ("<arg_key>", "</arg_key>")),
            (self.lit(t) for t in ("<arg_value>", "</arg_value>")),
        )
        (k0, k1), (v0, v1) = key, val
        rules, calls = [], []
        for i, name in enumerate(names):
            params = self.parameters(name)
            required = set(params.get("required") or [])
            parts = []
            for arg in params.get("properties") or {}:
                part = f'"\\n" {k0} "{arg}" {k1} "\\n" {v0} {self.value_rule(name, arg)} {v1}'
                parts.append(part if arg in required else f"({part})?")
            rules.append(f'f{i}: "{name}" {" ".join(parts)} "\\n"')
            calls.append(f"f{i}")
        call = f"{self.lit(self.start)} ({' | '.join(calls)}) {self.lit(self.end)}"
        head = start_rule("call", parallel) + f"call: {call}\n"
        return head + "\n".join(rules) + "\n"
