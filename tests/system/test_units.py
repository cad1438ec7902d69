"""The shipped service definitions: systemd units (both deployment modes) and the
launchd property list. Their numbers must agree with the config defaults and
with the daemons' own stop graces; ``systemd-analyze verify`` must accept them
without a single complaint where it exists.
"""
from __future__ import annotations

import plistlib
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from conftest import REPO
from ringd.inputs.config import Config
from ringd.loops import watcher

SYSTEMD = REPO / "systemd"
LAUNCHD = REPO / "launchd"
UNITS = ("ringwatch.service", "ringd.service", "ringwatch-systemd.service")
DRIVER_STOP_GRACE = 3.0     # SPEC/driver: SIGTERM -> SIGKILL for the agent
DEFAULTS = Config()


def parse_unit(path: Path) -> Dict[str, Dict[str, List[str]]]:
    """A systemd unit as {section: {key: [values...]}} (keys may repeat)."""
    sections: Dict[str, Dict[str, List[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path}: key outside a section: {line}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit, section, key) -> str:
    values = unit[section].get(key)
    assert values and len(values) == 1, f"[{section}] {key}= must be set exactly once"
    return values[0]


def seconds(text: str) -> float:
    """systemd time span ('5', '5s', '1min 30s', '100ms') -> seconds."""
    units = {"ms": 0.001, "s": 1, "sec": 1, "": 1, "m": 60, "min": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"([\d.]+)\s*([a-z]*)", text):
        total += float(number) * units[unit]
    return total


@pytest.fixture(scope="module")
def units():
    return {name: parse_unit(SYSTEMD / name) for name in UNITS}


@pytest.mark.parametrize("name", UNITS)
def test_unit_supervision_settings(units, name):
    u = units[name]
    w = DEFAULTS.watch
    assert one(u, "Service", "Type") == "notify"
    assert one(u, "Service", "Restart") == "always"
    assert one(u, "Service", "KillMode") == "control-group"
    assert "78" in one(u, "Service", "RestartPreventExitStatus").split()
    # throttled like the config says, never systemd's 100 ms / 5 in 10 s defaults
    assert seconds(one(u, "Service", "RestartSec")) == w.restart_sec
    assert int(one(u, "Unit", "StartLimitBurst")) == w.start_limit_burst
    assert seconds(one(u, "Unit", "StartLimitIntervalSec")) == w.start_limit_interval
    assert seconds(one(u, "Service", "TimeoutStopSec")) > DRIVER_STOP_GRACE
    # the driver pings with each heartbeat; the watchdog must allow several
    assert seconds(one(u, "Service", "WatchdogSec")) >= 3 * DEFAULTS.ring.heartbeat_interval
    assert one(u, "Install", "WantedBy") == "multi-user.target"


def test_unit_commands(units):
    common = "--state /var/lib/ring --config /etc/ring/ring.yaml"
    assert one(units["ringd.service"], "Service", "ExecStart") == f"/opt/ring/bin/ringd run {common}"
    for name in ("ringwatch.service", "ringwatch-systemd.service"):
        u = units[name]
        assert one(u, "Service", "ExecStart") == f"/opt/ring/bin/ringwatch {common}"
        # a watcher that gave up (70) must stay down until `ringwatch reset`
        assert "70" in one(u, "Service", "RestartPreventExitStatus").split()
        # the watcher's whole stop (the driver's grace, its SIGKILL, the orphan's reap) shares
        # one deadline, with room to spare for an interpreter's exit on a loaded box
        assert seconds(one(u, "Service", "TimeoutStopSec")) >= watcher.STOP_BUDGET + 5


def test_mode_two_wiring(units):
    w = units["ringwatch-systemd.service"]
    assert "ringd.service" in one(w, "Unit", "Wants").split()
    assert "ringd.service" in one(w, "Unit", "After").split()
    assert "restart_command: [systemctl, restart, ringd]" in (SYSTEMD / "ringwatch-systemd.service").read_text()
    # the two modes exclude each other
    assert "ringd.service" in one(units["ringwatch.service"], "Unit", "Conflicts").split()
    assert "ringwatch.service" in one(units["ringd.service"], "Unit", "Conflicts").split()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path):
    """Verify copies whose ExecStart points at stand-in executables (the real
    /opt/ring/bin/ringd may not be installed here); every other line is as shipped.
    Unknown keys and bad values are only warnings to verify, so any output that
    names one of our units fails the test."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for prog in ("ringd", "ringwatch"):
        stub = bindir / prog
        stub.write_text(f"#!/bin/sh\nexec {sys.executable} -m {prog} \"$@\"\n")
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    copies = []
    for name in UNITS:
        text = (SYSTEMD / name).read_text()
        assert "/opt/ring/bin/" in text
        copy = tmp_path / name
        copy.write_text(text.replace("/opt/ring/bin/", f"{bindir}/"))
        copies.append(str(copy))
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", *copies],
                         capture_output=True, text=True, timeout=60)
    output = res.stdout + res.stderr
    ours = [ln for ln in output.splitlines() if any(n in ln for n in UNITS)]
    assert res.returncode == 0 and not ours, output

    # and verify does catch a broken unit (so the check above means something)
    broken = tmp_path / "broken.service"
    broken.write_text((tmp_path / "ringd.service").read_text().replace("Type=notify", "Type=notifyy"))
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", str(broken)],
                         capture_output=True, text=True, timeout=60)
    assert "broken.service" in res.stdout + res.stderr


# --- launchd ------------------------------------------------------------------------------

def plists() -> List[Path]:
    found = sorted(LAUNCHD.glob("*.plist"))
    assert found, "launchd/ ships no property list"
    return found


@pytest.mark.parametrize("path", plists(), ids=lambda p: p.name)
def test_launchd_plist(path):
    with open(path, "rb") as f:
        p = plistlib.load(f)
    assert p["Label"] == path.stem
    argv = p["ProgramArguments"]
    assert argv[0].startswith("/") and argv[0].endswith("/ringwatch")
    assert argv[argv.index("--state") + 1].startswith("/")
    # a LaunchAgent (the shipped one) names no config: ringwatch finds the user's
    # ~/.config/ring/ring.yaml as every command does; a LaunchDaemon names /etc's
    assert "--config" not in argv or argv[argv.index("--config") + 1].startswith("/")
    assert ("--config" in argv) == ("UserName" in p)
    assert p["RunAtLoad"] is True
    assert p["KeepAlive"] in (True, {"SuccessfulExit": False})
    assert p["ThrottleInterval"] == DEFAULTS.watch.restart_sec
    assert isinstance(p["ExitTimeOut"], int) and p["ExitTimeOut"] >= watcher.STOP_BUDGET + 5
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert p[key].startswith("/")
    assert p.get("Umask", 0o077) & 0o077 == 0o077
