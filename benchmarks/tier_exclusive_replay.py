"""Exclusive against inclusive GPU and host tiers on recorded router traces (learned routing), through
`cache/tiers.py`'s `TieredResidentSet` (what `simulate --gpu-tier` replays; `exclusive=False` is the
engine before the tiers were exclusive: every miss admitted into the tier, nothing demoted), and one
cache of both tiers' slots: the share of decode's routed experts read from disk.

    python benchmarks/tier_exclusive_replay.py TRACE...  # ../shared/traces/*.jsonl
"""

import sys

from moestream.cache.policy import LFUPolicy, LRUPolicy, ResidentSet
from moestream.cache.tiers import TieredResidentSet
from moestream.trace.reader import load_traces
from moestream.trace.replay import build_replay


def decode_read(replay, cache) -> float:
    read = routed = 0
    for i, forward in enumerate(replay.keys):
        hits, misses = cache.access_group(forward, *replay.uses[i])  # each key's uses: the tier's gate
        if replay.cell[i] % 2 == 1:  # decode
            read, routed = read + len(misses), routed + len(hits) + len(misses)
    return read / routed


def main() -> None:
    trace = load_traces(sys.argv[1:])
    replay = build_replay(trace, None, uses=True)
    k, n = trace.header.top_k, len(replay.layers) * replay.n_experts
    print(f"{n} experts, top-{k}, {len(replay.keys)} layer forwards")
    print("host slots | tier slots | policy | exclusive | inclusive | one cache of both")
    for host, tier in [(n // 8, n // 8), (n // 4, n // 8), (n // 4, n // 4), (n // 2, n // 4)]:
        for name, policy in (("lru", LRUPolicy), ("lfu", LFUPolicy)):
            ex = decode_read(replay, TieredResidentSet(host, tier, policy, spare=k, exclusive=True))
            inc = decode_read(replay, TieredResidentSet(host, tier, policy, spare=k, exclusive=False))
            one = decode_read(replay, ResidentSet(host + tier, policy()))
            print(f"{host} | {tier} | {name} | {ex:.3f} | {inc:.3f} | {one:.3f}")


if __name__ == "__main__":
    main()
