"""Journal retention (``ring.keep_runs``): does a big journal slow the ring, and
does pruning stall a hop?

1. Start-up (``ringd run --once`` of a one-agent ring that runs ``true``: lock,
   verify, reap, one hop, clean stop) and ``ringd status --json`` on a journal of
   1,000 runs and of 1,000,000 runs: the big one must stay within 1.2x.
2. ``Journal.prune`` on the 1,000,000-run journal with ``keep_runs: 1000``: every
   batch (one transaction, as after each hop) must take under 50 ms, and the
   per-agent counters must not move.

    python3 benchmarks/bench_retention.py [--small 1000] [--big 1000000] [--repeat 7]

Journals are built directly in SQLite (finished runs with two events each) in a
temporary directory; the real ``ringd`` is started for the timings.
"""
from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ringd.journal.sqlite import PRUNE_BATCH, Journal  # noqa: E402

AGENTS = ("alpha", "beta", "gamma", "delta")


def build(state: Path, runs: int) -> None:
    state.mkdir(mode=0o700)
    Journal.open(state).close()   # the schema, exactly as the driver creates it
    con = sqlite3.connect(state / "journal.db", isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=OFF")
    t = time.time() - runs * 2.0
    con.execute("BEGIN")
    step = 50_000
    for start in range(0, runs, step):
        rows = []
        events = []
        for i in range(start, min(runs, start + step)):
            at = t + i * 2.0
            rows.append((i + 1, AGENTS[i % len(AGENTS)], i % len(AGENTS), "ok", at, at + 1.0, 1.0, 0,
                         f"/state/logs/{AGENTS[i % len(AGENTS)]}/{i + 1}.log"))
            events.append((at, i + 1, "started", "driver", f"agent={AGENTS[i % len(AGENTS)]}"))
            events.append((at + 1.0, i + 1, "ok", "driver", "from=running to=ok"))
        con.executemany("INSERT INTO runs(id, agent, position, status, started_at, ended_at, duration, exit_code,"
                        " log_path) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        con.executemany("INSERT INTO events(at, run_id, kind, source, detail) VALUES (?, ?, ?, ?, ?)", events)
    con.execute("COMMIT")
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    (state / "ring.txt").write_text("".join(f"{a} true\n" for a in AGENTS[:1]))
    os.chmod(state / "ring.txt", 0o600)


def timed(argv, env) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(argv, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if res.returncode not in (0, 3):
        raise SystemExit(f"{argv}: exit {res.returncode}: {res.stderr}")
    return took


def startup_and_status(state: Path, config: Path, repeat: int) -> tuple:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    common = ["--state", str(state), "--config", str(config)]
    run = [sys.executable, "-m", "ringd", "run", "--once", *common]
    status = [sys.executable, "-m", "ringd", "status", "--json", *common]
    timed(run, env)       # warm the page cache once, as on a box that has been running
    starts = [timed(run, env) for _ in range(repeat)]
    stats = [timed(status, env) for _ in range(repeat)]
    return statistics.median(starts), statistics.median(stats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=1000)
    ap.add_argument("--big", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as d:
        base = Path(d)
        config = base / "ring.yaml"
        config.write_text("ring:\n  keep_runs: 0\n")   # the timings measure the journal as built
        os.chmod(config, 0o600)
        figures = {}
        for label, n in (("small", args.small), ("big", args.big)):
            state = base / label
            t0 = time.perf_counter()
            build(state, n)
            size = (state / "journal.db").stat().st_size
            print(f"{n:>9} runs: built in {time.perf_counter() - t0:.1f}s, journal {size / 2**20:.1f} MiB")
            figures[label] = startup_and_status(state, config, args.repeat)
        (s_start, s_status), (b_start, b_status) = figures["small"], figures["big"]
        print(f"start-up (run --once, median of {args.repeat}): {s_start * 1000:.0f} ms on {args.small} runs, "
              f"{b_start * 1000:.0f} ms on {args.big} runs: x{b_start / s_start:.2f}")
        print(f"status --json (median of {args.repeat}):         {s_status * 1000:.0f} ms on {args.small} runs, "
              f"{b_status * 1000:.0f} ms on {args.big} runs: x{b_status / s_status:.2f}")
        ok &= b_start <= 1.2 * s_start and b_status <= 1.2 * s_status

        # pruning the big journal down to 1,000 runs, batch by batch
        j = Journal.open(base / "big")
        counts = j.run_counts()
        before = {a: s.runs for a, s in j.agent_states().items()}
        times = []
        while True:
            t0 = time.perf_counter()
            gone = j.prune(1000)
            times.append(time.perf_counter() - t0)
            if not gone:
                break
        left = j.con.execute("SELECT count(*) FROM runs").fetchone()[0]
        events = j.con.execute("SELECT count(*) FROM events").fetchone()[0]
        same = j.run_counts() == counts and {a: s.runs for a, s in j.agent_states().items()} == before
        j.close()
        times.sort()
        print(f"prune to keep_runs=1000: {len(times)} batches of <= {PRUNE_BATCH} runs; per batch median "
              f"{statistics.median(times) * 1000:.1f} ms, p99 {times[int(len(times) * 0.99)] * 1000:.1f} ms, "
              f"max {times[-1] * 1000:.1f} ms; {left} runs and {events} events left; counters unchanged: {same}")
        ok &= times[-1] < 0.050 and left == 1000 and same
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
