#!/usr/bin/env python3
"""What parking a run's notify socket saves a hop: a parked socket's reuse and
park (two renames, an lstat, a purge that finds nothing) against a fresh
socket's open and close (a bind, which allocates an inode, and an unlink).

    python3 benchmarks/bench_notify_park.py [--runs 2000] [--batches 5] [--dir /tmp]

Batches of each alternate in one process, in a fresh directory under ``--dir``
(the file system of the state dir is what counts); printed: each batch's
median per run, then the medians of those. Information only: compare the
difference with a hop (bench_lap.py, ms/agent).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ringd.host.notify import NotifySocket  # noqa: E402 - the checkout's, without an install


def parked(state: Path, first: int, runs: int) -> float:
    ns = NotifySocket.open(state, first, sweep=False)
    assert ns.park(state)
    times = []
    for run_id in range(first + 1, first + 1 + runs):
        t = time.perf_counter()
        ns = ns.reuse(state, run_id)
        assert ns is not None and ns.park(state)
        times.append(time.perf_counter() - t)
    ns.close()
    return statistics.median(times)


def fresh(state: Path, first: int, runs: int) -> float:
    times = []
    for run_id in range(first, first + runs):
        t = time.perf_counter()
        NotifySocket.open(state, run_id, sweep=False).close()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2000, help="runs per batch (default 2000)")
    ap.add_argument("--batches", type=int, default=5, help="batches of each (default 5)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the state dir is made")
    args = ap.parse_args()
    got = {"parked": [], "fresh": []}
    with tempfile.TemporaryDirectory(prefix="ring-park-", dir=args.dir) as tmp:
        state = Path(tmp)
        run_id = 1
        for batch in range(args.batches):
            for kind, bench in (("parked", parked), ("fresh", fresh)):
                got[kind].append(bench(state, run_id, args.runs) * 1e6)
                run_id += args.runs + 1
            print(f"  batch {batch + 1}: parked {got['parked'][-1]:.1f} us, fresh {got['fresh'][-1]:.1f} us per run",
                  flush=True)
    p, f = statistics.median(got["parked"]), statistics.median(got["fresh"])
    print(f"\n  per run (median of batch medians): parked {p:.1f} us, fresh {f:.1f} us; parking saves {f - p:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
