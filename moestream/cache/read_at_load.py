"""Read every expert into the cache at load, when the cache has a slot for each (`holds_all`)."""

from __future__ import annotations

from moestream.cache.expert_cache import ExpertCache


def read_all(cache: ExpertCache) -> int:
    """Read every expert not yet in place, layer by layer (each layer's reads in flight together),
    when `cache.holds_all()`; the reads count as misses. Returns the bytes read. If this raises (a
    failed read), what was read stays and the cache stays usable."""
    if not cache.holds_all():
        raise ValueError("read_all needs a slot for every expert")
    before = cache.stats.miss_bytes
    kinds = len(cache.emap.kinds)
    for layer in cache.emap.layers:
        experts = sorted(e for (lay, e) in cache.emap.units if lay == layer)
        job = cache.open_layer(layer, experts)
        try:
            landed = dict.fromkeys(experts, 0)
            left = len(experts)
            while left:
                expert, _, failure = job.next_event()
                if failure is not None:
                    raise failure
                landed[expert] += 1
                if landed[expert] == kinds:
                    job.release(expert)
                    left -= 1
        except BaseException:
            cache.abandon(job)
            raise
    return cache.stats.miss_bytes - before
