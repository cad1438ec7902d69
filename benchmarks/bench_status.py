#!/usr/bin/env python3
"""Benchmark: how long does an operator wait for ``ringd status``?

Builds a journal of 100,000 runs (and one of 1,000, to show the cost does not
grow with history) for a 200-agent roster, then measures the median wall time
of ``ringd status --json`` and ``ringd status`` (the table) as subprocesses,
beside ``supervisorctl status`` for one program, measured in the same run
(supervisor is installed into a venv this benchmark creates in a temp dir; if
pip cannot install it, that comparison is skipped with a message).

Goals (issue 4): ``status --json`` no slower than ``supervisorctl status``, the
table within 2x of it, both independent of journal size.

``--quota`` (issue 32): the big journal also holds a use of a quota pool on
every run, and ``ringd status`` is timed, interleaved, with a config of 5
pools and every agent on one beside the same config without them (every
agent's ``quota: null``). Goal: within 1.1x.

    python benchmarks/bench_status.py [--runs 100000] [--agents 200] [--repeat 21] [--quota]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ringd.host.atomicfile import write_json_atomic  # noqa: E402
from ringd.core.timefmt import iso
from ringd.host.procid import start_ticks  # noqa: E402
from ringd.journal.sqlite import Journal, journal_path  # noqa: E402

STATUSES = ("ok",) * 16 + ("failed", "deferred", "timeout", "skipped")


def build_state(base: Path, runs: int, agents: int) -> Path:
    """A state dir with a roster of ``agents`` agents, a journal of ``runs`` closed
    runs (two events each, like the driver writes) and a fresh heartbeat."""
    state = base / f"state-{runs}"
    state.mkdir(mode=0o700)
    names = [f"agent-{i:03d}" for i in range(agents)]
    roster = state / "ring.txt"
    roster.write_text("".join(f"{n} true --run {n}\n" for n in names))
    os.chmod(roster, 0o600)
    Journal.open(state).close()  # the schema, exactly as the driver creates it
    con = sqlite3.connect(journal_path(state), isolation_level=None)
    con.execute("PRAGMA synchronous=OFF")
    t0 = time.time() - runs * 30.0
    con.execute("BEGIN")
    rows = []
    for i in range(runs):
        status = STATUSES[i % len(STATUSES)]
        start = t0 + i * 30.0
        rows.append((names[i % agents], i % agents, status, start, start + 12.5, 12.5,
                     None if status == "skipped" else (0 if status == "ok" else 1),
                     "operator requested skip" if status == "skipped" else None))
        if len(rows) >= 10_000:
            _insert(con, rows)
            rows = []
    _insert(con, rows)
    con.execute("COMMIT")
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    # A live driver as far as status can tell: this process, beating now.
    me = os.getpid()
    write_json_atomic(state / "ringd.heartbeat", {
        "pid": me, "pid_start": start_ticks(me), "started_at": iso(time.time() - 3600),
        "at": iso(time.time()), "at_epoch": time.time(), "lap": runs // agents, "agent": None,
        "run_id": None, "seq": 1, "stopped": False})
    return state


def _insert(con: sqlite3.Connection, rows) -> None:
    if not rows:
        return
    first = con.execute("SELECT coalesce(max(id), 0) FROM runs").fetchone()[0] + 1
    con.executemany("INSERT INTO runs(agent, position, status, started_at, ended_at, duration, exit_code, reason)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    events = []
    for k, r in enumerate(rows):
        events.append((r[3], first + k, "started", "driver", f"agent={r[0]}"))
        events.append((r[4], first + k, r[2], "driver", f"from=running to={r[2]}"))
    con.executemany("INSERT INTO events(at, run_id, kind, source, detail) VALUES (?, ?, ?, ?, ?)", events)


POOLS = 5
QUOTA_RATIO_GOAL = 1.1


def add_quota_use(state: Path) -> int:
    """A use on every run of the journal, in the pool of its agent (agent i
    draws on pool i % POOLS), at the run's end; returns how many are inside a
    5 h window."""
    con = sqlite3.connect(journal_path(state), isolation_level=None)
    con.execute("PRAGMA synchronous=OFF")
    con.execute("BEGIN")
    con.execute(f"INSERT INTO quota_use(run_id, pool, agent, units, at) SELECT id, 'pool' || (position % {POOLS}),"
                " agent, 1000 + id % 97, ended_at FROM runs")
    con.execute("COMMIT")
    inside = con.execute("SELECT count(*) FROM quota_use WHERE at > ?", (time.time() - 5 * 3600,)).fetchone()[0]
    con.close()
    return inside


def quota_configs(base: Path, agents: int):
    """(with pools, without): the same agents section, its ``quota`` keys naming a
    pool or null (the same YAML to parse: pure-Python PyYAML costs by the token)."""
    names = [f"agent-{i:03d}" for i in range(agents)]
    pools = "quotas:\n" + "".join(f"  pool{k}: {{limit: 10000000, window: 5h}}\n" for k in range(POOLS))
    with_pools = pools + "agents:\n" + "".join(f"  {n}: {{quota: pool{i % POOLS}}}\n" for i, n in enumerate(names))
    without = "agents:\n" + "".join(f"  {n}: {{quota: null}}\n" for n in names)
    out = []
    for name, text in (("pools.yaml", with_pools), ("plain.yaml", without)):
        path = base / name
        path.write_text(text)
        os.chmod(path, 0o600)
        out.append(path)
    return out


def bench_quota(big: Path, base: Path, args, env) -> None:
    inside = add_quota_use(big)
    pools, plain = quota_configs(base, args.agents)
    doc = json.loads(subprocess.run([sys.executable, "-m", "ringd", "status", "--json", "--state", str(big),
                                     "--config", str(pools)], capture_output=True, env=env, timeout=60).stdout)
    assert len(doc["quotas"]) == POOLS and all(q["used"] > 0 for q in doc["quotas"]), doc["quotas"]
    times = {k: [] for k in ("json-pools", "json-plain", "table-pools", "table-plain")}
    for _ in range(args.repeat):   # interleaved: a box whose speed drifts moves both alike
        for kind, extra in (("json", ["--json"]), ("table", [])):
            for label, cfg in (("pools", pools), ("plain", plain)):
                refresh_heartbeat(big)
                times[f"{kind}-{label}"] += measure([sys.executable, "-m", "ringd", "status", "--state", str(big),
                                                     "--config", str(cfg), *extra], 1, env)
    inproc = {"pools": [], "plain": []}
    from ringd.cli.render import status_lines
    from ringd.cli.status import gather_status
    from ringd.inputs.config import load_config
    for _ in range(3 * args.repeat):   # the command less the interpreter: config, journal, table
        for label, cfg in (("pools", pools), ("plain", plain)):
            refresh_heartbeat(big)
            t = time.perf_counter()
            status_lines(gather_status(big, load_config(cfg)))
            inproc[label].append(time.perf_counter() - t)
    print(f"\nquota: {args.runs:,} runs each with a use, {inside:,} of them inside the 5 h window; "
          f"{POOLS} pools, every one of {args.agents} agents on one (median of {args.repeat}, interleaved)")
    for kind in ("json", "table"):
        ratio = statistics.median(times[f"{kind}-pools"]) / statistics.median(times[f"{kind}-plain"])
        paired = statistics.median(a / b for a, b in zip(times[f"{kind}-pools"], times[f"{kind}-plain"]))
        print(f"  status {kind:5} with pools {ms(times[f'{kind}-pools'])}")
        print(f"  status {kind:5} without    {ms(times[f'{kind}-plain'])}")
        print(f"    with / without = {ratio:.3f}x (paired {paired:.3f}x)  goal <= {QUOTA_RATIO_GOAL:g}x  "
              f"{'PASS' if ratio <= QUOTA_RATIO_GOAL else 'MISS'}")
    ratio = statistics.median(inproc["pools"]) / statistics.median(inproc["plain"])
    print(f"  in-process (config, journal, table; no interpreter start) with pools {ms(inproc['pools'])}")
    print(f"  in-process                                            without    {ms(inproc['plain'])}")
    print(f"    with / without = {ratio:.3f}x  (the cost the pools add, less the noise of starting a process: "
          f"{1e3 * (statistics.median(inproc['pools']) - statistics.median(inproc['plain'])):.1f} ms)")


def refresh_heartbeat(state: Path) -> None:
    hb = json.loads((state / "ringd.heartbeat").read_text())
    hb.update(at=iso(time.time()), at_epoch=time.time())
    write_json_atomic(state / "ringd.heartbeat", hb)


def measure(argv, repeat: int, env=None, before=None, ok_codes=(0,)) -> list:
    times = []
    for _ in range(repeat):
        if before:
            before()
        t0 = time.perf_counter()
        res = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, timeout=60)
        times.append(time.perf_counter() - t0)
        if res.returncode not in ok_codes:
            raise SystemExit(f"{' '.join(map(str, argv[:4]))} ... exited {res.returncode}: "
                             f"{res.stderr.decode(errors='replace')[:300]}")
    return times


RINGD_DEPS = ("psutil", "PyYAML", "click", "sdnotify", "rich")


def setup_venv(base: Path):
    """One venv holding supervisor *and* ringd's dependencies, so both tools start
    from the same clean interpreter (the host's site-packages may carry .pth files
    that slow every start-up). Returns (venv python, None) or (None, reason)."""
    venv = base / "venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
        pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                              "--disable-pip-version-check", "supervisor", *RINGD_DEPS],
                             capture_output=True, text=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as e:
        return None, f"could not create the venv: {e}"
    if pip.returncode != 0:
        return None, f"pip could not install supervisor: {(pip.stderr or pip.stdout).strip()[-300:]}"
    return venv / "bin" / "python", None


def setup_supervisor(base: Path, venv_python: Path):
    """A supervisord with one program. Returns (supervisorctl argv, Popen) or (None, reason)."""
    bindir = venv_python.parent
    sock = base / "sup.sock"
    conf = base / "supervisord.conf"
    conf.write_text(f"""[unix_http_server]
