#!/usr/bin/env python3
"""A ring on PostgreSQL (issue 13): failover time and lap overhead.

Run from the repo root (needs Debian's ``postgresql`` for initdb/pg_ctl and
``pip install -e '.[pg]'``; runs the server as ``postgres`` when root):

    python3 benchmarks/bench_pg.py [--kills 20] [--ttl 3] [--agents 200] [--reps 3]

1. Failover: two "hosts" (two state dirs, one database), a ring of agents
   sleeping 1 s. ``--kills`` times: SIGKILL the leader driver and its agent (the
   box dies), measure until the standby's heartbeat says ``leader`` and until
   its first agent is running; the killed one comes back as the next standby.
   Median and max, beside the bound ``lease_ttl + 1 s``.
2. Lap overhead: ``ringd run --once`` over ``--agents`` agents running
   ``/bin/true``, journal in SQLite (state dir) and in PostgreSQL (local unix
   socket, fsync and synchronous_commit on, like SQLite's synchronous=FULL),
   interleaved, median of ``--reps``, per agent; the lap is read from the
   journal (first start to last end), so driver start-up is not counted.

The server is a throwaway cluster under /tmp (tests/pgcluster.py), removed at
the end. Processes are killed by pid only. Exit 0 unless the harness breaks.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from pgcluster import PgCluster, pg_bindir  # noqa: E402


def env():
    e = dict(os.environ)
    e.pop("NOTIFY_SOCKET", None)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def make_host(base: Path, name: str, config: str, roster: str) -> Path:
    d = base / name
    (d / "state").mkdir(parents=True, mode=0o700)
    (d / "ring.yaml").write_text(config)
    os.chmod(d / "ring.yaml", 0o600)
    (d / "state" / "ring.txt").write_text(roster)
    os.chmod(d / "state" / "ring.txt", 0o600)
    return d


def start_driver(host: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ringd", "run", "--state", str(host / "state"),
                             "--config", str(host / "ring.yaml"), *extra],
                            env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def role(host: Path):
    try:
        return json.loads((host / "state" / "ringd.heartbeat").read_text()).get("role")
    except (OSError, ValueError):
        return None


def poll(pred, timeout, interval=0.005):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return None


def kill_session(p: subprocess.Popen) -> None:
    """The driver (its agents run in sessions of their own)."""
    try:
        os.kill(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def failover(cluster: PgCluster, base: Path, kills: int, ttl: float):
    import psycopg
    dsn = cluster.fresh_dsn()
    agent = base / "nap.sh"
    agent.write_text("#!/bin/sh\nsleep 1\n")
    agent.chmod(0o755)
    config = (f"ring:\n  journal: '{dsn}'\n  lease_ttl: {ttl}\n  heartbeat_interval: 0.2\n"
              f"  run_budget: 60\n  stall_threshold: 90\n")
    roster = "".join(f"a{i} {agent}\n" for i in range(3))
    hosts = [make_host(base, n, config, roster) for n in ("a", "b")]
    procs = {hosts[0]: start_driver(hosts[0])}
    poll(lambda: role(hosts[0]) == "leader", 20)
    procs[hosts[1]] = start_driver(hosts[1])
    poll(lambda: role(hosts[1]) == "standby", 20)
    to_lead, to_run = [], []
    con = psycopg.connect(dsn, autocommit=True)
    try:
        for _ in range(kills):
            leader = next(h for h in hosts if role(h) == "leader")
            standby = next(h for h in hosts if h is not leader)
            poll(lambda: role(standby) == "standby", 20)
            row = poll(lambda: con.execute("SELECT id, pid FROM runs WHERE status = 'running' "
                                           "AND pid IS NOT NULL").fetchone(), 20)
            kill_session(procs[leader])
            try:
                os.killpg(row[1], signal.SIGKILL)
            except ProcessLookupError:
                pass
            t0 = time.monotonic()
            poll(lambda: role(standby) == "leader", ttl * 3)
            to_lead.append(time.monotonic() - t0)
            poll(lambda: con.execute("SELECT 1 FROM runs WHERE status = 'running' AND id > %s",
                                     (row[0],)).fetchone(), ttl * 3)
            to_run.append(time.monotonic() - t0)
            procs[leader] = start_driver(leader)  # the dead box comes back: next standby
    finally:
        for p in procs.values():
            kill_session(p)
        # the agent of the last leader, by the pid its run row names
        for (pid,) in con.execute("SELECT pid FROM runs WHERE status = 'running' AND pid IS NOT NULL"):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        con.close()
    return to_lead, to_run


def lap(host: Path, journal_rows) -> float:
    subprocess.run([sys.executable, "-m", "ringd", "run", "--once", "--state", str(host / "state"),
                    "--config", str(host / "ring.yaml")], env=env(), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first, last = journal_rows()
    return last - first


def laps(cluster: PgCluster, base: Path, agents: int, reps: int):
    import psycopg
    import sqlite3
    roster = "".join(f"t{i} /bin/true\n" for i in range(agents))
    dsn = cluster.fresh_dsn()
    sq = make_host(base, "lap-sqlite", "ring:\n  heartbeat_interval: 10\n", roster)
    pg = make_host(base, "lap-pg", f"ring:\n  heartbeat_interval: 10\n  journal: '{dsn}'\n", roster)

    def sq_rows():
        con = sqlite3.connect(sq / "state" / "journal.db")
        try:
            return con.execute(f"SELECT min(started_at), max(ended_at) FROM (SELECT * FROM runs "
                               f"ORDER BY id DESC LIMIT {agents})").fetchone()
        finally:
            con.close()

    def pg_rows():
        with psycopg.connect(dsn) as con:
            return con.execute(f"SELECT min(started_at), max(ended_at) FROM (SELECT * FROM runs "
                               f"ORDER BY id DESC LIMIT {agents}) t").fetchone()
    lap(sq, sq_rows)   # untimed warm-ups: journal and log folders exist
    lap(pg, pg_rows)
    out = {"sqlite": [], "postgresql": []}
    for _ in range(reps):
        out["sqlite"].append(lap(sq, sq_rows))
        out["postgresql"].append(lap(pg, pg_rows))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--ttl", type=float, default=3.0)
    ap.add_argument("--agents", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    bindir = pg_bindir()
    if bindir is None:
        print("bench_pg: PostgreSQL server binaries not found (apt-get install postgresql)")
        return 1
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    cluster = PgCluster(bindir, fsync=True)
    base = Path(tempfile.mkdtemp(prefix="ring-bench-pg-"))
    try:
        to_lead, to_run = failover(cluster, base, args.kills, args.ttl)
        bound = args.ttl + 1.0
        print(f"\nfailover over {len(to_lead)} kills of the leader (lease_ttl {args.ttl:g}s):")
        print(f"  {'':28} {'median':>8} {'max':>8}")
        print(f"  {'kill -> standby leads':28} {statistics.median(to_lead):7.2f}s {max(to_lead):7.2f}s"
              f"   {'PASS' if max(to_lead) <= bound else 'MISS'} (<= lease_ttl + 1 s = {bound:g}s)")
        print(f"  {'kill -> next agent running':28} {statistics.median(to_run):7.2f}s {max(to_run):7.2f}s")
        res = laps(cluster, base, args.agents, args.reps)
        sq, pg = statistics.median(res["sqlite"]), statistics.median(res["postgresql"])
        print(f"\nlap of {args.agents} agents running /bin/true (median of {args.reps}, interleaved):")
        print(f"  {'journal':12} {'lap':>8} {'per agent':>10}")
        print(f"  {'SQLite':12} {sq:7.3f}s {sq / args.agents * 1000:8.2f}ms")
        print(f"  {'PostgreSQL':12} {pg:7.3f}s {pg / args.agents * 1000:8.2f}ms   ({pg / sq:.2f}x SQLite)")
    finally:
        cluster.destroy()
        import shutil
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
