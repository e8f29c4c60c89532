"""Settings validation and bpftrace program construction: only whitelisted text reaches bpftrace."""

from __future__ import annotations

from pathlib import Path

import pytest

from moestream.errors import MoestreamError
from moestream.power.bpftrace import Event, bpftrace_argv, build_program, parse_event
from moestream.power.library import LibraryRef, resolve_libraries
from moestream.power.settings import DaemonSettings, build_settings, read_defaults_file, render_defaults_file
from moestream.power.testing import write_fake_elf

MALICIOUS_PATHS = [
    '/usr/lib/libllama.so"; system("rm -rf /"); //',
    '/usr/lib/libllama.so\nuprobe:/bin/bash:readline { system("id") }',
    "/usr/lib/libllama.so\n",  # a "$" anchor would let this through
    "/usr/lib/lib llama.so",
    "/usr/lib/libllama.so:main",
    "/usr/lib/libllama.so { exit(); }",
    "relative/libllama.so",
    "",
]


@pytest.mark.parametrize("path", MALICIOUS_PATHS)
def test_bad_library_paths_are_refused(path: str) -> None:
    with pytest.raises(ValueError, match="LIBRARIES"):
        DaemonSettings(libraries=(path,))


@pytest.mark.parametrize(
    "symbol", ["llama_decode; system", "llama decode", "1llama", "llama_decode\n", "a{b}"]
)
def test_bad_symbols_are_refused(symbol: str) -> None:
    with pytest.raises(ValueError, match="SYMBOLS"):
        DaemonSettings(symbols=(symbol,))


@pytest.mark.parametrize("flag", ["cpu-moe", "--cpu moe", "--x;y", "-", "--a\n"])
def test_bad_flags_are_refused(flag: str) -> None:
    with pytest.raises(ValueError, match="MOE_FLAGS"):
        DaemonSettings(moe_flags=(flag,))


@pytest.mark.parametrize(
    "key,value",
    [
        ("GPU_FLOOR_MHZ", "1020; reboot"),
        ("GPU_FLOOR_MHZ", "1e3"),
        ("HOLD_SECONDS", "-1"),
        ("HOLD_SECONDS", "1\n2"),
    ],
)
def test_bad_numbers_are_refused(key: str, value: str) -> None:
    with pytest.raises(ValueError, match=key):
        build_settings({key: value})


def test_bad_bpftrace_path_is_refused() -> None:
    with pytest.raises(ValueError, match="BPFTRACE"):
        DaemonSettings(bpftrace="bpftrace -e 'x'")
    with pytest.raises(MoestreamError, match="refusing to run"):
        bpftrace_argv("sh -c id", "x")


def test_program_rejects_paths_and_symbols_that_slipped_past_settings() -> None:
    with pytest.raises(MoestreamError, match="refusing to probe"):
        build_program([LibraryRef('/lib/x.so"; system("id")', (0, 0, 0, 0), ("llama_decode",))])
    with pytest.raises(MoestreamError, match="refusing to probe symbol"):
        build_program([LibraryRef("/lib/x.so", (0, 0, 0, 0), ("llama_decode }",))])
    with pytest.raises(MoestreamError, match="no library symbols"):
        build_program([])


def test_program_text_and_argv() -> None:
    program = build_program([LibraryRef("/opt/l/libllama.so", (1, 2, 3, 4), ("llama_decode",))])
    body = 'printf("moestream-floor KIND %d %d llama_decode\\n", pid, tid); }'
    assert program == (
        "uprobe:/opt/l/libllama.so:llama_decode { " + body.replace("KIND", "enter") + "\n"
        "uretprobe:/opt/l/libllama.so:llama_decode { " + body.replace("KIND", "exit") + "\n"
    )
    assert bpftrace_argv("/usr/bin/bpftrace", program) == ["/usr/bin/bpftrace", "-B", "line", "-e", program]


def test_event_lines() -> None:
    assert parse_event("moestream-floor enter 4242 4250 llama_decode") == Event(
        "enter", 4242, 4250, "llama_decode"
    )
    assert parse_event("moestream-floor exit 1 1 llama_synchronize\n") == Event(
        "exit", 1, 1, "llama_synchronize"
    )
    for other in (
        "Attaching 6 probes...",
        "moestream-floor enter x 1 llama_decode",
        "moestream-floor leave 1 1 llama_decode",
        "moestream-floor enter 1 1 a b",
    ):
        assert parse_event(other) is None


def test_defaults_file_round_trip_and_overrides(tmp_path: Path) -> None:
    custom = DaemonSettings(
        floor_mhz=918,
        hold_s=2.5,
        libraries=("/opt/a/libllama.so", "/home/*/b/libllama.so"),
        moe_flags=("--cpu-moe", "-ot"),
    )
    path = tmp_path / "moestream-gpu-floor"
    path.write_text(render_defaults_file(custom))
    assert build_settings(read_defaults_file(path)) == custom
    merged = build_settings(
        read_defaults_file(path), {"hold_s": 0.5, "moe_flags": ["-ncmoe"], "symbols": None}
    )
    assert merged.hold_s == 0.5 and merged.moe_flags == ("-ncmoe",) and merged.floor_mhz == 918
    assert build_settings({"GPU_FLOOR_MHZ": "max"}).floor_mhz is None
    assert read_defaults_file(tmp_path / "missing") == {}


def test_defaults_file_rejects_unknown_keys_and_never_expands(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("# comment\nFLOOR=1\n")
    with pytest.raises(ValueError, match=":2: expected one of"):
        read_defaults_file(path)
    path.write_text('LIBRARIES="$(id)/libllama.so"\n')
    with pytest.raises(ValueError, match="LIBRARIES"):
        build_settings(read_defaults_file(path))


def test_resolve_libraries_keeps_exported_watched_symbols_only(tmp_path: Path) -> None:
    write_fake_elf(tmp_path / "a/libllama.so", ["llama_decode", "llama_synchronize", "llama_model_load"])
    write_fake_elf(tmp_path / "b/libllama.so", ["ggml_init"])  # exports none of the watched functions
    (tmp_path / "c").mkdir()
    (tmp_path / "c/libllama.so").symlink_to(tmp_path / "a/libllama.so")  # same file twice
    refs = resolve_libraries(
        (str(tmp_path / "*/libllama.so"),), ("llama_decode", "llama_process", "llama_synchronize")
    )
    assert [(r.path, r.symbols) for r in refs] == [
        (str(tmp_path / "a/libllama.so"), ("llama_decode", "llama_synchronize"))
    ]
