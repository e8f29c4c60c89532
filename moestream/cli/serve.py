"""`moestream serve PATH`: an OpenAI-compatible HTTP server with llama-server's timings (docs/server.md)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from moestream.cli._engine_args import (
    add_context_arguments,
    add_engine_arguments,
    add_model_argument,
    add_trace_arguments,
    engine_kwargs,
    model_path,
    read_chat_template,
    use_chat_template,
    warn_trace_predict,
)
from moestream.errors import MoestreamError
from moestream.server.guard import DEFAULT_MAX_CONNECTIONS, DEFAULT_REQUEST_TIMEOUT, limited_protocol

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_model_argument(p)
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)"
    )
    p.add_argument(
        "--port", type=port_number, default=8080, help="TCP port (default 8080; 0 picks a free one)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("MOESTREAM_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $MOESTREAM_API_KEY, else none); prefer the "
        "variable: a key on the command line is visible to every user in `ps`",
    )
    p.add_argument(
        "--model-name",
        default=None,
        help="the model id clients use (default: the checkpoint directory's name, or -hf's REPO[:QUANT])",
    )
    p.add_argument(
        "--queue-size",
        type=int,
        default=16,
        help="requests that may wait for the model; beyond that: 503 with Retry-After (default 16)",
    )
    p.add_argument(
        "-np",
        "--parallel",
        type=parallel_count,
        default="auto",
        metavar="N",
        help="requests that run at once, their decode steps batched (llama-server's -np): N KV-cache slots "
        "of --ctx-size each (the mode line gives their memory); more requests wait in the queue. Default "
        "auto: 4, 2 or 1, the most the runner can batch (the ggml graphs) whose slots leave the expert "
        "cache every expert where it had them all, else at least 7/8 of its bytes (an explicit --cache: "
        "slots that fit beside it); on ggml's CUDA backend, whose slots also leave the GPU every expert "
        "where one slot did, else a GPU tier at least 7/8 of one slot's (an explicit --gpu-tier: slots "
        "that fit beside it); the mode line says the choice and why",
    )
    p.add_argument("--max-body", default="4MiB", help="largest accepted request body (default 4MiB)")
    p.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help=f"open connections at once; more get 503 at once (default {DEFAULT_MAX_CONNECTIONS})",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT,
        help="seconds a request's head, and then its body, may take to arrive; a connection that sends "
        f"no whole request in time is closed (default {DEFAULT_REQUEST_TIMEOUT:g})",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="info (default): one access-log line per request on stderr; warning: only problems",
    )
    add_context_arguments(p)
    add_trace_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(func=run)


def parallel_count(text: str) -> int | str:
    """argparse type: --parallel's auto, or a number of slots (1..MAX_PARALLEL)."""
    from moestream.engine.options import parallel_value

    try:
        return parallel_value(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0..65535 (0: the system picks a free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 0..65535")
    return value


def listen(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a taken port fails in a second, not after a long load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio only sets TCP_NODELAY on such sockets, and without it Nagle's algorithm
    # holds each response's second write (body after headers, one SSE chunk after another) for ~40 ms
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except (OSError, OverflowError) as exc:  # OverflowError: a port outside 0..65535 from the Python API
        sock.close()
        reason = getattr(exc, "strerror", None) or exc
        raise MoestreamError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(args: argparse.Namespace) -> int:
    import uvicorn

    import moestream
    from moestream.server.app import ServerOptions, create_app
    from moestream.units import parse_size

    try:
        max_body = parse_size(args.max_body)
    except ValueError as exc:
        raise MoestreamError(f"--max-body: {exc}") from None
    if args.queue_size < 1:
        raise MoestreamError(f"--queue-size must be at least 1, got {args.queue_size}")
    if args.max_connections < 1:
        raise MoestreamError(f"--max-connections must be at least 1, got {args.max_connections}")
    if not args.request_timeout > 0 or args.request_timeout == float("inf"):
        raise MoestreamError(
            f"--request-timeout must be a positive number of seconds, got {args.request_timeout}"
        )
    path, template = model_path(args), read_chat_template(args)
    warn_trace_predict(args)
    if not _is_loopback(args.host) and not args.api_key:
        print(
            f"moestream: warning: listening on {args.host} without --api-key: anyone who can reach "
            "this address can use the model",
            file=sys.stderr,
            flush=True,
        )
    _configure_logging(args.log_level)
    sock = listen(args.host, args.port)
    model_id = args.model_name or args.hf_repo or Path(path.rstrip("/")).name or path
    with sock, moestream.load(path, **engine_kwargs(args), parallel=args.parallel) as engine:
        use_chat_template(engine, template)
        if args.trace:
            engine.start_trace(args.trace, predict=not args.no_trace_predict)
        print(engine.mode_line(), flush=True)
        options = ServerOptions(
            model_id=model_id,
            api_key=args.api_key,
            max_body=max_body,
            queue_size=args.queue_size,
            aliases=[path, *([args.hf_repo] if args.hf_repo else [])],
            loopback_only=_is_loopback(args.host),
            request_timeout=args.request_timeout,
            max_connections=args.max_connections,
        )
        app = create_app(engine, options)
        # uvicorn's own INFO lines (startup, shutdown) only repeat ours: it logs warnings unless debugging
        uvicorn_level = args.log_level if args.log_level in ("debug", "error") else "warning"
        config = uvicorn.Config(
            app,
            http=limited_protocol(args.max_connections, args.request_timeout),
            log_level=uvicorn_level,
            access_log=False,
            timeout_graceful_shutdown=5,
            log_config=None,
        )
        host, port = sock.getsockname()[:2]
        print(
            f"moestream: serving {model_id!r} on http://{_url_host(host)}:{port}/v1"
            f"{' (API key required)' if args.api_key else ''}",
            flush=True,
        )
        _run_until_stopped(_server_class(uvicorn)(config, app.state.server.begin_shutdown), sock)
    return 0


def _configure_logging(level: str) -> None:
    """moestream's and uvicorn's log lines on stderr, one line each ("moestream: ...")."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name_short)s: %(message)s"))
    handler.addFilter(_short_name)
    for name in ("moestream", "uvicorn"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False


def _short_name(record: Any) -> bool:
    record.name_short = record.name.split(".")[0]
    return True


def _server_class(uvicorn: Any) -> type:
    class Server(uvicorn.Server):
        """uvicorn's server that also ends running generations when SIGTERM or SIGINT arrives: a stream
        gets its closing event at once instead of holding the graceful shutdown until it times out."""

        def __init__(self, config: Any, on_signal: Any) -> None:
            super().__init__(config)
            self.on_signal = on_signal

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            self.on_signal()

    return Server


class _Terminated(Exception):
    """SIGTERM or SIGINT arrived; raised out of uvicorn so that the engine is closed on the way out."""


def _run_until_stopped(server: Any, sock: socket.socket) -> None:
    # uvicorn shuts down gracefully on SIGTERM/SIGINT and then re-raises the signal to the previous
    # handler; the default ones would kill the process (or raise KeyboardInterrupt) before the trace is
    # finished and the GPU clock floor restored. A signal is how a server is meant to stop: exit 0.
    def terminated(signum: int, frame: Any) -> None:
        raise _Terminated

    previous = {sig: signal.signal(sig, terminated) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    except _Terminated:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
