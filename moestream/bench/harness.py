"""`run_bench`: the seed's measurement method against one server, from set-up to results.json.

Order of a run: (root only) set the disk's readahead, drop the page cache, create the memory cgroup;
start the server if we own it (inside the cgroup) and wait until it answers; sample telemetry while the
prompts run one after another, each with the disk's read counter around it; stop the server; summarise,
diff against a baseline, fit time per token against MiB per token, write the report.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from moestream.bench import system
from moestream.bench.client import RequestResult, run_request
from moestream.bench.config import BenchConfig
from moestream.bench.prompts import Prompt, load_prompts
from moestream.bench.report import build_results, write_outputs
from moestream.bench.server import ServerProcess
from moestream.errors import MoestreamError
from moestream.units import format_size


@dataclass
class _Machine:
    """The machine as this run found and changed it, to report (`_prepared_machine` undoes the changes)."""

    device: system.BlockDevice | None = None
    cgroup: system.MemoryCgroup | None = None
    notes: list[str] = field(default_factory=list)


def run_bench(config: BenchConfig) -> dict[str, Any]:
    """Run every prompt once against the server and write results.json, report.md and plots to `out`."""
    prompts = load_prompts(config.prompts)
    config.out.mkdir(parents=True, exist_ok=True)
    with _prepared_machine(config) as machine:
        with _server(config, machine) as (url, server):
            if config.warmup:  # not counted: the experts read, the caches and pools warm
                _run_prompts(config, url, prompts, machine.device, server)
            requests, telemetry = _run_prompts(config, url, prompts, machine.device, server)
            mode_line = server.mode_line() if server is not None else None
            # read while the server still runs: what it held under the limit, and what it read again
            memory = machine.cgroup.stat() if machine.cgroup is not None else {}
        peak = machine.cgroup.peak_bytes() if machine.cgroup is not None else None
        results = build_results(config, requests, telemetry, mode_line, _machine_info(machine, peak, memory))
    write_outputs(config, results)
    return results


@contextlib.contextmanager
def _prepared_machine(config: BenchConfig) -> Iterator[_Machine]:
    machine = _Machine()
    watched = config.disk_of
    machine.device = system.device_for_path(watched) if watched else None
    if watched and machine.device is None:
        machine.notes.append(f"{watched} is not on a block device: bytes read are not counted")
    with contextlib.ExitStack() as changed:  # undone in reverse on every exit path
        if config.readahead_kb is not None:
            system.require_root("--readahead-kb")
            if machine.device is None:
                raise MoestreamError(
                    "--readahead-kb needs the model on a block device (give --model or --disk-of)"
                )
            changed.enter_context(system.readahead_set(machine.device, config.readahead_kb))
        if config.memory_limit is not None:
            system.require_root("--memory-limit")
            machine.cgroup = changed.enter_context(
                system.memory_limited(config.memory_limit, f"moestream-bench-{os.getpid()}")
            )
        elif config.drop_caches:
            system.require_root("--drop-caches")
            system.drop_caches()
        yield machine


@contextlib.contextmanager
def _server(config: BenchConfig, machine: _Machine) -> Iterator[tuple[str, ServerProcess | None]]:
    if config.target is not None:
        yield config.target.rstrip("/").removesuffix("/v1"), None
        return
    assert config.server_argv is not None and config.port is not None
    server = ServerProcess(
        config.server_argv, config.port, config.out / "server.log", machine.cgroup, config.server_env
    )
    try:
        server.wait_ready(config.ready_timeout_s)
        yield server.url, server
    finally:
        server.stop()


def _run_prompts(
    config: BenchConfig,
    url: str,
    prompts: list[Prompt],
    device: system.BlockDevice | None,
    server: ServerProcess | None,
) -> tuple[list[RequestResult], dict[str, Any]]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from moestream.power.telemetry import TelemetrySampler

    counter = device.bytes_read if device is not None else None
    results: list[RequestResult] = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[last]}"),
    )
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    with (
        httpx.Client(base_url=url, timeout=config.request_timeout_s, headers=headers) as client,
        Progress(*columns, console=Console(stderr=True), transient=False) as progress,
        TelemetrySampler() as sampler,
    ):
        config.server_name = _server_kind(client, config.server_name)
        task = progress.add_task(f"bench {config.label or config.server_name}", total=len(prompts), last="")
        for i, prompt in enumerate(prompts):
            try:
                result = run_request(
                    client,
                    i,
                    prompt.text,
                    prompt.lang,
                    config.max_tokens,
                    ignore_eos=config.ignore_eos,
                    endpoint=config.endpoint,
                    read_counter=counter,
                )
            except httpx.HTTPError as exc:
                log = f"; its log ends: {server.log_tail()}" if server is not None else ""
                raise MoestreamError(
                    f"request {i + 1} to {url} failed ({type(exc).__name__}: {exc}){log}"
                ) from None
            results.append(result)
            mib = f", {result.mib_per_token:.0f} MiB/token" if result.mib_per_token is not None else ""
            progress.update(task, advance=1, last=f"decode {result.decode_tok_s:.2f} tok/s{mib}")
        tokens = sum(r.predicted_n for r in results)
    return results, sampler.summary(tokens)


def _server_kind(client: httpx.Client, default: str) -> str:
    """ "moestream" or "llama-server" from GET /v1/models' owned_by (llama-server says "llamacpp")."""
    try:
        models = client.get("/v1/models", timeout=10).json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return default
    owners = {m.get("owned_by") for m in models if isinstance(m, dict)}
    return "moestream" if "moestream" in owners else "llama-server" if "llamacpp" in owners else default


def _machine_info(
    machine: _Machine, peak: int | None, memory: dict[str, int] | None = None
) -> dict[str, Any]:
    device = machine.device
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "device": device.describe() if device is not None else None,
        "readahead_kb": device.readahead_kb() if device is not None else None,
        "notes": machine.notes,
    }
    if machine.cgroup is not None:
        info["cgroup"] = {
            "version": machine.cgroup.version,
            "limit": machine.cgroup.limit,
            "limit_text": format_size(machine.cgroup.limit),
            "peak_bytes": peak,
            "stat": memory or {},
        }
    return info


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()
