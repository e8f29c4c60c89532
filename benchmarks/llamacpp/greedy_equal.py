"""Greedy continuations of moestream against a running llama-server on the same GGUF: token for token.

    llama-server -m MODEL.gguf -t 1 --port 18411 -c 512 &
    python benchmarks/llamacpp/greedy_equal.py MODEL.gguf --port 18411 [--tokens 128] [--model OTHER]

`--model` loads another checkpoint into moestream (the HF directory the GGUF was converted from).
Each prompt is tokenized by moestream and by llama-server alike (the tokens are compared too).
"""

from __future__ import annotations

import argparse
import json
import urllib.request

import moestream

PROMPTS = [
    "def read_config(path):",
    "class LRUCache:",
    "import os\n",
    "for i in range(",
    "The quick brown fox",
]


def greedy(port: int, prompt: str | list[int], tokens: int, **extra: object) -> dict:
    """llama-server's greedy completion of `prompt` (text or token ids): its native /completion answer,
    no prompt cache; `extra`: more fields of the request (n_probs, ...)."""
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "cache_prompt": False, **extra}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode())
    with urllib.request.urlopen(request) as res:
        return json.load(res)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("gguf")
    p.add_argument("--port", type=int, default=18411)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--model", default=None, help="what moestream loads (default: the GGUF)")
    a = p.parse_args()
    same = 0
    with moestream.load(a.model or a.gguf, threads=1) as engine:
        for prompt in PROMPTS:
            llama = greedy(a.port, prompt, a.tokens, return_tokens=True)["tokens"]
            ours = engine.generate(engine.encode(prompt), max_tokens=a.tokens, ignore_eos=True).tokens
            first = next((i for i, (x, y) in enumerate(zip(llama, ours)) if x != y), None)
            same += first is None
            print(f"{prompt!r}: " + ("same" if first is None else f"differs from token {first}"))
    print(f"{same}/{len(PROMPTS)} greedy continuations of {a.tokens} tokens equal llama.cpp's")


if __name__ == "__main__":
    main()
