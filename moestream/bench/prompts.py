"""The benchmark's prompts: 12 built-in real-language prompts (6 Korean, 6 English), or a user's file.

Real prompts, not random token ids: random ids route to experts no real text would pick, which makes
the cache look better or worse than it is. The built-in prompts were written for this project; each is
a plain request a person might type, 20-35 tokens long with a large multilingual tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moestream.errors import MoestreamError


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt; `lang` is a short label ("ko", "en", or "" for a user's file)."""

    text: str
    lang: str = ""


BUILTIN: tuple[Prompt, ...] = (
    Prompt(
        "작은 보드에서 큰 언어 모델을 실행할 때 메모리가 부족하면 어떤 일이 생기는지 쉬운 말로 설명해 "
        "주세요.",
        "ko",
    ),
    Prompt("비 오는 주말 오후에 집에서 혼자 할 수 있는 재미있는 일 다섯 가지를 추천해 주세요.", "ko"),
    Prompt("김치찌개를 처음 끓이는 사람에게 재료 준비부터 불 조절까지 순서대로 알려 주세요.", "ko"),
    Prompt("서울에서 부산까지 기차로 여행할 때 들르기 좋은 도시와 그 이유를 알려 주세요.", "ko"),
    Prompt("초등학생에게 태양계 행성들의 크기와 거리를 비유로 설명하는 짧은 글을 써 주세요.", "ko"),
    Prompt("회의 시간을 줄이면서도 팀의 의견을 잘 모으는 방법에 대해 조언해 주세요.", "ko"),
    Prompt(
        "Explain in simple words why a solid state drive reads small random blocks more slowly than one "
        "long sequential file.",
        "en",
    ),
    Prompt(
        "Write a short friendly letter to a neighbour asking them to water the garden while you travel "
        "for two weeks.",
        "en",
    ),
    Prompt(
        "A farmer has seventeen sheep and all but nine run away. How many are left, and why do people "
        "often get this wrong?",
        "en",
    ),
    Prompt(
        "Describe how bread dough changes during kneading and rising, and what the baker should look for "
        "at each step.",
        "en",
    ),
    Prompt(
        "List three everyday habits that help a laptop battery last longer, and explain the reason "
        "behind each one.",
        "en",
    ),
    Prompt(
        "Summarise the main causes of ocean tides for a curious ten year old who lives far from the sea.",
        "en",
    ),
)


def load_prompts(spec: str) -> list[Prompt]:
    """`"builtin"` -> the 12 built-in prompts; otherwise a file: a JSON list of strings (or of
    {"prompt", "lang"} objects) when it ends in .json, else one prompt per non-empty line.

    Raises:
        MoestreamError: the file is missing, unreadable, malformed or holds no prompt.
    """
    if spec == "builtin":
        return list(BUILTIN)
    path = Path(spec)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MoestreamError(
            f"cannot read the prompts file {spec}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    prompts = (
        _from_json(text, spec)
        if path.suffix == ".json"
        else [Prompt(line.strip()) for line in text.splitlines() if line.strip()]
    )
    if not prompts:
        raise MoestreamError(f"the prompts file {spec} holds no prompt")
    return prompts


def _from_json(text: str, spec: str) -> list[Prompt]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MoestreamError(
            f"the prompts file {spec} is not valid JSON ({exc.msg}, line {exc.lineno})"
        ) from None
    if not isinstance(items, list):
        raise MoestreamError(f"the prompts file {spec} must hold a JSON list of prompts")
    prompts = []
    for item in items:
        if isinstance(item, str) and item:
            prompts.append(Prompt(item))
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str) and item["prompt"]:
            prompts.append(Prompt(item["prompt"], str(item.get("lang", ""))))
        else:
            raise MoestreamError(
                f"the prompts file {spec} has an entry that is neither a string nor "
                f"an object with a non-empty 'prompt'"
            )
    return prompts
