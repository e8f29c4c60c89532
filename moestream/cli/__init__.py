"""`moestream <verb>`: one module per verb, each with `add_parser(subparsers)` that sets `func`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from moestream import __version__
from moestream.errors import MoestreamError

# verb modules, imported lazily so that e.g. `moestream simulate` never imports torch
VERBS: dict[str, str] = {
    "generate": "moestream.cli.generate",
    "chat": "moestream.cli.chat",
    "serve": "moestream.cli.serve",
    "synth": "moestream.cli.synth",
    "info": "moestream.cli.info",
    "demo": "moestream.cli.demo",
    "simulate": "moestream.cli.simulate",
    "plan": "moestream.cli.plan",
    "predict-eval": "moestream.cli.predict_eval",
    "trace-convert": "moestream.cli.trace_convert",
    "gpu-floor": "moestream.cli.gpu_floor",
    "bench": "moestream.cli.bench",
    "perplexity": "moestream.cli.perplexity",
}
# modules of the optional extras (pyproject.toml), and the extra that installs each
EXTRA_OF_MODULE = {
    "fastapi": "server",
    "uvicorn": "server",
    "starlette": "server",
    "prometheus_client": "server",
    "pyarrow": "trace",
    "matplotlib": "trace",
    "httpx": "bench",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moestream",
        description="Run Mixture-of-Experts LLMs larger than memory: routed experts stream from disk "
        "through a bounded expert cache. Every verb has --help.",
    )
    parser.add_argument("--version", action="version", version=f"moestream {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for verb, module in VERBS.items():
        if chosen in (None, verb) or chosen not in VERBS:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(verb)  # listed in --help without importing its module
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings a user should see, as one line each, without source locations."""
    print(f"moestream: warning: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    verb = next((a for a in argv if not a.startswith("-")), "")
    try:
        args = build_parser(argv).parse_args(argv)  # a verb's parser may import its extra already
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = _show_warning
            return int(args.func(args) or 0)
    except MoestreamError as exc:
        print(f"moestream: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = EXTRA_OF_MODULE.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(
            f"moestream: error: `moestream {verb}` needs the '{extra}' extra ({exc.name} is not installed): "
            f"pip install 'moestream[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("moestream: interrupted", file=sys.stderr)
        return 130
    except (
        BrokenPipeError
    ):  # `moestream ... | head`: the reader left; say nothing more (Python's docs' recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a process ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
