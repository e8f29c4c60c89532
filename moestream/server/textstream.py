"""Text deltas for streaming that never have to be taken back.

The engine re-decodes all generated tokens after each one, so its text can still change at the end:
an incomplete UTF-8 sequence decodes to U+FFFD until its last byte arrives, and a stop string that is
only partly generated is cut off once it completes. Holding back such a tail makes the streamed deltas
join to exactly the final text.
"""

from __future__ import annotations


class DeltaTracker:
    """Turns successive full texts into deltas; `final` releases whatever was held back."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.sent = 0

    def _held(self, text: str) -> int:
        """Length of the tail that may still change: trailing U+FFFD, or a proper prefix of a stop string."""
        held = len(text) - len(text.rstrip("\ufffd"))
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return held

    def delta(self, text: str) -> str:
        """The new text that is safe to send now."""
        end = len(text) - self._held(text)
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent : end], end
        return out

    def final(self, text: str) -> str:
        """Everything not sent yet of the final text."""
        out, self.sent = text[self.sent :], len(text)
        return out
