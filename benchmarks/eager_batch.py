"""CPU ms per decoded token on the transformers path (`--trunk eager`) with every expert cached: where a
one-token layer's held experts are computed as one batch (`runtime/switch.py`). A 33-token generation
minus a 1-token one (its prefill), per repeat; process CPU time, which a shared machine disturbs less
than the wall clock at 1 thread.

    python benchmarks/eager_batch.py MODEL.gguf [--cache 2GiB] [--repeats 3]

Run it against two trees alternately with PYTHONPATH=<tree> to compare them.
"""

from __future__ import annotations

import argparse
import time

import moestream


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--cache", default="2GiB")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    with moestream.load(a.model, cache=a.cache, threads=1, trunk="eager") as engine:
        ids = list(range(5, 25))
        engine.generate(ids, max_tokens=8, ignore_eos=True)
        per_token = []
        for _ in range(a.repeats):
            start = time.process_time()
            gen = engine.generate(ids, max_tokens=33, ignore_eos=True)
            decode = time.process_time() - start
            start = time.process_time()
            engine.generate(ids, max_tokens=1, ignore_eos=True)
            per_token.append((decode - (time.process_time() - start)) / 32 * 1e3)
        print(
            f"CPU ms/token {[round(t, 2) for t in per_token]}; one-batch layer forwards "
            f"{engine.runtime.layer_calls}; tokens {gen.tokens[:6]}"
        )


if __name__ == "__main__":
    main()
