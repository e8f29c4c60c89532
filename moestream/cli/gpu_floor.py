"""`moestream gpu-floor`: GPU clock floor daemon for llama.cpp with MoE experts on the CPU (Jetson).

moestream gpu-floor --check          what it would use; needs no root
sudo moestream gpu-floor             run in the foreground (the systemd unit runs this)
sudo moestream gpu-floor install     write the systemd unit and /etc/default/moestream-gpu-floor
sudo moestream gpu-floor uninstall   remove both
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

from moestream.power.errors import GpuFloorError
from moestream.power.settings import DEFAULTS_FILE, DaemonSettings, build_settings, read_defaults_file


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `gpu-floor` verb."""
    p = subparsers.add_parser(
        "gpu-floor",
        help="GPU clock floor daemon for llama.cpp (Jetson)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "action",
        nargs="?",
        choices=("run", "install", "uninstall"),
        default="run",
        help="run the daemon (default), or install/uninstall the systemd service",
    )
    p.add_argument(
        "--check", action="store_true", help="print devfreq node, library, symbols, bpftrace; no root"
    )
    p.add_argument(
        "--config", default=DEFAULTS_FILE, metavar="FILE", help=f"settings file (default {DEFAULTS_FILE})"
    )
    p.add_argument("--floor-mhz", metavar="MHZ|max", help="floor while busy (default: highest available)")
    p.add_argument(
        "--hold-s", metavar="SECONDS", help="keep the floor this long after the last call (default 1)"
    )
    p.add_argument("--library", action="append", metavar="PATH", help="libllama.so path or glob (repeatable)")
    p.add_argument(
        "--moe-flag",
        action="append",
        metavar="FLAG",
        help="count processes with this flag, written --moe-flag=--cpu-moe (repeatable)",
    )
    p.add_argument("--symbol", action="append", metavar="NAME", help="function to probe (repeatable)")
    p.add_argument("--bpftrace", metavar="PATH", help="bpftrace executable (default: bpftrace on PATH)")
    p.add_argument(
        "--sysfs-root", default="/", metavar="DIR", help="look for /sys and /proc under DIR (tests)"
    )
    p.add_argument("--state-dir", metavar="DIR", help="crash-recovery state (default /run/moestream)")
    p.add_argument("--root", default="/", metavar="DIR", help="install/uninstall under DIR instead of /")
    p.add_argument("-v", "--verbose", action="store_true", help="log every bpftrace line")
    p.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> DaemonSettings:
    """Defaults file first, command line over it. Raises GpuFloorError naming the bad setting."""
    try:
        values = read_defaults_file(args.config)
        if args.floor_mhz is not None:
            values["GPU_FLOOR_MHZ"] = args.floor_mhz
        if args.hold_s is not None:
            values["HOLD_SECONDS"] = args.hold_s
        return build_settings(
            values,
            {
                "libraries": args.library,
                "moe_flags": args.moe_flag,
                "symbols": args.symbol,
                "bpftrace": args.bpftrace,
            },
        )
    except ValueError as exc:
        raise GpuFloorError(f"gpu-floor settings: {exc}.") from None
    except OSError as exc:
        raise GpuFloorError(f"cannot read {args.config}: {exc.strerror or exc}.") from None


# the options each mode reads (the settings: --config, --floor-mhz, --hold-s, --library, --moe-flag,
# --symbol, --bpftrace); the others, given, are said to change nothing
_SETTINGS = ("config", "floor_mhz", "hold_s", "library", "moe_flag", "symbol", "bpftrace")
_READS = {
    "check": (*_SETTINGS, "sysfs_root"),
    "install": (*_SETTINGS, "root"),
    "uninstall": ("root",),
    "run": (*_SETTINGS, "sysfs_root", "state_dir", "verbose"),
}
_DEFAULTS = {"config": DEFAULTS_FILE, "sysfs_root": "/", "root": "/", "verbose": False}


def _check_unused(args: argparse.Namespace) -> None:
    """Refuse --check with install or uninstall; warn about options the chosen mode does not read."""
    if args.check and args.action != "run":
        raise GpuFloorError(
            f"--check reports what the daemon would use; it does not {args.action} (drop one)."
        )
    mode = "check" if args.check else args.action
    unused = [
        "--" + name.replace("_", "-")
        for name in (*_SETTINGS, "sysfs_root", "state_dir", "root", "verbose")
        if name not in _READS[mode] and getattr(args, name) != _DEFAULTS.get(name)
    ]
    if unused:
        what = "--check" if args.check else f"gpu-floor {args.action}"
        warnings.warn(
            f"{', '.join(unused)}: {what} does not read {'them' if len(unused) > 1 else 'it'}", stacklevel=2
        )


def run(args: argparse.Namespace) -> int:
    """Dispatch --check, install, uninstall or the daemon itself."""
    _check_unused(args)
    if args.action == "uninstall":
        from moestream.power.systemd import uninstall

        print("\n".join(uninstall(args.root)))
        return 0
    settings = settings_from_args(args)
    if args.check:
        from moestream.power.check import check_report

        report, ok = check_report(settings, args.sysfs_root)
        sys.stdout.write(report)
        return 0 if ok else 1
    if args.action == "install":
        from moestream.power.systemd import install

        print("\n".join(install(settings, args.root)))
        return 0
    from moestream.power.daemon import make_daemon_floor, serve

    floor = make_daemon_floor(
        settings, args.sysfs_root, args.state_dir
    )  # user errors surface before logging is set up
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s", stream=sys.stderr
    )
    return serve(settings, floor, args.sysfs_root)
