"""Two source trees of ring, side by side: the lap of a running driver of each
(``--fresh``: of a fresh ``ringd run --once``), and the bash ``timeout`` loop,
interleaved rep by rep in one process, the two trees taking turns to go first.

    python3 benchmarks/bench_ab.py OLD_TREE NEW_TREE [--reps 10] [--agents 200] [--fresh]

A tree is a checkout of the repository (``git worktree add /tmp/old <commit>``);
each driver runs with ``PYTHONPATH`` set to its tree. This VM's timings drift
by 30 % and more within minutes (steal time when its host is busy), so a change
of a few percent is only visible when the two trees are measured in turn, rep
after rep: the figure to read is the median of the per-rep ratios, new / old,
and each tree's median ratio to bash within the same reps. Every ring is made
and warmed up as in bench_lap.py (KEEP_LOGS laps, so each timed hop prunes a
log), and every process is stopped by pid.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_lap as lap  # noqa: E402 - the same ring, warm-up and timing as the lap benchmark


def median_hop(state: Path, before: int, n: int) -> float:
    """The median time from one run's start to the next's over the timed laps (2 and 3)."""
    starts = [r[0] for r in lap.journal_query(state, "SELECT started_at FROM runs WHERE id > ? ORDER BY id LIMIT ?",
                                              (before, 3 * n))][n:]
    return statistics.median(b - a for a, b in zip(starts, starts[1:]))


def first_hops(state: Path, before: int) -> float:
    """A fresh driver's first two hops: its first run's start to its third's."""
    starts = [r[0] for r in lap.journal_query(state, "SELECT started_at FROM runs WHERE id > ? ORDER BY id LIMIT 3",
                                              (before,))]
    return starts[2] - starts[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, help="the tree before the change")
    ap.add_argument("new", type=Path, help="the tree after it")
    ap.add_argument("--reps", type=int, default=10, help="interleaved repetitions (default 10)")
    ap.add_argument("--agents", type=int, default=200, help="agents in each ring (default 200)")
    ap.add_argument("--fresh", action="store_true",
                    help="time a fresh driver's lap (`ringd run --once`) instead of a running one's")
    args = ap.parse_args()
    trees = [args.old.resolve(), args.new.resolve()]
    for t in trees:
        if not (t / "ringd" / "__init__.py").is_file():
            print(f"{t}: not a ring source tree (no ringd/__init__.py)", file=sys.stderr)
            return 2
    n = args.agents
    print(f"ring bench_ab: {n} agents of /bin/true, {args.reps} reps, load avg "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    with tempfile.TemporaryDirectory(prefix="ring-ab-") as tmp:
        root = Path(tmp)
        rings = []
        for i, tree in enumerate(trees):
            env = dict(os.environ, PYTHONPATH=str(tree))
            env.pop("NOTIFY_SOCKET", None)
            state, config = lap.make_ring(root, f"ring{i}", [f"a{k:03d} /bin/true" for k in range(n)])
            for _ in range(lap.KEEP_LOGS):
                lap.ringd_once(state, config, env)
            rings.append((state, config, env))
        hop_kind = "first two hops" if args.fresh else "median hop"
        laps = {0: [], 1: [], "bash": []}
        hops = {0: [], 1: []}
        for rep in range(args.reps):
            # the trees take turns going first: with a fixed order a tree measured against itself drifted
            for i in ((0, 1) if rep % 2 == 0 else (1, 0)):
                state, config, env = rings[i]
                before = lap.journal_query(state, "SELECT max(id) FROM runs")[0][0]
                if args.fresh:
                    laps[i].append(lap.time_ringd_lap(state, config, n, env)["lap"])
                    hops[i].append(first_hops(state, before))
                else:
                    laps[i].append(lap.time_ringd_running(state, config, n, env))
                    hops[i].append(median_hop(state, before, n))
            laps["bash"].append(lap.time_bash_loop(n))
            print(f"  rep {rep + 1}/{args.reps}: old {laps[0][-1] / n * 1e3:.2f}  new {laps[1][-1] / n * 1e3:.2f}"
                  f"  bash {laps['bash'][-1] / n * 1e3:.2f} ms/agent; {hop_kind} old {hops[0][-1] * 1e3:.3f}"
                  f"  new {hops[1][-1] * 1e3:.3f} ms", flush=True)
    med = {k: statistics.median(v) / n * 1e3 for k, v in laps.items()}
    to_bash = {i: statistics.median(a / b for a, b in zip(laps[i], laps["bash"])) for i in (0, 1)}
    new_old = statistics.median(b / a for a, b in zip(laps[0], laps[1]))
    print(f"\n  old {trees[0]}: {med[0]:.2f} ms/agent, {to_bash[0]:.2f}x bash (median of per-rep ratios)")
    print(f"  new {trees[1]}: {med[1]:.2f} ms/agent, {to_bash[1]:.2f}x bash")
    print(f"  bash timeout loop: {med['bash']:.2f} ms/agent")
    print(f"  new / old: {new_old:.3f} (median of per-rep ratios)")
    hop_ratio = statistics.median(b / a for a, b in zip(hops[0], hops[1]))
    if args.fresh:
        print(f"  first two hops of a fresh lap (first run's start to the third's): old "
              f"{statistics.median(hops[0]) * 1e3:.1f}, new {statistics.median(hops[1]) * 1e3:.1f} ms (medians)")
        return 0
    print(f"  median hop (one run's start to the next's, laps 2-3): old {statistics.median(hops[0]) * 1e3:.3f},"
          f" new {statistics.median(hops[1]) * 1e3:.3f} ms; new / old {hop_ratio:.3f} (information: a median"
          f" leaves out the hops a busy host stretched, so it shows a small change the lap's mean hides)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
