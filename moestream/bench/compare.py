"""Text equality against a baseline run, character for character, with the first differing position."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from moestream.errors import MoestreamError


@dataclass(frozen=True)
class TextDiff:
    """One prompt's text against the baseline's text for the same prompt."""

    index: int
    identical: bool
    first_diff: int | None  # character index of the first difference (None when identical)
    length: int
    baseline_length: int
    excerpt: str = ""  # a few characters around the first difference, both sides
    baseline_excerpt: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_difference(a: str, b: str) -> int | None:
    """Index of the first character where `a` and `b` differ (a prefix differs at the shorter length)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def diff_texts(index: int, text: str, baseline: str, context: int = 12) -> TextDiff:
    pos = first_difference(text, baseline)
    if pos is None:
        return TextDiff(index, True, None, len(text), len(baseline))
    lo = max(0, pos - context)
    return TextDiff(
        index, False, pos, len(text), len(baseline), text[lo : pos + context], baseline[lo : pos + context]
    )


def load_baseline(path: str | Path) -> dict[str, Any]:
    """A previous run's results.json (or the directory holding it).

    Raises:
        MoestreamError: the file is missing or is not a bench results file.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MoestreamError(
            f"cannot read the baseline {p}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise MoestreamError(f"the baseline {p} is not a `moestream bench` results.json")
    return data


def compare_runs(requests: list[dict[str, Any]], baseline: dict[str, Any]) -> list[TextDiff]:
    """Diff every request's text with the baseline request of the same prompt (matched by prompt text).

    Raises:
        MoestreamError: a prompt of this run is missing from the baseline.
    """
    by_prompt = {r["prompt"]: r for r in baseline["requests"]}
    diffs = []
    for r in requests:
        base = by_prompt.get(r["prompt"])
        if base is None:
            raise MoestreamError(
                f"the baseline has no request with prompt {r['index'] + 1} "
                f"({r['prompt'][:40]!r}); compare runs of the same prompts"
            )
        diffs.append(diff_texts(r["index"], r["text"], base["text"]))
    return diffs
