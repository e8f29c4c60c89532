"""llama-server's `timings` object, a `moe` object and OpenAI `usage`, from one request's GenerationStats.

Convention (llama.cpp's): the prompt phase is the prompt forward plus sampling the first token; the
predicted phase is the time after the first token. So prompt_ms is the engine's prefill seconds,
predicted_n counts every generated token (N) and predicted_ms covers tokens 2..N, which makes
predicted_per_second = N / predicted_ms, exactly what llama-server reports. `moestream generate` prints
decode tok/s = (N - 1) / the same seconds; `predicted_n - 1` over `predicted_ms` reproduces it.
"""

from __future__ import annotations

from typing import Any

from moestream.engine.requests import Generation


def _per(count: int, ms: float) -> tuple[float, float]:
    """(ms per item, items per second); 0 where undefined rather than inf or NaN, which JSON cannot carry."""
    per_item = ms / count if count else 0.0
    per_second = 1000.0 * count / ms if ms > 0 else 0.0
    return per_item, per_second


def timings(gen: Generation) -> dict[str, Any]:
    """llama-server's field names and meanings: cache_n prompt tokens came from the prompt cache and
    prompt_n were computed (so cache_n + prompt_n is the whole prompt, usage.prompt_tokens)."""
    prompt_ms = 1000.0 * gen.stats.prefill.seconds
    predicted_ms = 1000.0 * gen.stats.decode.seconds
    prompt_n, predicted_n = gen.prompt_tokens - gen.cached_tokens, len(gen.tokens)
    prompt_per_token_ms, prompt_per_second = _per(prompt_n, prompt_ms)
    predicted_per_token_ms, predicted_per_second = _per(predicted_n, predicted_ms)
    return {
        "cache_n": gen.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_per_token_ms,
        "prompt_per_second": prompt_per_second,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_per_token_ms,
        "predicted_per_second": predicted_per_second,
    }


def moe(gen: Generation) -> dict[str, Any]:
    """What the expert cache did for this request (prompt and generation together)."""
    s = gen.stats
    return {
        "bytes_read": s.bytes_read,
        "hits": s.hits,
        "misses": s.misses,
        "hit_rate": s.hit_rate,
        "read_wait_ms": s.read_wait_ms,
    }


def usage(gen: Generation) -> dict[str, int]:
    """OpenAI's token counts (prompt_tokens: the whole prompt, cached or not)."""
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": len(gen.tokens),
        "total_tokens": gen.prompt_tokens + len(gen.tokens),
    }
