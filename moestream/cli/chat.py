"""`moestream chat PATH`: a conversation in the terminal, through the tokenizer's chat template.

Every turn re-renders the whole conversation and runs it with the engine's prompt cache, so only the
tokens new since the previous turn are computed (and their experts read). The answer is streamed to
stdout as it is generated; the mode line and notices go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import select
import signal
import sys
from typing import Any

from moestream.cli._engine_args import (
    add_context_arguments,
    add_engine_arguments,
    add_model_argument,
    engine_kwargs,
    model_path,
    read_chat_template,
    use_chat_template,
)
from moestream.cli._sampling_args import add_sampling_arguments, sampling_params
from moestream.errors import MoestreamError

PROMPT = ">>> "
COMMANDS = """\
/tool TEXT  the result of the model's (oldest unanswered) tool call; with every call answered, the model
        goes on (--tools)
/stats  this turn's prompt (tokens from the prompt cache), speed, bytes read and hit rate
/reset  start a new conversation (the --system message stays)
/quit   exit (so do /exit, /bye and Ctrl-D)
/help   this list
Ctrl-C stops an answer within a token; the part shown stays in the conversation (the next turn sees it).
A second Ctrl-C while the answer is still stopping quits. Ctrl-C at the prompt clears the line."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="talk with a model in the terminal (chat template, prompt cache across turns)",
        description="A multi-turn chat in the terminal: each turn goes through the tokenizer's chat\n"
        "template and reuses the KV cache of the previous one; the answer is streamed as it is generated.",
        epilog="commands:\n" + COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_argument(p)
    p.add_argument("--system", metavar="TEXT", default=None, help="a system message opening the conversation")
    p.add_argument(
        "--tools",
        metavar="FILE",
        default=None,
        help="a JSON list of tools in OpenAI's shape, rendered by the chat template; the model's calls "
        "are shown and /tool TEXT answers them",
    )
    p.add_argument(
        "--tool-choice",
        default="auto",
        metavar="auto|required|none|NAME",
        help="with --tools: let the model choose (default), force a call, or force this function",
    )
    add_sampling_arguments(p, max_tokens=None)
    add_context_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(func=run)


class Conversation:
    """The messages so far and the engine they run on; one `ask` per turn."""

    def __init__(
        self,
        engine: Any,
        params: Any,
        max_tokens: int | None,
        system: str | None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = "auto",
    ) -> None:
        self.engine, self.params, self.max_tokens = engine, params, max_tokens
        self.tools, self.tool_choice = tools, tool_choice
        self.opening = [{"role": "system", "content": system}] if system else []
        self.messages: list[dict[str, Any]] = list(self.opening)
        self.pending: list[Any] = []  # tool calls of the last answer without a result yet
        self.last: Any = None  # the last turn's Generation, for /stats

    def check(self) -> None:
        """Render a first turn, so that a checkpoint without a tokenizer or chat template (or a template
        that rejects a system message, or renders no tools) is refused before the first prompt, in the
        engine's words."""
        from moestream.engine.tools import tool_session

        self.engine.encode_messages([*self.messages, {"role": "user", "content": "Hi"}], None, self.tools)
        tool_session(self.engine.tokenizer, self.tools, self.tool_choice, True)

    def reset(self) -> None:
        self.messages, self.pending = list(self.opening), []

    def ask(self, text: str | None, cancelled: Any) -> Any:
        """Stream the answer to `text` (None: to the tool results just given) to stdout and add both to
        the conversation; the answer stopped by `cancelled` too (what was shown is what the next turn
        sees). Tool calls are shown one a line and wait for /tool."""
        messages = self.messages if text is None else [*self.messages, {"role": "user", "content": text}]
        rendered = self.tools if self.tool_choice != "none" else None
        ids = self.engine.encode_messages(messages, None, rendered)
        params = dataclasses.replace(self.params, max_tokens=self._room(len(ids)))
        gen = None
        for gen in self.engine.stream(
            ids,
            params,
            cache_prompt=True,
            cancelled=cancelled,
            tools=self.tools,
            tool_choice=self.tool_choice,
        ):
            print(gen.piece, end="", flush=True)
        if gen.text and not gen.text.endswith("\n"):
            print(flush=True)
        answer: dict[str, Any] = {"role": "assistant", "content": gen.text}
        if gen.tool_calls:
            answer["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.loads(c.arguments)},
                }
                for c in gen.tool_calls
            ]
            for call in gen.tool_calls:
                print(f"[tool call {call.name} {call.arguments}]", flush=True)
        self.messages, self.pending = [*messages, answer], list(gen.tool_calls)
        self.last = gen
        return gen

    def tool_result(self, text: str) -> bool:
        """Add the result of the oldest unanswered call; True once every call has one (the model then
        goes on).

        Raises:
            MoestreamError: no call waits for a result.
        """
        if not self.pending:
            raise MoestreamError("no tool call waits for a result")
        call = self.pending.pop(0)
        self.messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text})
        return not self.pending

    def _room(self, prompt_n: int) -> int:
        """Tokens the answer may have: -n, at most the context the conversation leaves."""
        room = self.engine.ctx_size - prompt_n
        if room < 1:
            raise MoestreamError(
                f"the conversation has {prompt_n} tokens, the whole context of {self.engine.ctx_size} "
                "(-c/--ctx-size): /reset starts a new one"
            )
        return room if self.max_tokens is None else min(self.max_tokens, room)

    def stats(self) -> str:
        """The last turn's prompt and answer sizes and the engine's stats line."""
        gen = self.last
        if gen is None:
            return "no answer yet"
        return (
            f"prompt {gen.prompt_tokens} tok ({gen.cached_tokens} from the prompt cache) | "
            f"answer {len(gen.tokens)} tok ({gen.finish_reason})\n{gen.stats.line()}"
        )


