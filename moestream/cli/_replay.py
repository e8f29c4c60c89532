"""`moestream generate PATH --replay-routing TRACE`: every request of a recorded trace with its routing
(benchmark only). The mode line and the summed stats line go to stderr, a JSON object to stdout."""

from __future__ import annotations

import argparse
import json
import sys

from moestream.cli._engine_args import engine_kwargs, model_path
from moestream.errors import MoestreamError


def replay_routing(args: argparse.Namespace) -> int:
    """Run the trace's requests on the checkpoint; print one stats line summed over them (or JSON)."""
    import moestream
    from moestream.engine.stats import GenerationStats, PhaseStats

    if args.trace:
        raise MoestreamError("--replay-routing and --trace cannot be used together")
    unused = unused_by_replay(args)
    if unused:
        raise MoestreamError(
            f"--replay-routing runs the trace's requests (their prompt and answer lengths, greedy, past "
            f"EOS), so {', '.join(unused)} would change nothing: leave "
            f"{'them' if len(unused) > 1 else 'it'} out"
        )
    with moestream.load(model_path(args), **engine_kwargs(args)) as engine:
        requests = engine.replay_routing(args.replay_routing)
        print(engine.mode_line(), file=sys.stderr, flush=True)
        total = GenerationStats(PhaseStats(), PhaseStats())
        for gen in engine.replay_requests():
            for mine, theirs in ((total.prefill, gen.stats.prefill), (total.decode, gen.stats.decode)):
                for name, value in vars(theirs).items():  # summed; a word (the tier's way): the last
                    setattr(mine, name, value if isinstance(value, str) else getattr(mine, name) + value)
        replayed, own = engine.replay.replayed, engine.replay.own
        if args.json:
            out = {"mode": engine.mode_line(), "requests": len(requests), "stats": total.to_dict()}
            print(json.dumps({**out, "rows_replayed": replayed, "rows_own_routing": own}), flush=True)
        print(
            f"replayed {len(requests)} requests: {replayed} token rows from the trace, {own} by the model",
            file=sys.stderr,
        )
        print(total.line(), file=sys.stderr, flush=True)
    return 0


def unused_by_replay(args: argparse.Namespace) -> list[str]:
    """The options of `generate` given that a routing replay does not read: the prompt, the chat
    template and every sampling option."""
    from moestream.cli._sampling_args import add_sampling_arguments

    probe = argparse.ArgumentParser(add_help=False)
    add_sampling_arguments(probe)
    probe.add_argument("--prompt")
    probe.add_argument("--chat", action="store_true")
    probe.add_argument("--chat-template")
    return [
        max(action.option_strings, key=len)
        for action in probe._actions
        if getattr(args, action.dest, action.default) != action.default
    ]