file={sock}
chmod=0700

[supervisord]
nodaemon=true
logfile={base / 'supervisord.log'}
pidfile={base / 'supervisord.pid'}
childlogdir={base}

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://{sock}

[program:sleeper]
command=sleep 3600
autorestart=true
""")
    daemon = subprocess.Popen([str(bindir / "supervisord"), "-c", str(conf)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ctl = [str(bindir / "supervisorctl"), "-c", str(conf), "status"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        res = subprocess.run(ctl, capture_output=True, text=True, timeout=30)
        if "RUNNING" in res.stdout:
            return ctl, daemon
        if daemon.poll() is not None:
            break
        time.sleep(0.1)
    stop_supervisor(daemon)
    return None, "supervisord did not come up within 30 s"


def stop_supervisor(daemon: subprocess.Popen) -> None:
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)  # supervisord stops its program, then exits
        try:
            daemon.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait(timeout=5)


def ms(times) -> str:
    return f"{statistics.median(times) * 1000:7.1f} ms (min {min(times) * 1000:6.1f}, max {max(times) * 1000:6.1f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=100_000)
    ap.add_argument("--small", type=int, default=1_000, help="runs in the small journal (size independence)")
    ap.add_argument("--agents", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--no-supervisor", action="store_true")
    ap.add_argument("--quota", action="store_true", help="also time status with 5 quota pools beside without")
    args = ap.parse_args()

    base = Path(tempfile.mkdtemp(prefix="ring-bench-"))
    daemon = None
    try:
        t = time.perf_counter()
        big = build_state(base, args.runs, args.agents)
        t_big = time.perf_counter() - t
        small = build_state(base, args.small, args.agents)
        print(f"journal: {args.runs:,} runs, {args.agents} agents built in {t_big:.1f}s "
              f"({journal_path(big).stat().st_size / 1e6:.1f} MB); small journal: {args.small:,} runs")

        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   NO_COLOR="1", COLUMNS="80")
        env.pop("RING_CONFIG", None)
        # Byte-code caching on, as for an installed package (kept out of the repo).
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(base / "pycache")

        pythons = [("this python", Path(sys.executable))]
        venv_python, sup_note = (None, "skipped (--no-supervisor)")
        if not args.no_supervisor:
            venv_python, why = setup_venv(base)
            if venv_python is None:
                sup_note = f"skipped: {why}"
            else:
                pythons.insert(0, ("venv", venv_python))

        results = {}
        for py_label, py in pythons:
            def ringd(state, *extra, py=py):
                return [str(py), "-m", "ringd", "status", "--state", str(state), *extra]
            # warm the page cache and check the output once
            res = subprocess.run(ringd(big, "--json"), capture_output=True, env=env, timeout=60)
            doc = json.loads(res.stdout)
            assert len(doc["agents"]) == args.agents and doc["agents"][0]["runs"] > 0, doc["agents"][0]
            results[(py_label, "floor")] = measure([str(py), "-c", "pass"], args.repeat, env)
            for label, state in (("big", big), ("small", small)):
                beat = (lambda s=state: refresh_heartbeat(s))
                results[(py_label, f"json-{label}")] = measure(ringd(state, "--json"), args.repeat, env, beat)
                results[(py_label, f"table-{label}")] = measure(ringd(state), args.repeat, env, beat)

        # in-process cost of gathering (no interpreter start-up), for the record
        from ringd.inputs.config import Config
        from ringd.cli.status import gather_status
        gather = {}
        for label, state in (("big", big), ("small", small)):
            ts = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                gather_status(state, Config())
                ts.append(time.perf_counter() - t)
            gather[label] = ts

        sup_times = None
        if venv_python is not None:
            ctl, daemon = setup_supervisor(base, venv_python)
            if ctl is None:
                sup_note, daemon = f"skipped: {daemon}", None
            else:
                sup_times = measure(ctl, args.repeat, env, ok_codes=(0, 3))
                sup_note = ms(sup_times)

        print(f"\nmedian wall time of {args.repeat} runs each (python {sys.version.split()[0]}, "
              f"{os.cpu_count()} cores; plain table as when piped):")
        for py_label, _ in pythons:
            r = {k[1]: v for k, v in results.items() if k[0] == py_label}
            print(f"  [{py_label}]")
            print(f"    python -c pass (interpreter floor)     {ms(r['floor'])}")
            print(f"    ringd status --json  {args.runs:>7,} runs   {ms(r['json-big'])}")
            print(f"    ringd status --json  {args.small:>7,} runs   {ms(r['json-small'])}")
            print(f"    ringd status (table) {args.runs:>7,} runs   {ms(r['table-big'])}")
            print(f"    ringd status (table) {args.small:>7,} runs   {ms(r['table-small'])}")
            if py_label == "venv":
                print(f"    supervisorctl status (1 program)       {sup_note}")
        if venv_python is None:
            print(f"  supervisorctl status (1 program): {sup_note}")
        print(f"  gather_status in-process {args.runs:>7,} runs {ms(gather['big'])}")
        print(f"  gather_status in-process {args.small:>7,} runs {ms(gather['small'])}")

        if args.quota:
            bench_quota(big, base, args, env)

        py_label = pythons[0][0]
        med = {k[1]: statistics.median(v) for k, v in results.items() if k[0] == py_label}
        print(f"\nchecks ({py_label}):")
        print(f"  size independence: status --json {args.runs:,}/{args.small:,} = "
              f"{med['json-big'] / med['json-small']:.2f}x, table {med['table-big'] / med['table-small']:.2f}x, "
              f"in-process {statistics.median(gather['big']) / statistics.median(gather['small']):.2f}x")
        if sup_times:
            s = statistics.median(sup_times)
            print(f"  status --json vs supervisorctl: {med['json-big'] / s:.2f}x "
                  f"({'OK' if med['json-big'] <= s else 'SLOWER'}; goal <= 1x)")
            print(f"  status table  vs supervisorctl: {med['table-big'] / s:.2f}x "
                  f"({'OK' if med['table-big'] <= 2 * s else 'SLOWER'}; goal <= 2x)")
        return 0
    finally:
        if daemon is not None:
            stop_supervisor(daemon)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
