#!/usr/bin/env python3
"""Benchmark: what ``ringd top`` costs while it is open (issue 33).

Builds a state dir like bench_report's (``--agents`` 100, ``--runs`` 10,000 in
the journal, a live-looking heartbeat), opens ``ringd top`` in a private tmux
session (120x40), lets it settle, then measures its CPU time (psutil
``cpu_times``, user + sys) over ``--seconds`` (20) while this script adds a
finished run every second, as a turning ring would (so every refresh also
reads the agents' strips again: the worst case). Then sends ``q`` and checks
top exited 0.

Goal: under 2 % of one core.

    python3 benchmarks/bench_top.py [--agents 100] [--runs 10000] [--seconds 20]
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_report import build_state  # noqa: E402
from ringd.journal.sqlite import journal_path  # noqa: E402

GOAL = 0.02


def tmux(sock: str, *args: str) -> str:
    return subprocess.run(["tmux", "-S", sock, *args], capture_output=True, text=True, timeout=30, check=True).stdout


def add_run(state: Path, k: int, agents: int) -> None:
    con = sqlite3.connect(journal_path(state), timeout=10)
    try:
        with con:
            now = time.time()
            con.execute("INSERT INTO runs(agent, position, status, started_at, ended_at, duration, exit_code)"
                        " VALUES (?, ?, 'ok', ?, ?, 0.5, 0)", (f"agent-{k % agents:03d}", k % agents, now - 0.5, now))
    finally:
        con.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=100)
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    if not shutil.which("tmux"):
        print("tmux is not installed: apt-get install tmux")
        return 1
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    base = Path(tempfile.mkdtemp(prefix="ring-bench-top-"))
    sock = str(base / "tmux.sock")
    server = None
    try:
        state = build_state(base, args.runs, args.agents, 0)
        env = f"PYTHONPATH={shlex.quote(str(REPO))}"
        command = f"{env} {shlex.quote(sys.executable)} -m ringd top --state {shlex.quote(str(state))}; " \
                  f"echo TOP-EXIT=$?; sleep 600"
        tmux(sock, "-f", "/dev/null", "new-session", "-d", "-x", "120", "-y", "40", command)
        server = psutil.Process(int(tmux(sock, "display-message", "-p", "#{pid}").strip()))
        deadline = time.monotonic() + 30
        while "ring top" not in tmux(sock, "capture-pane", "-p") and time.monotonic() < deadline:
            time.sleep(0.1)
        pane = psutil.Process(int(tmux(sock, "display-message", "-p", "#{pane_pid}").strip()))
        top = next(p for p in pane.children(recursive=True) if "top" in p.cmdline())
        time.sleep(3)   # past start-up (imports, the first read)
        started = sum(top.cpu_times()[:2])
        cpu0, t0 = started, time.monotonic()
        k = 0
        while time.monotonic() - t0 < args.seconds:
            add_run(state, k, args.agents)
            k += 1
            time.sleep(1.0)
        share = (sum(top.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0)
        tmux(sock, "send-keys", "q")
        deadline = time.monotonic() + 10
        while "TOP-EXIT=" not in tmux(sock, "capture-pane", "-p") and time.monotonic() < deadline:
            time.sleep(0.1)
        exited = "TOP-EXIT=0" in tmux(sock, "capture-pane", "-p")
        print(f"ringd top, {args.agents} agents, a new run every second: {share:.2%} of a core over "
              f"{args.seconds:g} s (start-up took {started:.2f} s of CPU), "
              f"{'PASS' if share < GOAL else 'MISS'} (goal < 2 %); q quit it with exit 0: {exited}")
        return 0
    finally:
        subprocess.run(["tmux", "-S", sock, "kill-server"], capture_output=True, timeout=30)
        if server is not None:
            victims = []
            try:
                victims = server.children(recursive=True) + [server]
            except psutil.Error:
                pass
            for p in victims:
                try:
                    p.kill()
                except psutil.Error:
                    pass
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
