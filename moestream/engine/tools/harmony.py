"""gpt-oss's harmony format: the answer is a sequence of messages, each `<|channel|>NAME[ to=RECIPIENT]
[<|constrain|>json]<|message|>BODY` ended by `<|end|>` (another message follows after `<|start|>assistant`),
`<|call|>` or `<|return|>` (both end the generation). A message to `functions.NAME` is a call with
BODY as its arguments; the `final` channel (and `commentary` to nobody: preambles) is the content;
`analysis` is the model's reasoning and stays out of the content."""

from __future__ import annotations

import re
from typing import Any

from moestream.engine.grammar import lark_json
from moestream.engine.tools.base import Parsed, ToolFormat, held_back, json_object

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
RECIPIENT = re.compile(r"to=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"(\w+)")


class Harmony(ToolFormat):
    name = "harmony"
    markers = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)

    def parse(self, text: str, final: bool) -> Parsed:
        content: list[str] = []
        calls: list[tuple[str, dict[str, Any]]] = []
        unread: list[str] = []
        chunks = text.split(START)
        for i, chunk in enumerate(chunks):
            head, sep, rest = chunk.partition(MESSAGE)
            last = i == len(chunks) - 1
            if not sep:
                unread.append(chunk)
                continue
            body, ended = rest, False
            for end in ENDS:
                if end in body:
                    body, ended = body.split(end, 1)[0], True
                    break
            ended = ended or final or not last
            recipient = RECIPIENT.search(head)
            channel = CHANNEL_NAME.search(head)
            if recipient is not None and recipient.group(1).startswith("functions."):
                if ended:
                    args = json_object(body.strip())
                    name = recipient.group(1).removeprefix("functions.")
                    if isinstance(args, dict):
                        calls.append((name, args))
                    else:
                        unread.append(chunk)
                continue
            if channel is not None and channel.group(1) in ("final", "commentary") and recipient is None:
                cut = 0 if ended else held_back(body, ENDS)
                content.append(body[: len(body) - cut])
        if final and not content and not calls:  # nothing in harmony's shape: the text as written
            content = unread
        return Parsed("".join(content), calls)

    def grammar(self, names: list[str], parallel: bool) -> str:
        # one call a message in harmony: `parallel` cannot add a second to this answer
        alts = " | ".join(
            f'{self.lit(CHANNEL)} "commentary to=functions.{n} " {self.lit(CONSTRAIN)} "json" '
            f"{self.lit(MESSAGE)} {lark_json(self.parameters(n))}"
            for n in names
        )
        return f"start: {alts}\n"
