"""Token ids to text while generating: incremental decoding, stop strings, and pieces never taken back.

Decoding every token's whole text again costs O(n) per token. tokenizers' `DecodeStream` decodes only a
short window of recent tokens and holds an incomplete UTF-8 character back until it is complete, so the
text grows by appending. Two things may still change at the end of the text and are held back from the
pieces handed out: an incomplete character (U+FFFD in a whole-text decode) and a proper prefix of a stop
string, which is cut off once it completes. The pieces therefore join to exactly the final text.
"""

from __future__ import annotations

from typing import Any


def _incremental(tokenizer: Any, skip_special: bool) -> Any:
    """A DecodeStream when it gives what `tokenizer.decode` gives: a fast tokenizer without the
    transformers-side clean-up of spaces (which DecodeStream does not do)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers < 0.21
        return None
    return DecodeStream(skip_special_tokens=skip_special)


class TextStream:
    """Feed generated tokens with `push`; `text` is the text so far (cut before a stop string once one
    appears), `piece()` the new text that is safe to hand out, `finish()` the rest. `skip_special`
    False keeps special tokens in the text (a tool-call format whose markers are special tokens)."""

    def __init__(self, tokenizer: Any, stops: list[str], skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.stops = [s for s in stops if s]
        self.text = ""
        self.tokens: list[int] = []
        self.stopped = False
        self.sent = 0  # characters of `text` already handed out
        self._stream = _incremental(tokenizer, skip_special) if tokenizer is not None else None

    def push(self, token: int) -> bool:
        """Add one generated token; True when a stop string has completed (the text is then final)."""
        self.tokens.append(token)
        if self.tokenizer is None or self.stopped:
            return self.stopped
        settled = len(self.text.rstrip("\ufffd"))  # what a whole-text decode cannot change any more
        if self._stream is not None:
            try:
                piece = self._stream.step(self.tokenizer.backend_tokenizer, token)
            except Exception:  # a decoder DecodeStream cannot follow: decode the whole text from now on
                self._stream, piece = None, None
            if self._stream is not None:
                self.text += piece or ""
        if self._stream is None:
            self.text = self._decode()
        return self._cut(settled)

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip_special)

    def _cut(self, settled: int) -> bool:
        """Cut the text before the first stop string; text up to `settled` was searched before."""
        found = [i for i in (self.text.find(s, max(0, settled - len(s) + 1)) for s in self.stops) if i >= 0]
        if not found:
            return False
        self.text, self.stopped = self.text[: min(found)], True
        return True

    def _held(self) -> int:
        """Length of the tail that may still change: trailing U+FFFD, or a proper prefix of a stop string."""
        text = self.text
        held = len(text) - len(text.rstrip("\ufffd"))
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return held

    def settled(self) -> str:
        """The text that will not change any more (without the held-back tail)."""
        return self.text if self.stopped else self.text[: len(self.text) - self._held()]

    def piece(self) -> str:
        """The new text that is safe to hand out now (it will not change)."""
        end = len(self.text) - (0 if self.stopped else self._held())
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> str:
        """Settle the final text and return what was not handed out yet.

        Without a stop string the final text is the whole-text decode, which also shows what an
        incremental decoder still holds (an incomplete character decodes to U+FFFD).
        """
        if self.tokenizer is not None and not self.stopped and self.tokens:
            whole = self._decode()
            if whole.startswith(self.text[: self.sent]):
                # no stop string starts before `sent` (a possible start is always held back)
                self.text = whole
                self._cut(self.sent)
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