class StopOnInterrupt:
    """SIGINT while an answer runs: the first asks the engine to stop after the current token (a forward
    interrupted half-way would leave its KV cache unusable), a second one quits."""

    def __init__(self) -> None:
        self.requested = False

    def __enter__(self) -> StopOnInterrupt:
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.signal(signal.SIGINT, self.previous)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __call__(self) -> bool:
        return self.requested


def run(args: argparse.Namespace) -> int:
    import moestream

    # checked before the model loads, which can take minutes; max_tokens is set per turn
    params = sampling_params(args, max_tokens=args.max_tokens or 1)
    path, template = model_path(args), read_chat_template(args)
    tools, choice = _tools(args)
    with moestream.load(path, **engine_kwargs(args)) as engine:
        use_chat_template(engine, template)
        chat = Conversation(engine, params, args.max_tokens, args.system, tools, choice)
        chat.check()
        print(engine.mode_line(), file=sys.stderr, flush=True)
        _note("/help lists the commands; Ctrl-C stops an answer, Ctrl-D or /quit exits")
        return _loop(chat)


def _tools(args: argparse.Namespace) -> tuple[list[dict[str, Any]] | None, Any]:
    """--tools (a JSON list read from the file) and --tool-choice (a function's name: that function)."""
    choice = (
        args.tool_choice if args.tool_choice in ("auto", "required", "none") else {"name": args.tool_choice}
    )
    if args.tools is None:
        if args.tool_choice != "auto":
            raise MoestreamError("--tool-choice needs --tools")
        return None, "auto"
    try:
        with open(args.tools, encoding="utf-8") as f:
            tools = json.load(f)
    except OSError as exc:
        raise MoestreamError(f"cannot read {args.tools}: {exc.strerror}") from None
    except ValueError as exc:
        raise MoestreamError(f"{args.tools} is not JSON: {exc}") from None
    if not isinstance(tools, list):
        raise MoestreamError(f"{args.tools} must hold a JSON list of tools")
    return tools, choice


def _read_line(prompt: str) -> str:
    """input(), but a Ctrl-C reaches it whichever thread the kernel hands the signal to: Python's C-level
    handler writes to a wakeup pipe that this select waits on beside stdin, so the main thread wakes
    and raises KeyboardInterrupt (a plain blocking read, or readline's, waited on for the next key:
    1 run in 4 of the pty test hung under load). The terminal's own line editing stays."""
    try:
        sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (io.UnsupportedOperation is an OSError)
        return input(prompt)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    previous = signal.set_wakeup_fd(wake_w)
    try:
        while True:
            ready, _, _ = select.select([sys.stdin, wake_r], [], [])
            if wake_r in ready:
                os.read(wake_r, 512)  # the handler (KeyboardInterrupt) runs as this returns to Python
            if sys.stdin in ready:
                line = sys.stdin.readline()
                if not line:
                    raise EOFError
                return line
    finally:
        signal.set_wakeup_fd(previous)
        os.close(wake_r)
        os.close(wake_w)


def _loop(chat: Conversation) -> int:
    # a chat answers Ctrl-C even when started with SIGINT ignored (a shell's background job, nohup'ed
    # scripts): Python then keeps it ignored, and the prompt would never see it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    while True:
        try:
            line = _read_line(PROMPT).strip()
        except EOFError:
            print(flush=True)
            return 0
        except KeyboardInterrupt:
            print(flush=True)
            continue
        if line in ("/quit", "/exit", "/bye"):
            return 0
        if line.startswith("/"):
            _command(chat, line)
        elif line:
            _turn(chat, line)


def _command(chat: Conversation, line: str) -> None:
    if line == "/stats":
        print(chat.stats(), flush=True)
    elif line == "/reset":
        chat.reset()
        _note("new conversation")
    elif line == "/help":
        print(COMMANDS, flush=True)
    elif line.split()[0] == "/tool":
        try:
            ready = chat.tool_result(line[len("/tool") :].strip())
        except MoestreamError as exc:
            _note(str(exc))
            return
        if ready:
            _turn(chat, None)
    else:
        _note(f"unknown command {line.split()[0]} (/help lists them)")


def _turn(chat: Conversation, text: str | None) -> None:
    """One question and its answer; an error the user can act on (a full context, a checkpoint changed on
    disk) is one line, and the conversation goes on without that turn."""
    try:
        with StopOnInterrupt() as stop:
            gen = chat.ask(text, stop)
    except MoestreamError as exc:
        print(f"moestream: error: {exc}", file=sys.stderr, flush=True)
        return
    if gen.finish_reason == "cancelled":
        _note("stopped; the answer so far stays in the conversation")
    elif gen.finish_reason == "length" and gen.prompt_tokens + len(gen.tokens) >= chat.engine.ctx_size:
        _note("the context is full: /reset starts a new conversation")


def _note(text: str) -> None:
    print(f"[{text}]", file=sys.stderr, flush=True)
