"""Settings of the `moestream gpu-floor` daemon: defaults, the /etc/default file, validation.

The daemon runs as root and turns these settings into a bpftrace program, so every value is checked
against a whitelist of what a path, a symbol name, a command-line flag or a number can contain. Anything
else (quotes, semicolons, braces, whitespace, newlines, colons) is refused before it gets near bpftrace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path

DEFAULTS_FILE = "/etc/default/moestream-gpu-floor"

# fullmatch everywhere: a "$" anchor would let a trailing newline through.
PATH_RE = re.compile(r"/[A-Za-z0-9._+/-]{1,4095}")
PATTERN_RE = re.compile(r"/[A-Za-z0-9._+/*?-]{1,4095}")  # a path that may hold glob wildcards
SYMBOL_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
FLAG_RE = re.compile(r"--?[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
NUMBER_RE = re.compile(r"[0-9]{1,6}(\.[0-9]{1,6})?")
PROGRAM_NAME_RE = re.compile(r"[A-Za-z0-9._+-]{1,255}")  # an executable looked up on PATH

DEFAULT_LIBRARIES: tuple[str, ...] = (
    "/usr/local/lib/libllama.so",
    "/usr/lib/libllama.so",
    "/usr/lib/aarch64-linux-gnu/libllama.so",
    "/opt/llama.cpp/build/bin/libllama.so",
    "/root/llama.cpp/build/bin/libllama.so",
    "/home/*/llama.cpp/build/bin/libllama.so",
)
DEFAULT_MOE_FLAGS: tuple[str, ...] = ("--cpu-moe", "-cmoe", "--n-cpu-moe", "-ncmoe")
# llama_process is asynchronous and its work may finish inside llama_synchronize: all three are activity.
DEFAULT_SYMBOLS: tuple[str, ...] = ("llama_decode", "llama_process", "llama_synchronize")

# keys of the defaults file -> DaemonSettings field
FILE_KEYS: dict[str, str] = {
    "GPU_FLOOR_MHZ": "floor_mhz",
    "HOLD_SECONDS": "hold_s",
    "LIBRARIES": "libraries",
    "MOE_FLAGS": "moe_flags",
    "SYMBOLS": "symbols",
    "BPFTRACE": "bpftrace",
}


def _check_all(name: str, values: tuple[str, ...], pattern: re.Pattern[str], what: str) -> None:
    if not values:
        raise ValueError(f"{name} is empty; give at least one {what}")
    for value in values:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            raise ValueError(f"{name}: {value!r} is not an acceptable {what}")


@dataclass(frozen=True)
class DaemonSettings:
    """What the daemon watches and how it sets the floor. Validated on construction (ValueError)."""

    floor_mhz: float | None = None  # None: the highest frequency the board allows
    hold_s: float = 1.0
    libraries: tuple[str, ...] = DEFAULT_LIBRARIES
    moe_flags: tuple[str, ...] = DEFAULT_MOE_FLAGS
    symbols: tuple[str, ...] = DEFAULT_SYMBOLS
    bpftrace: str = "bpftrace"
    recheck_s: float = 5.0

    def __post_init__(self) -> None:
        if self.floor_mhz is not None and not 0 < self.floor_mhz < 100_000:
            raise ValueError(f"floor must be a frequency in MHz, got {self.floor_mhz}")
        if not 0 <= self.hold_s <= 3600:
            raise ValueError(f"hold time must be between 0 and 3600 s, got {self.hold_s}")
        if not 0.1 <= self.recheck_s <= 3600:
            raise ValueError(
                f"library re-check interval must be between 0.1 and 3600 s, got {self.recheck_s}"
            )
        _check_all("LIBRARIES", self.libraries, PATTERN_RE, "absolute library path")
        _check_all("MOE_FLAGS", self.moe_flags, FLAG_RE, "command-line flag")
        _check_all("SYMBOLS", self.symbols, SYMBOL_RE, "symbol name")
        if not (PATH_RE.fullmatch(self.bpftrace) or PROGRAM_NAME_RE.fullmatch(self.bpftrace)):
            raise ValueError(f"BPFTRACE: {self.bpftrace!r} is not an acceptable program path")


def parse_number(name: str, text: str) -> float:
    """A plain decimal number such as "1020" or "1.5"; ValueError naming `name` otherwise."""
    if not NUMBER_RE.fullmatch(text):
        raise ValueError(f"{name}: {text!r} is not a plain number")
    return float(text)


def read_defaults_file(path: str | Path) -> dict[str, str]:
    """KEY=VALUE lines of the defaults file (no shell: no expansion, only surrounding quotes stripped).

    A missing file gives {}. Raises ValueError for a malformed line or an unknown key.
    """
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in FILE_KEYS:
            raise ValueError(f"{path}:{number}: expected one of {', '.join(FILE_KEYS)} as KEY=VALUE")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[key] = value
    return values


def build_settings(file_values: dict[str, str], overrides: dict[str, object] | None = None) -> DaemonSettings:
    """Settings from the defaults file's values, then command-line `overrides` (field name -> value;
    None means "not given"). Raises ValueError naming the bad setting."""
    kwargs: dict[str, object] = {}
    for key, value in file_values.items():
        field_name = FILE_KEYS[key]
        if field_name in ("libraries", "moe_flags", "symbols"):
            kwargs[field_name] = tuple(value.split())
        elif field_name == "floor_mhz":
            kwargs[field_name] = None if value.lower() in ("", "max") else parse_number(key, value)
        elif field_name == "hold_s":
            kwargs[field_name] = parse_number(key, value)
        else:
            kwargs[field_name] = value
    known = {f.name for f in fields(DaemonSettings)}
    for name, value in (overrides or {}).items():
        if name not in known:
            raise ValueError(f"unknown setting {name}")
        if value is not None:
            kwargs[name] = tuple(value) if isinstance(value, list) else value
    return DaemonSettings(**kwargs)  # type: ignore[arg-type]


def render_defaults_file(settings: DaemonSettings) -> str:
    """The text `moestream gpu-floor install` writes to /etc/default/moestream-gpu-floor."""
    floor = "max" if settings.floor_mhz is None else f"{settings.floor_mhz:g}"
    return "\n".join(
        [
            "# moestream gpu-floor settings (KEY=VALUE; read by the daemon itself, never by a shell).",
            "# GPU_FLOOR_MHZ: floor while llama.cpp computes MoE experts on the CPU; max = highest "
            "available.",
            f"GPU_FLOOR_MHZ={floor}",
            "# HOLD_SECONDS: keep the floor this long after the last call returned.",
            f"HOLD_SECONDS={settings.hold_s:g}",
            "# LIBRARIES: libllama.so paths to probe, space separated; * and ? match as in a shell glob.",
            f'LIBRARIES="{" ".join(settings.libraries)}"',
            "# MOE_FLAGS: only processes whose command line holds one of these are counted.",
            f'MOE_FLAGS="{" ".join(settings.moe_flags)}"',
            "# SYMBOLS: exported functions whose calls count as inference activity.",
            f'SYMBOLS="{" ".join(settings.symbols)}"',
            f"BPFTRACE={settings.bpftrace}",
            "",
        ]
    )
