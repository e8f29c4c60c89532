"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Nemo, Small 3.0 and before) or
`[TOOL_CALLS]NAME[ARGS]{...}` (Small 3.1 and later, Devstral, Magistral; `[CALL_ID]ID` may sit
before `[ARGS]`). A call runs to the next `[TOOL_CALLS]` or the end of the output. Its ids are nine
letters and digits: Mistral's templates refuse any other tool_call_id."""

from __future__ import annotations

import secrets
from typing import Any

from moestream.engine.grammar import lark_json
from moestream.engine.tools.base import ALNUM, Segmented, json_object, named_call

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class Mistral(Segmented):
    name = "mistral"
    start, end = TOOL_CALLS, None
    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def __init__(self, tools: list[dict[str, Any]], vocab: dict[str, int], args_token: bool = False) -> None:
        super().__init__(tools, vocab)
        self.args_token = args_token  # [TOOL_CALLS]NAME[ARGS]{...}, else a JSON list

    def body(self, text: str) -> list[tuple[str, dict[str, Any]]] | None:
        text = text.strip()
        if ARGS in text:
            head, _, rest = text.partition(ARGS)
            name = head.partition(CALL_ID)[0].strip()
            args = json_object(rest.strip())
            return [(name, args)] if name and isinstance(args, dict) else None
        items = json_object(text)
        items = [items] if isinstance(items, dict) else items
        if not isinstance(items, list) or not items:
            return None
        calls = [named_call(item) for item in items]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]

    def call_id(self) -> str:
        return "".join(secrets.choice(ALNUM) for _ in range(9))

    def grammar(self, names: list[str], parallel: bool) -> str:
        head = self.lit(TOOL_CALLS)
        if self.args_token:
            alts = " | ".join(f'{head} "{n}" {self.lit(ARGS)} {lark_json(self.parameters(n))}' for n in names)
            return f"start: call{' call*' if parallel else ''}\ncall: {alts}\n"
        alts = " | ".join(self.json_call(n) for n in names)
        items = 'call (", " call)*' if parallel else "call"
        return f'start: {head} "[" {items} "]"\ncall: {alts}\n'
