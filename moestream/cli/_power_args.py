"""Command-line options of the power features that several verbs share (generate, serve)."""

from __future__ import annotations

import argparse

from moestream.power.errors import GpuFloorError
from moestream.power.floor import parse_floor_spec


def _floor_spec(text: str) -> str:
    try:
        parse_floor_spec(text)
    except GpuFloorError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip().lower()


def add_gpu_floor_argument(parser: argparse.ArgumentParser) -> None:
    """Add `--gpu-floor auto|off|MHZ` (default auto); pass its value to `make_engine_floor`."""
    parser.add_argument(
        "--gpu-floor",
        type=_floor_spec,
        default="auto",
        metavar="auto|off|MHZ",
        help="Jetson GPU clock floor while experts are computed on the CPU: auto (on a Jetson, when "
        "experts are off the GPU and min_freq is writable), off, or a floor in MHz (default: auto)",
    )
