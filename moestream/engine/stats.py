"""Per-request statistics in physical units: tokens, seconds, bytes, hits, waits."""

from __future__ import annotations

from dataclasses import asdict, dataclass

MiB = 1 << 20


@dataclass
class TierCounters:
    """A GPU tier's cumulative counts (ggml's backend, `engine/gpu_tier.py`): experts a layer found in
    their device slots (hits), experts copied there first from the host cache (misses), and the bytes
    those copies uploaded."""

    hits: int = 0
    misses: int = 0
    bytes_uploaded: int = 0
    # misses copied into spare slots for one graph only, not kept (exclusive tiers: `GpuTier.lend`)
    lent: int = 0
    # the way of a miss now ("upload", "host", "split"; under MOESTREAM_TIER_MISSES=auto, its trial's
    # choice and times, or "auto: on trial"); not summed
    way: str = ""


@dataclass
class PhaseStats:
    """One phase (prefill or decode) of one request."""

    tokens: int = 0
    seconds: float = 0.0
    bytes_read: int = 0
    hits: int = 0
    misses: int = 0
    read_wait_s: float = 0.0
    prefetches: int = 0  # experts read ahead of their layer
    prefetch_used: int = 0  # of those, asked for by their layer
    # a GPU tier on ggml's backend (zeros without one): its hits, misses and bytes uploaded to it
    device_hits: int = 0
    device_misses: int = 0
    device_bytes: int = 0
    device_way: str = ""  # the tier's way of a miss at the phase's end

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Counters:
    """A snapshot of the engine's cumulative counters."""

    bytes_read: int
    hits: int
    misses: int
    read_wait_s: float
    prefetches: int = 0
    prefetch_used: int = 0
    tier: TierCounters | None = None  # a GPU tier's, where the runner has one

    def since(self, earlier: Counters, tokens: int, seconds: float) -> PhaseStats:
        now, then = self.tier or _NO_TIER, earlier.tier or _NO_TIER
        return PhaseStats(
            tokens,
            seconds,
            self.bytes_read - earlier.bytes_read,
            self.hits - earlier.hits,
            self.misses - earlier.misses,
            self.read_wait_s - earlier.read_wait_s,
            self.prefetches - earlier.prefetches,
            self.prefetch_used - earlier.prefetch_used,
            now.hits - then.hits,
            now.misses - then.misses,
            now.bytes_uploaded - then.bytes_uploaded,
            now.way,
        )


_NO_TIER = TierCounters()  # the counts of a runner without a GPU tier (read only: `since`, each token)


@dataclass
class GenerationStats:
    """Both phases of a request, and the figures the CLI and server print."""

    prefill: PhaseStats
    decode: PhaseStats
    gpu_floor: str = "off"  # "off" (no floor applies), "active" (raised during the run) or "inactive"

    @property
    def bytes_read(self) -> int:
        return self.prefill.bytes_read + self.decode.bytes_read

    @property
    def hits(self) -> int:
        return self.prefill.hits + self.decode.hits

    @property
    def misses(self) -> int:
        return self.prefill.misses + self.decode.misses

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def read_wait_ms(self) -> float:
        return 1000 * (self.prefill.read_wait_s + self.decode.read_wait_s)

    @property
    def device_tier(self) -> dict | None:
        """The GPU tier's figures (None where no expert went through one): its hit rate, and the bytes
        uploaded to it per decoded token."""
        p, d = self.prefill, self.decode
        hits, misses = p.device_hits + d.device_hits, p.device_misses + d.device_misses
        if not hits + misses:
            return None
        decoded = d.device_hits + d.device_misses
        return {
            "hit_rate": hits / (hits + misses),
            "decode_hit_rate": d.device_hits / decoded if decoded else 0.0,
            "bytes_uploaded": p.device_bytes + d.device_bytes,
            "decode_mib_uploaded_per_token": d.device_bytes / MiB / max(1, d.tokens),
            "way": d.device_way or p.device_way,
        }

    def to_dict(self) -> dict:
        tier = self.device_tier
        return ({"device_tier": tier} if tier is not None else {}) | {
            "prefill_tok_s": self.prefill.tok_s,
            "decode_tok_s": self.decode.tok_s,
            "bytes_read": self.bytes_read,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "read_wait_ms": self.read_wait_ms,
            "gpu_floor": self.gpu_floor,
            "mib_per_token": self.decode.bytes_read / MiB / max(1, self.decode.tokens),
            "prefill": asdict(self.prefill),
            "decode": asdict(self.decode),
        }

    def line(self) -> str:
        """The stats line printed after a generation."""
        decode_tokens = max(1, self.decode.tokens)
        return (
            f"prefill {self.prefill.tok_s:.2f} tok/s ({self.prefill.tokens} tok) | "
            f"decode {self.decode.tok_s:.2f} tok/s ({self.decode.tokens} tok) | "
            f"read {self.bytes_read / MiB:.1f} MiB "
            f"({self.decode.bytes_read / MiB / decode_tokens:.1f} MiB/token decoding) | "
            f"hit rate {100 * self.hit_rate:.1f}% | "
            f"read wait {1000 * self.decode.read_wait_s / decode_tokens:.1f} ms/token | "
            + (
                f"prefetched {self.decode.prefetches} ({self.decode.prefetch_used} used) | "
                if self.decode.prefetches
                else ""
            )
            + f"gpu floor {self.gpu_floor}"
            + self._tier_words()
        )

    def _tier_words(self) -> str:
        tier = self.device_tier
        if tier is None:
            return ""
        return (
            f" | gpu tier hit rate {100 * tier['decode_hit_rate']:.1f}% decoding, "
            f"{tier['decode_mib_uploaded_per_token']:.1f} MiB/token uploaded"
            + (f", misses: {tier['way']}" if tier["way"] else "")
        )
