"""What one benchmark run is asked to do."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moestream.errors import MoestreamError


@dataclass
class BenchConfig:
    """Everything one run needs. Either `target` (a running server) or `server_argv` + `port` (ours)."""

    out: Path
    prompts: str = "builtin"
    max_tokens: int = 256
    target: str | None = None
    server_argv: list[str] | None = None
    port: int | None = None
    server_name: str = "moestream"
    api_key: str | None = None
    endpoint: str = "/v1/completions"  # or llama-server's native "/completion"
    disk_of: str | None = None  # a path on the disk whose reads are counted (the model)
    memory_limit: int | None = None
    readahead_kb: int | None = None
    drop_caches: bool = False
    ignore_eos: bool = True
    baseline: str | None = None
    fit_with: list[str] = field(default_factory=list)
    label: str = ""
    ready_timeout_s: float = 900.0
    request_timeout_s: float = 3600.0
    server_env: dict[str, str] | None = None
    plots: bool = True
    warmup: bool = False  # run every prompt once before the measured pass (compute-only comparisons)

    def __post_init__(self) -> None:
        if (self.target is None) == (self.server_argv is None):
            raise MoestreamError("give either --target URL or --model PATH, not both and not neither")
        if self.max_tokens < 2:
            raise MoestreamError(
                f"--max-tokens must be at least 2 (decode speed needs two tokens), got {self.max_tokens}"
            )
        if self.target is not None and self.memory_limit is not None:
            raise MoestreamError(
                "--memory-limit cannot limit a server this command did not start; use --model "
                "PATH, or start the target inside a cgroup yourself"
            )
