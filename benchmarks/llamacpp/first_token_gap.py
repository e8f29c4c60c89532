"""The first generated token's log-probabilities of moestream against a running llama-server on the same
GGUF, for prompts of several lengths (token ids, so both see the same tokens): the largest difference
over llama-server's top 3.

    llama-server -m MODEL.gguf -t 1 --port 18411 -c 512 &
    python benchmarks/llamacpp/first_token_gap.py MODEL.gguf [--port 18411]
"""

from __future__ import annotations

import argparse

import torch
from greedy_equal import greedy  # beside this script

import moestream

LENGTHS = [1, 2, 3, 4, 5, 7, 8, 9, 10, 12, 16, 17, 32, 33]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("gguf")
    p.add_argument("--port", type=int, default=18411)
    a = p.parse_args()
    with moestream.load(a.gguf, threads=1) as engine:
        for n in LENGTHS:
            ids = [(37 * i + 11) % 1500 + 20 for i in range(n)]
            top = greedy(a.port, ids, 1, n_probs=3)["completion_probabilities"][0]["top_logprobs"]
            logits, _ = engine.runner(ids, None)
            ours = torch.log_softmax(logits.double(), -1)
            gap = max(abs(float(ours[t["id"]]) - t["logprob"]) for t in top)
            print(f"{n:3d} tokens: largest |log-probability difference| {gap:.2e}")


if __name__ == "__main__":
    main()
