"""`moestream chat` driven through a pseudo-terminal as a person uses it: turns typed at the prompt, the
answer read off the screen and compared with `generate`'s (greedy), the prompt cache's reuse read from
/stats, Ctrl-C sent as the terminal's ^C byte (the kernel turns it into SIGINT), /reset, /quit, Ctrl-D."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import transformers as T
from tiny_models import write_tiny

import moestream
from moestream.cli import main
from moestream.engine.chat import render_chat
from moestream.engine.prompt_cache import common_prefix

PROMPT = b">>> "
CONTEXT = 2048  # long enough that an answer to the end of the context is still running when ^C comes
STATS = re.compile(
    rb"prompt (\d+) tok \((\d+) from the prompt cache\) \| answer (\d+) tok \((\w+)\)\r\n"
    rb"prefill [\d.]+ tok/s \((\d+) tok\)"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny("qwen3_moe", tmp_path_factory.mktemp("chat"), max_position_embeddings=CONTEXT)


class Terminal:
    """A process on a pseudo-terminal: what the test types arrives as keystrokes (^C included, which the
    terminal's line discipline turns into SIGINT), and what it reads is what a screen would show."""

    def __init__(self, argv: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: a session of its own with the terminal as its controlling tty
            os.environ["TERM"] = "dumb"  # readline without escape sequences
            os.execv(sys.executable, [sys.executable, "-m", "moestream", *argv])
        self.buffer = b""
        self.status: int | None = None

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def _read(self, deadline: float) -> bool:
        """Append what the screen shows by `deadline`; False at the end of the output."""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child has exited and closed the terminal
            return False
        self.buffer += data
        return bool(data)

    def expect(self, marker: bytes, timeout: float = 60) -> bytes:
        """What the screen shows before `marker`, consumed through it."""
        deadline = time.monotonic() + timeout
        while marker not in self.buffer:
            if not self._read(deadline) or time.monotonic() > deadline:
                raise AssertionError(f"{marker!r} not on the screen; it shows {self.buffer[-2000:]!r}")
        before, _, self.buffer = self.buffer.partition(marker)
        return before

    def some_output(self, timeout: float = 60) -> None:
        """Wait until something more is on the screen."""
        deadline = time.monotonic() + timeout
        while not self.buffer:
            if not self._read(deadline) or time.monotonic() > deadline:
                raise AssertionError("nothing more on the screen")

    def turn(self, text: str) -> bytes:
        """Type a line; what the screen shows after its echo up to the next prompt."""
        self.type(text.encode() + b"\r")
        self.expect(text.encode() + b"\r\n")
        return self.expect(PROMPT)

    def stats(self) -> Stats:
        match = STATS.search(self.turn("/stats"))
        assert match, self.buffer
        return Stats(*(int(x) if x.isdigit() else x.decode() for x in match.groups()))

    def wait(self, timeout: float = 30) -> int:
        """The exit status of the process (it must end by itself within `timeout`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                return self.status
            self._read(time.monotonic() + 0.05)  # keep the terminal drained: a full one blocks the child
        raise AssertionError(f"the chat did not exit; the screen shows {self.buffer[-2000:]!r}")

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


@dataclass
class Stats:
    """The figures of one /stats."""

    prompt: int
    cached: int
    answer: int
    finish: str
    prefill: int


def _screen(text: str) -> bytes:
    """`text` as the terminal shows it (newlines as CR LF), ended by the chat's line break."""
    shown = text.encode().replace(b"\n", b"\r\n")
    return shown if text.endswith("\n") else shown + b"\r\n"


def _chat(model: Path, *options: str) -> list[str]:
    return ["chat", str(model), "--cache", "1MiB", "-t", "1", "--ignore-eos", *options]


def test_two_turns_stream_what_generate_gives_and_the_second_reuses_the_prompt_cache(model, capsys):
    q1, q2 = "Hello there", "And what next?"
    with Terminal(_chat(model, "-n", "8")) as term:  # started first: it loads while this test works
        assert main(["generate", str(model), "--chat", "-p", q1, "-n", "8", "--ignore-eos", "--json"]) == 0
        first = json.loads(capsys.readouterr().out)
        history = [{"role": "user", "content": q1}, {"role": "assistant", "content": first["text"]}]
        messages = [*history, {"role": "user", "content": q2}]
        with moestream.load(str(model), cache="1MiB") as engine:
            second = engine.generate(messages=messages, max_tokens=8, ignore_eos=True)  # a cold run
            ids1, ids2 = engine.encode_messages(history[:1]), engine.encode_messages(messages)
        # the first turn's prompt and answer stay in the KV cache, reused as far as the re-rendered
        # conversation's ids agree with them (the answer's text need not re-tokenize to the same ids)
        reusable = min(common_prefix(ids1 + first["tokens"], ids2), len(ids2) - 1)
        assert reusable >= len(ids1)

        assert b"moestream: qwen3_moe on cpu" in term.expect(PROMPT)
        assert term.turn(q1) == _screen(first["text"])
        assert term.turn(q2) == _screen(second.text)
        stats = term.stats()
        assert stats == Stats(len(ids2), reusable, 8, "length", len(ids2) - reusable)
        assert b"[unknown command /nope (/help lists them)]" in term.turn("/nope")
        assert term.turn("/reset") == b"[new conversation]\r\n"
        assert term.turn(q1) == _screen(first["text"])  # the history is gone: the first answer again
        assert term.stats().prompt == len(ids1)
        term.type(b"/quit\r")
        assert term.wait() == 0


def test_ctrl_c_stops_an_answer_keeps_it_and_the_conversation_goes_on(model):
    tokenizer = T.AutoTokenizer.from_pretrained(model)
    q1, q2 = "Tell me a long story", "Go on"
    without_answer = render_chat(
        tokenizer,
        [
            {"role": "user", "content": q1},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": q2},
        ],
    )
    with Terminal(_chat(model)) as term:  # no -n: every answer may run to the end of the context
        term.expect(PROMPT)
        term.type(q1.encode() + b"\r")
        term.expect(q1.encode() + b"\r\n")
        term.some_output()  # the answer has begun
        term.type(b"\x03")
        term.expect(b"[stopped; the answer so far stays in the conversation]\r\n" + PROMPT)
        stopped = term.stats()
        assert stopped.finish == "cancelled" and 0 < stopped.answer < CONTEXT - stopped.prompt

        term.type(q2.encode() + b"\r")
        term.expect(q2.encode() + b"\r\n")
        term.some_output()
        term.type(b"\x03")
        term.expect(b"[stopped; the answer so far stays in the conversation]\r\n" + PROMPT)
        again = term.stats()
        # the stopped answer is in the conversation, and the KV cache of the stopped turn was reused
        assert again.finish == "cancelled" and again.prompt > len(without_answer)
        assert again.cached >= stopped.prompt and again.prefill == again.prompt - again.cached

        # Ctrl-C at the prompt drops the line, not the session; sent once the line is on the screen (the
        # prompt reading it): a ^C typed ahead of it reaches the process before readline does
        term.type(b"half a line")
        term.expect(b"half a line")
        term.type(b"\x03")
        term.expect(PROMPT)
        assert term.stats() == again
        term.type(b"\x04")  # Ctrl-D
        assert term.wait() == 0


def test_user_errors_are_one_sentence(model, tmp_path, capsys):
    assert main(["chat", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moestream: error: ") and str(tmp_path / "missing") in err
    assert err.count("\n") == 1 and "Traceback" not in err

    bare = shutil.copytree(model, tmp_path / "no-template")
    (bare / "chat_template.jinja").unlink()
    assert main(["chat", str(bare), "--cache", "1MiB"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == (
        "moestream: error: this model's tokenizer has no chat template (give one with --chat-template FILE)"
    )


def test_a_full_context_is_said_and_the_chat_goes_on_from_piped_input(model, monkeypatch, capsys):
    system, q1 = "Be brief.", "Hello there"
    tokenizer = T.AutoTokenizer.from_pretrained(model)
    prompt = len(
        render_chat(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q1}])
    )
    context = prompt + 6  # the first answer fills the context
    # lines read from a pipe, not a terminal: a script can talk to the chat too
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{q1}\nand more\n/stats\n/reset\n{q1}\n/stats\n"))
    assert main(_chat(model, "--system", system, "-c", str(context))) == 0  # the input's end ends it
    out, err = capsys.readouterr()
    assert err.count("[the context is full: /reset starts a new conversation]") == 2
    refused = re.search(
        r"moestream: error: the conversation has (\d+) tokens, the whole context of (\d+) ", err
    )
    assert refused and int(refused[1]) > context and int(refused[2]) == context
    # the refused turn changed nothing: /stats shows the first turn; after /reset (the system message
    # kept) the same prompt again, all but its last token from the prompt cache
    first, again = (m.groups() for m in re.finditer(STATS.pattern.replace(rb"\r\n", rb"\n"), out.encode()))
    assert first == (b"%d" % prompt, b"0", b"6", b"length", b"%d" % prompt)
    assert again == (b"%d" % prompt, b"%d" % (prompt - 1), b"6", b"length", b"1")
