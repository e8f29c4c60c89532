"""`moestream gpu-floor install|uninstall`: the systemd unit and the defaults file."""

from __future__ import annotations

import sys
from pathlib import Path

from moestream.power.devfreq import sys_path
from moestream.power.errors import GpuFloorError
from moestream.power.settings import DEFAULTS_FILE, PATH_RE, DaemonSettings, render_defaults_file

UNIT_NAME = "moestream-gpu-floor.service"
UNIT_DIR = "/etc/systemd/system"


def render_unit(python: str) -> str:
    """The unit text; `python` is the interpreter that has moestream installed."""
    if not PATH_RE.fullmatch(python):
        raise GpuFloorError(
            f"cannot put interpreter path {python!r} into a systemd unit; "
            "install moestream under a path without spaces or special characters."
        )
    return "\n".join(
        [
            "[Unit]",
            "Description=moestream GPU clock floor while llama.cpp computes MoE experts on the CPU (Jetson)",
            "After=multi-user.target",
            "",
            "[Service]",
            "Type=simple",
            f"ExecStart={python} -m moestream gpu-floor --config {DEFAULTS_FILE}",
            # on a crash systemd restarts it, and the new run restores min_freq from its state file
            "Restart=on-failure",
            "RestartSec=5",
            "",
            "[Install]",
            "WantedBy=multi-user.target",
            "",
        ]
    )


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except PermissionError:
        raise GpuFloorError(f"cannot write {path}; run the install as root (sudo).") from None


def install(settings: DaemonSettings, root: str = "/", python: str = sys.executable) -> list[str]:
    """Write the unit and the defaults file (holding `settings`) under `root`; return what was done."""
    unit = sys_path(root, f"{UNIT_DIR}/{UNIT_NAME}")
    defaults = sys_path(root, DEFAULTS_FILE)
    _write(unit, render_unit(python))
    _write(defaults, render_defaults_file(settings))
    return [
        f"wrote {unit}",
        f"wrote {defaults}",
        f"next: systemctl daemon-reload && systemctl enable --now {UNIT_NAME}",
    ]


def uninstall(root: str = "/") -> list[str]:
    """Remove the unit and the defaults file under `root`; return what was done."""
    done: list[str] = []
    for path in (sys_path(root, f"{UNIT_DIR}/{UNIT_NAME}"), sys_path(root, DEFAULTS_FILE)):
        try:
            path.unlink()
            done.append(f"removed {path}")
        except FileNotFoundError:
            done.append(f"not present: {path}")
        except PermissionError:
            raise GpuFloorError(f"cannot remove {path}; run the uninstall as root (sudo).") from None
    done.append(
        f"next: systemctl daemon-reload (stop a running service first: systemctl disable --now {UNIT_NAME})"
    )
    return done
