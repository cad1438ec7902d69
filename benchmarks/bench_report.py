#!/usr/bin/env python3
"""Benchmark: ``ringd report`` on a big journal (issue 33).

Builds a state dir whose journal holds ``--runs`` (10,000) runs of ``--agents``
(100) agents started within the last 23 hours, with phases and reasons, after
``--older`` (50,000) runs from before the default 24-hour window (they must
cost nothing), and a live-looking heartbeat. Then measures the wall time of
``ringd report -o FILE`` as a subprocess (Python start-up included; median of
``--repeat``) and the page's size, and times the three steps in-process
(read the journal, build the timeline, render the HTML).

Goals: under 2 s and under 5 MB for 10,000 runs.

    python3 benchmarks/bench_report.py [--runs 10000] [--agents 100] [--older 50000] [--repeat 5]
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ringd.host.heartbeat import iso, write_json_atomic  # noqa: E402
from ringd.host.procid import start_ticks  # noqa: E402
from ringd.journal.sqlite import Journal, journal_path  # noqa: E402

STATUSES = ("ok",) * 12 + ("failed", "deferred", "timeout", "skipped", "error", "stalled", "interrupted")
GOAL_SECONDS, GOAL_BYTES = 2.0, 5 * 1024 * 1024


def build_state(base: Path, runs: int, agents: int, older: int) -> Path:
    state = base / "state"
    state.mkdir(mode=0o700)
    names = [f"agent-{i:03d}" for i in range(agents)]
    roster = state / "ring.txt"
    roster.write_text("".join(f"{n} true --run {n}\n" for n in names))
    os.chmod(roster, 0o600)
    Journal.open(state).close()
    con = sqlite3.connect(journal_path(state), isolation_level=None)
    con.execute("PRAGMA synchronous=OFF")
    now = time.time()
    rows = []
    spacing = 23 * 3600 / runs
    for i in range(older + runs):
        start = (now - 30 * 3600 - (older - i) * 5.0) if i < older else now - 23 * 3600 + (i - older) * spacing
        status = STATUSES[i % len(STATUSES)]
        took = min(spacing * 0.8, 2.0 + (i % 7) * 3.1)
        reason = {"failed": "exit 1: upstream said 500 <Internal Server Error> & retried 3 times",
                  "skipped": "operator skipped it (ringd skip)", "stalled": "killed at the stall threshold",
                  "interrupted": "driver stopping", "error": "program not found: ./agents/x.sh"}.get(status)
        phase = f"step {i % 5} of 5: fetching page {i % 97}" if i % 3 == 0 else None
        rows.append((names[i % agents], i % agents, status, start, start + took, took,
                     None if status in ("skipped", "error") else (0 if status == "ok" else 1), reason, phase))
    con.execute("BEGIN")
    con.executemany("INSERT INTO runs(agent, position, status, started_at, ended_at, duration, exit_code, reason,"
                    " phase) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    con.execute("COMMIT")
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    me = os.getpid()
    write_json_atomic(state / "ringd.heartbeat", {
        "pid": me, "pid_start": start_ticks(me), "started_at": iso(now - 3600), "at": iso(now),
        "at_epoch": now, "lap": (older + runs) // agents, "agent": None, "run_id": None, "seq": 1,
        "stopped": False})
    return state


def in_process(state: Path) -> dict:
    """The three steps' times, from this interpreter (modules already imported)."""
    from ringd.cli import report, reporthtml
    from ringd.cli.status import gather_status
    from ringd.core.timeline import build_timeline
    from ringd.inputs.config import load_config
    from ringd.inputs.schedule import local_zone
    config = load_config(None)
    now = time.time()
    t0 = time.perf_counter()
    runs = report.gather_runs(state, config, now - 86400, now)
    t1 = time.perf_counter()
    doc = gather_status(state, config, now=now)
    tl = build_timeline(runs, since=now - 86400, until=now, now=now, roster=[a["name"] for a in doc["agents"]],
                        fit=True)
    t2 = time.perf_counter()
    page = reporthtml.render(tl, tz=local_zone(), generated=now)
    t3 = time.perf_counter()
    return {"read": t1 - t0, "build": t2 - t1, "render": t3 - t2, "bars": len(tl.bars), "chars": len(page)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--agents", type=int, default=100)
    ap.add_argument("--older", type=int, default=50_000, help="runs from before the window")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    base = Path(tempfile.mkdtemp(prefix="ring-bench-report-"))
    try:
        state = build_state(base, args.runs, args.agents, args.older)
        out = base / "report.html"
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        argv = [sys.executable, "-m", "ringd", "report", "--state", str(state), "-o", str(out)]
        times, cpus = [], []
        for _ in range(args.repeat):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=base, timeout=120)
            times.append(time.perf_counter() - t0)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            if res.returncode != 0:
                print(f"ringd report exited {res.returncode}: {res.stderr.strip()[:300]}")
                return 1
        size = out.stat().st_size
        steps = in_process(state)
        median = statistics.median(times)
        print(f"journal: {args.runs} runs of {args.agents} agents in the window, {args.older} older")
        print(f"ringd report: {median:.2f} s median of {args.repeat} (min {min(times):.2f}, max {max(times):.2f}), "
              f"{'PASS' if median < GOAL_SECONDS else 'MISS'} (goal < {GOAL_SECONDS:g} s); "
              f"CPU {statistics.median(cpus):.2f} s (user + sys, what a busy box cannot stretch)")
        print(f"page: {size / 1024 / 1024:.2f} MB ({size} bytes, {steps['bars']} bars), "
              f"{'PASS' if size < GOAL_BYTES else 'MISS'} (goal < 5 MB)")
        print(f"in-process: read {steps['read'] * 1000:.0f} ms, build {steps['build'] * 1000:.0f} ms, "
              f"render {steps['render'] * 1000:.0f} ms")
        return 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
