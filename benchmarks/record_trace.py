"""Record a router trace (with stale-gate predictions) of a checkpoint over a fixed prompt set.

The engine's routing does not depend on the cache budget (outputs are exact), so one recording with a
cache that holds every expert serves every budget in `moestream simulate`. Greedy decoding, EOS ignored,
one request at a time.

    .venv/bin/python benchmarks/record_trace.py ../shared/fixtures/stdlib-moe-8x64 OUT.parquet \
        [--prompts code|builtin|FILE] [--max-tokens 128]

`code` is 12 openings of Python source (the fixture was trained on the Python standard library, so these
are in-distribution for it); `builtin` is the bench harness's 12 Korean/English prompts.
"""

from __future__ import annotations

import argparse
import time

CODE_PROMPTS = (
    "def read_config(path):\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    'class LRUCache:\n    """A least recently used cache."""\n\n    def __init__(self, maxsize):\n',
    "    def __repr__(self):\n        return",
    "try:\n    import _thread\nexcept ImportError:\n",
    'def _parse_header(line):\n    """Parse a Content-type like header.\n\n',
    "    for i, item in enumerate(items):\n        if",
    "from collections import namedtuple\n\n",
    "if __name__ == '__main__':\n",
    '    def close(self):\n        """Close the file."""\n',
    "def quote(s, safe='/'):\n",
    "class Error(Exception):\n    pass\n\n\nclass",
)


def main() -> None:
    import moestream
    from moestream.bench.prompts import load_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--prompts", default="code")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--cache", default="4GiB", help="large enough for every expert: recording is budget-free"
    )
    args = parser.parse_args()
    prompts = list(CODE_PROMPTS) if args.prompts == "code" else [p.text for p in load_prompts(args.prompts)]
    start = time.perf_counter()
    with moestream.load(args.model, cache=args.cache) as engine:
        engine.start_trace(args.out)
        for i, prompt in enumerate(prompts):
            engine.generate(prompt, max_tokens=args.max_tokens, ignore_eos=True, request_id=f"p{i:02d}")
    print(
        f"recorded {len(prompts)} prompts x {args.max_tokens} tokens to {args.out} "
        f"in {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
