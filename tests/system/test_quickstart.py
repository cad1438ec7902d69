"""The quick start shows the ring turning (SPEC "Operator verbs, round 2"):
``ringwatch`` on a terminal prints each run's start and end as it happens, the
shipped example rosters turn at a pace a person can follow, and under systemd
the watcher's STATUS= follows the driver within a heartbeat or two."""
from __future__ import annotations

import json
import os
import pty
import shutil
import signal
import socket
import subprocess
import time

import psutil

from conftest import REPO, read_until, ring_cmd, wait_until


class Fd:
    """A raw descriptor as conftest.read_until reads it."""

    def __init__(self, fd: int):
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


def test_ringwatch_on_a_terminal_shows_each_run_as_it_happens(ring):
    seen = ring.base / "seen"
    ring.agent("a", f"ls -l /proc/$$/fd > {seen}.$RING_RUN_ID; env | grep -c RING_ECHO_FD >> {seen}.$RING_RUN_ID; "
                    f"sleep 0.3")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    master, slave = pty.openpty()
    try:
        watcher = ring.start_watcher(stdout=slave, stderr=slave)
        os.close(slave)
        slave = None
        out = read_until(Fd(master), lambda b: b"run 2: a started" in b, timeout=20,
                         message="the driver's lines on the terminal")
        assert b"run 1: a started" in out and b"run 1: a ok (exit 0)" in out, out[-2000:]
        assert b"started driver (pid" in out   # (and the watcher's own)
        # the driver's lines still go to ringd.log, and no agent gets the terminal
        assert "run 1: a started" in (ring.state / "logs" / "ringd.log").read_text()
        listing = (ring.base / "seen.1").read_text()   # (run 1 has ended: run 2 started)
        assert "/dev/pts" not in listing and listing.rstrip().endswith("0"), listing
        watcher.send_signal(signal.SIGTERM)
        assert watcher.wait(timeout=30) == 0
    finally:
        os.close(master)
        if slave is not None:
            os.close(slave)


def lap_durations(state) -> list:
    import sqlite3
    con = sqlite3.connect(f"file:{state / 'journal.db'}?mode=ro", uri=True)
    try:
        return [row[0] for row in con.execute("SELECT duration FROM runs ORDER BY id")]
    finally:
        con.close()


def test_the_shipped_example_rosters_turn_at_a_pace_a_person_can_follow(tmp_path):
    """One lap of STATE/ring.txt with the shipped config (and of the roster
    ``ringd init`` lays out): every run takes a second or more, so a person
    watching reads each line - not several runs a second."""
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    (tmp_path / "STATE").mkdir(mode=0o700)
    shutil.copy(REPO / "STATE/ring.txt", tmp_path / "STATE/ring.txt")
    os.chmod(tmp_path / "STATE/ring.txt", 0o600)
    shutil.copy(REPO / "config/ring.yaml", tmp_path / "ring.yaml")
    os.chmod(tmp_path / "ring.yaml", 0o600)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("NOTIFY_SOCKET", None)
    t0 = time.monotonic()
    r = subprocess.run(ring_cmd("run", "--once", "--state", str(tmp_path / "STATE"), "--config",
                                str(tmp_path / "ring.yaml")), env=env, capture_output=True, text=True, timeout=60)
    lap = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    durations = lap_durations(tmp_path / "STATE")
    assert len(durations) == 3 and min(durations) >= 0.9, durations
    assert len(durations) / lap <= 1.0, (len(durations), lap)
    init = tmp_path / "init"
    assert subprocess.run(ring_cmd("init", str(init)), env=env, capture_output=True, timeout=30).returncode == 0
    r = subprocess.run(ring_cmd("run", "--once"), cwd=init, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    durations = lap_durations(init / "STATE")
    assert len(durations) == 2 and min(durations) >= 0.9, durations


def test_under_systemd_the_watchers_status_follows_the_driver_within_beats(ring, tmp_path):
    """STATUS= said "started driver" until the next poll (poll_interval, 300 s
    shipped): it now follows the driver's heartbeat, woken once a heartbeat
    interval - never spinning."""
    ring.write_config(ring={"heartbeat_interval": 0.2},
                      watch={"poll_interval": 300, "stale_after": 300, "start_limit_interval": 600})
    ring.agent("a", "sleep 0.5")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.1)
    got = []   # (monotonic, message)

    def statuses():
        try:
            data = sock.recv(4096).decode()
        except socket.timeout:
            return None
        got.append((time.monotonic(), data))
        return None
    try:
        watcher = ring.start_watcher(env=dict(ring.env, NOTIFY_SOCKET=path))
        wait_until(lambda: statuses() or any("running a" in m for _, m in got), 20, interval=0,
                   message=f"STATUS= naming the run; got {[m for _, m in got]}")
        first_beat = json.loads((ring.state / "ringd.heartbeat").read_text())["started_at"]
        ok = [(t, m) for t, m in got if m.startswith("STATUS=driver ok (pid ")]
        assert ok and "lap 1: running a" in ok[-1][1], got
        started = [t for t, m in got if m.startswith("STATUS=started driver")]
        assert started and ok[0][0] - started[0] < 5.0, (got, first_beat)
        # woken once a heartbeat interval, not more: a few milliseconds of CPU a second
        proc = psutil.Process(watcher.pid)
        before = sum(proc.cpu_times()[:2])
        time.sleep(3)
        spent = sum(proc.cpu_times()[:2]) - before
        assert spent < 0.3, spent
        watcher.send_signal(signal.SIGTERM)
        assert watcher.wait(timeout=30) == 0
    finally:
        sock.close()
