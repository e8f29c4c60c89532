"""Nothing a user runs on local files reaches for the Hugging Face Hub or any other host (only `-hf` may).

Every verb, on every family's tiny safetensors checkpoint (gpt-oss's MXFP4 included: transformers 5.25's
MXFP4 quantizer fetches a Triton kernel from the hub when it is asked to keep the blocks) and on GGUF
files, runs in child processes that are online as far as huggingface_hub knows (HF_HUB_OFFLINE unset),
with the hub's endpoint a recording server on 127.0.0.1 and an audit hook (a `sitecustomize` on
PYTHONPATH, so `bench`'s own server child has it too) that logs and refuses every connection and name
lookup outside loopback. A run passes when every verb exits 0, the hub saw no request and nothing
tried to leave the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fake_hub import FakeHub
from tiny_models import ARCHS

pytest.importorskip("pyarrow")
pytest.importorskip("httpx")

AUDIT = textwrap.dedent(
    """
    import os, sys

    _LOG = os.environ["MOESTREAM_AUDIT_LOG"]
    _LOOPBACK = ("127.", "::1", "localhost")

    def _outside(host):
        return isinstance(host, str) and host and not host.startswith(_LOOPBACK)

    def _hook(event, args):
        host = None
        if event == "socket.connect" and isinstance(args[1], tuple):
            host = args[1][0]
        elif event == "socket.getaddrinfo":
            host = args[0].decode() if isinstance(args[0], bytes) else args[0]
        if _outside(host):
            with open(_LOG, "a") as log:
                log.write(f"{os.getpid()} {event} {host} {sys.argv[:3]}\\n")
            raise OSError(f"the test forbids connections outside loopback ({host})")

    sys.addaudithook(_hook)
    """
)

# In one child: each argv through moestream's own `main`, its exit status recorded (stdout kept apart).
DRIVER = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from moestream.cli import main

    results = []
    for argv in json.loads(sys.argv[1]):
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
        results.append([argv[0], argv[1] if len(argv) > 1 else "", rc])
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def offline_env(tmp_path_factory):
    """An environment online to huggingface_hub, its endpoint a recording FakeHub, the audit hook on."""
    root = tmp_path_factory.mktemp("audit")
    (root / "sitecustomize.py").write_text(AUDIT)
    log = root / "audit.log"
    log.touch()
    with FakeHub() as hub:
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        env.update(
            PYTHONPATH=os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            MOESTREAM_AUDIT_LOG=str(log),
            HF_ENDPOINT=hub.url,
            HF_HOME=str(root / "hf-home"),
            HF_HUB_DISABLE_TELEMETRY="0",
        )
        yield env, hub, log


def _run(env: dict, argvs: list[list[str]], cwd: Path) -> tuple[list[list], str]:
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(argvs)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _assert_clean(run: tuple[list[list], str], hub: FakeHub, log: Path) -> None:
    results, stderr = run
    failed = [r for r in results if r[2] != 0]
    assert not failed, f"{failed}\n{stderr[-2000:]}"
    assert hub.requests == [], hub.requests
    assert log.read_text() == ""


def test_every_family_and_file_type_stays_off_the_hub(offline_env, tiny_dir, tiny_gguf, tmp_path):
    env, hub, log = offline_env
    gen = ["-p", "hello", "-n", "3", "--cache", "1MiB", "--json"]
    argvs = []
    for arch in ARCHS:
        path = str(tiny_dir(arch))
        argvs += [["generate", path, *gen], ["info", path, "--json"]]
    for arch in ("qwen3_moe", "gpt_oss", "deepseek_v2"):
        _, gguf_file = tiny_gguf(arch)
        argvs += [["generate", str(gguf_file), *gen], ["info", str(gguf_file), "--json"]]
    _assert_clean(_run(env, argvs, tmp_path), hub, log)


def test_every_verb_stays_off_the_hub(offline_env, tiny_dir, tmp_path):
    env, hub, log = offline_env
    path = str(tiny_dir("qwen3_moe"))
    mx = str(tiny_dir("gpt_oss_mxfp4"))
    trace, text = tmp_path / "t.parquet", tmp_path / "text.txt"
    text.write_text("hello world, the quick brown fox. " * 20)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    small = ["--layers", "2", "--experts", "8", "--top-k", "2", "--hidden", "64", "--moe-intermediate", "64"]
    argvs = [
        ["generate", mx, "-p", "hi", "-n", "3", "--cache", "1MiB", "--trace", str(trace)],
        ["simulate", str(trace), "--budgets", "64KiB,256KiB", "--json"],
        ["predict-eval", str(trace), "--json"],
        ["trace-convert", str(trace), str(tmp_path / "t.jsonl")],
        ["plan", "-m", path, "-p", "hello", "-n", "4", "--budgets", "1MiB,2MiB", "--json"],
        ["perplexity", "-m", path, "--text", str(text), "--ctx", "32", "--chunks", "1", "--json"],
        ["synth", str(tmp_path / "syn"), "--arch", "gpt_oss", *small, "--mxfp4"],
        [
            "synth",
            str(tmp_path / "syn.gguf"),
            "--format",
            "gguf",
            "--quant",
            "Q8_0",
            "--arch",
            "qwen3_moe",
            *small,
        ],
        ["demo", "--dir", str(tmp_path / "syn"), "--cache", "1MiB", "--max-tokens", "4"],
        [
            "bench",
            "-m",
            mx,
            "--cache",
            "1MiB",
            "--max-tokens",
            "4",
            "--prompts",
            str(prompts),
            "--no-plots",
            "--out",
            str(tmp_path / "bench"),
        ],
    ]
    _assert_clean(_run(env, argvs, tmp_path), hub, log)
    chat = subprocess.run(
        [sys.executable, "-m", "moestream", "chat", mx, "-n", "4", "--cache", "1MiB"],
        input="hello\n",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert chat.returncode == 0, chat.stderr[-2000:]
    _assert_clean(([], ""), hub, log)


def test_the_audit_catches_a_reach_for_the_hub(offline_env, tmp_path):
    """The check itself: `-hf` (the one verb option that is meant to reach the hub) is seen by both."""
    env, hub, log = offline_env
    results, _ = _run(env, [["info", "-hf", "someone/some-model-GGUF", "--json"]], tmp_path)
    assert results[0][2] != 0  # the fake hub has no such repository
    assert hub.requests, "the recording hub saw nothing"
    hub.requests.clear()
    probe = textwrap.dedent(
        """
        import socket
        try:
            socket.create_connection(("huggingface.co", 443), timeout=5)
        except OSError:
            pass
        """
    )
    subprocess.run([sys.executable, "-c", probe], env=env, check=True, timeout=60)
    assert "socket.getaddrinfo huggingface.co" in log.read_text()
    log.write_text("")
