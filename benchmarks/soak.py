#!/usr/bin/env python3
"""Fault-injection soak (issue 5): ringwatch + ringd on a ring of every kind of
agent with sub-second budgets, while a chaos loop injects faults, then proves
the ring lost nothing, leaked nothing and kept turning.

    python3 benchmarks/soak.py [--seconds 120] [--seed N] [--keep] [--workdir DIR] [--pg] [--only KINDS]

Faults, injected in shuffled rounds (each kind once per round, so every kind
gets a bounded, near-equal share): SIGKILL and SIGSTOP of the driver, SIGKILL
of the running agent, ``ringd skip`` (current run) and ``ringd skip NAME``,
roster edits (valid edit, broken then fixed, agent removed then re-added, agent
added then removed), SIGKILL of ringwatch followed by a fresh ringwatch, the
lock file deleted (then a second driver started: it must refuse), a SIGHUP
storm at the driver and the watcher, and a roster of unstartable programs for
a few seconds (the driver must keep beating and not spin). This round's:
journal.db-wal and -shm deleted under the driver, then an operator's pause that
must hold and a resume that must lift it; the state dir's file system (a small
tmpfs of the soak's own, root only) out of inodes for a few seconds: no run may
be recorded `error`; with ``--pg`` (the journal on a throwaway PostgreSQL
cluster) ``pg_terminate_backend`` of the driver's server processes: the run in
flight must end with its own status; and ``nobody`` passing hundreds of
lingering TCP sockets to the notify socket of a well-behaved pinging agent's
run: it must never be `stalled`, and the driver's descriptors must come back.
A kind that cannot be injected here (not root, SQLite or PostgreSQL) is listed
as skipped. One agent leaves a grandchild that leaves its session and clears
its environment (`setsid env -i`) every run: it must die with its run. Two
reader threads run ``ringd status --json`` and ``ringd history --json`` all
along. After each fault the loop waits (bounded) for the ring to recover; a
fault counts as survived when it did.

At the end everything is stopped and checked:
- nothing lost: every run id an agent wrote to its marks file has its row; no
  row left ``running``; every terminal row coherent (times, exit code / signal
  vs status, exactly one closing event); ``PRAGMA integrity_check`` ok (on
  PostgreSQL: amcheck's ``bt_index_check`` of the journal's indexes); per-agent
  counters equal the rows (rows lost with a removed WAL are named apart, and fail it too);
- one at a time: never two runs' processes alive at once (sampled);
- nothing leaked: no process of the soak alive afterwards; the driver's open
  descriptors do not grow across hops (sampled with psutil ``num_fds``);
- the ring kept turning: every healthy agent ran in every stretch of two laps;
- no reader ever saw "database is locked", a traceback or broken JSON.

Prints a table (fault kind / injected / survived) and the checks; exits 1 if
any check failed or any fault was not survived. Processes are addressed by pid
(and start time) only, never by name. The core, :func:`run_soak`, is imported
by ``tests/system/test_soak.py``.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set, Tuple

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from ringd.host.procid import same_process, start_ticks  # noqa: E402  (pid + start ticks, as ring judges identity)

RECOVER = 25.0          # s: bound on every recovery wait (a loaded 2-core box is slow)
FD_SLACK = 3            # descriptors a driver may legitimately vary by across hops

CONFIG = """\
ring:
  run_budget: 0.6
  stall_threshold: 1.2
  heartbeat_interval: 0.2
  lap_pause: 0
  backoff_initial: 0.5
  backoff_max: 1.5
  keep_logs: 5
  quarantine_after: 3
  quarantine_cooloff: 4
watch:
  poll_interval: 0.2
  stale_after: 1.5
  restart_sec: 0.2
  start_limit_burst: 10000
  start_limit_interval: 60
agents:
  pinger: {watchdog: 1.5, run_budget: 4, stall_threshold: 5}
"""
PG_RING = '  journal: "{dsn}"\n  lease_ttl: 5\n'   # added to the ring section for --pg

# name -> (shell body, healthy: exits by itself promptly, so it must run every lap)
AGENTS: Dict[str, Tuple[str, bool]] = {
    "ok":       ("echo ok", True),
    "fail":     ("echo failing >&2; exit 3", True),
    "slow":     ("exec sleep 5", False),                                   # timeout at the budget
    "wedge":    ("trap '' TERM\nsetsid sh -c 'trap \"\" TERM; exec sleep 30' &\n"
                 "while :; do sleep 0.05; done", False),                   # stalled; escaped grandchild
    "tempfail": ("exit 75", False),                                        # deferred, backs off
    "chatty":   ("head -c 300000 /dev/zero | od -v | head -n 4000", True),  # prints a lot
    "quick":    ("sleep 0.1", True),
    "forker":   ("for i in 1 2 3; do (sleep 0.05 &); done; sleep 0.05", True),
    # an escapee with no key at all: its own session, an empty environment; its
    # command line names the work dir (ESCAPEE) so the samplers can see it
    "escaper":  ("setsid env -i {python} -c 'import time; time.sleep(30)' {escapee} &\nsleep 0.05", True),
    # well-behaved talker: pings its watchdog (1.5 s) every 0.1 s for 2 s
    "pinger":   ("exec {python} - <<'EOF'\nimport os, socket, time\n"
                 "addr = os.environ['NOTIFY_SOCKET']\naddr = '\\0' + addr[1:] if addr.startswith('@') else addr\n"
                 "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\nend = time.monotonic() + 2.0\n"
                 "while time.monotonic() < end:\n    try:\n        s.sendto(b'WATCHDOG=1', addr)\n"
                 "    except OSError:\n        pass\n    time.sleep(0.1)\nEOF", True),
    "extra":    ("echo extra", True),                                      # only while added
}
BASE = ["ok", "fail", "slow", "wedge", "tempfail", "chatty", "quick", "forker", "escaper", "pinger"]
UNSTARTABLE_FOR = 3.0    # s a roster of unstartable programs stays in place

KINDS = ["driver SIGKILL", "driver SIGSTOP", "agent SIGKILL", "skip current", "skip named",
         "roster valid edit", "roster broken+fixed", "roster remove+re-add", "roster add+remove",
         "ringwatch SIGKILL+fresh", "lock file deleted", "SIGHUP storm", "unstartable roster",
         "WAL removed", "inodes exhausted", "PG connection dropped", "fds passed by nobody"]
READERS = "readers status/history"
TMPFS_SIZE, TMPFS_INODES = "256m", 4096   # the state dir's own file system (root only)
FILL_FOR = 3.0           # s the state dir's file system stays out of inodes
FLOOD_SOCKETS = 300      # lingering TCP sockets passed to a run's notify socket by another user
FLOOD_PER_DATAGRAM = 100 # (the kernel takes at most 253 a datagram)
LINGER = 60              # s a passed socket's last close would block: longer than any recovery wait


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class SoakResult:
    seconds: float
    faults: Dict[str, List[int]]            # kind -> [injected, survived]
    checks: List[Check]
    figures: Dict[str, object]
    notes: List[str] = field(default_factory=list)
    recovery: Dict[str, List[float]] = field(default_factory=dict)
    skipped: Dict[str, str] = field(default_factory=dict)   # kind -> why it was not injected at all

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks) and all(s == i for i, s in self.faults.values())

    def table(self) -> str:
        out = [f"{'fault kind':<28}{'injected':>9}{'survived':>10}   recovered in (mean / max)"]
        for kind, (i, s) in self.faults.items():
            if kind in self.skipped:
                out.append(f"{kind:<28}{'-':>9}{'-':>10}   skipped: {self.skipped[kind]}")
                continue
            rec = self.recovery.get(kind) or []
            times = f"   {sum(rec) / len(rec):.1f}s / {max(rec):.1f}s" if rec else ""
            out.append(f"{kind:<28}{i:>9}{s:>10}{times}{'' if i == s else '   <-- NOT SURVIVED'}")
        out.append("")
        for c in self.checks:
            out.append(f"[{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
        out.append("")
        for k, v in self.figures.items():
            out.append(f"{k}: {v}")
        notes = self.notes if len(self.notes) <= 30 else self.notes[:15] + ["..."] + self.notes[-15:]
        for n in notes:   # (the first say what broke first)
            out.append(f"note: {n}")
        return "\n".join(out)


class Tmpfs:
    """A small tmpfs of the soak's own for the state dir, so a fault can use up
    its inodes without touching the box's file systems. Root only."""

    def __init__(self, at: Path):
        self.at = at
        self.mounted = False

    def mount(self) -> Optional[str]:
        """Mount it; None when mounted, else why not (then the dir is a plain one)."""
        self.at.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            return "not root: no tmpfs of its own to fill"
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},nr_inodes={TMPFS_INODES},mode=0755",
                            "ring-soak", str(self.at)], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            return f"mount -t tmpfs failed: {r.stderr.strip()[:120]}"
        self.mounted = True
        return None

    def unmount(self) -> Optional[str]:
        """Unmount (retried while busy for 10 s, then lazily); a note when it was not clean."""
        if not self.mounted:
            return None
        end = time.monotonic() + 10
        while True:
            r = subprocess.run(["umount", str(self.at)], capture_output=True, text=True, timeout=30)
            if r.returncode == 0:
                self.mounted = False
                return None
            if time.monotonic() >= end:
                break
            time.sleep(0.2)
        subprocess.run(["umount", "-l", str(self.at)], capture_output=True, timeout=30)
        self.mounted = False
        return f"tmpfs {self.at} busy at the end ({r.stderr.strip()[:120]}): unmounted lazily"


class PgRing:
    """A throwaway PostgreSQL cluster (tests/pgcluster.py's) with a fresh schema
    for the soak's ring; removed at the end."""

    def __init__(self):
        sys.path.insert(0, str(REPO / "tests"))
        try:
            import psycopg  # noqa: F401  (the ring's own driver for it)
            from pgcluster import PgCluster, pg_bindir
        except ImportError as e:
            raise SystemExit(f"soak: --pg needs psycopg and tests/pgcluster.py importable: {e}")
        bindir = pg_bindir()
        if bindir is None or not (bindir / "initdb").exists():
            raise SystemExit("soak: --pg needs PostgreSQL's server binaries (initdb, pg_ctl)")
        self.cluster = PgCluster(bindir)
        self.dsn = self.cluster.fresh_dsn()
        self._con = None
        self._lock = threading.Lock()

    def rows(self, sql: str, *params, _fetch: bool = True) -> List[dict]:
        """The soak's queries are SQLite's (``?``); PostgreSQL's placeholder is ``%s``."""
        import psycopg
        from psycopg.rows import dict_row
        with self._lock:
            for attempt in range(3):
                try:
                    if self._con is None or self._con.closed:
                        self._con = psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row,
                                                    application_name="ring-soak")
                    cur = self._con.execute(sql.replace("?", "%s"), params)
                    return cur.fetchall() if _fetch else []
                except psycopg.errors.UndefinedTable:
                    return []
                except psycopg.OperationalError:
                    self._con = None
                    if attempt == 2:
                        raise
                    time.sleep(0.2)
        return []

    def execute(self, sql: str) -> None:
        self.rows(sql, _fetch=False)

    def destroy(self) -> None:
        if self._con is not None:
            self._con.close()
        self.cluster.destroy()


class FdFlood:
    """FLOOD_SOCKETS TCP sockets whose last close blocks for LINGER s: each has
    unsent data its peer (held here, never read) will not take, and SO_LINGER
    on. Passed away, their close blocks whoever holds them last."""

    def __init__(self):
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # (inherited by the peers)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(FLOOD_SOCKETS + 16)
        self.peers: List[socket.socket] = []
        self.clients: List[socket.socket] = []
        for _ in range(FLOOD_SOCKETS):
            c = socket.socket()
            c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            c.connect(self.listener.getsockname())
            self.peers.append(self.listener.accept()[0])
            c.setblocking(False)
            try:
                while True:
                    c.send(b"x" * 65536)
            except BlockingIOError:
                pass
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, LINGER))
            self.clients.append(c)

    def drop_clients(self, last: bool = False) -> None:
        """Close our copies: never the last while the sender holds its own, or
        (``last``) abortively, so that no close here lingers."""
        for c in self.clients:
            if last:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            c.close()
        self.clients = []

    def release(self) -> None:
        """Close the peers: a passed socket's lingering close then ends at once (RST)."""
        self.drop_clients(last=True)   # (still ours when the sender never started)
        for p in self.peers:
            p.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            p.close()
        self.peers = []
        self.listener.close()


# The sender, run as nobody: a connected datagram socket to the run's notify
# socket (argv[1], connected by root: the path sits in a 0700 dir) and the
# lingering sockets (argv[2]); says it is ready, sends them on a line from
# stdin; exits without closing (an exiting process's close never lingers).
FLOOD_SENDER = """import array, json, os, socket, sys
out = socket.socket(fileno=int(sys.argv[1]))
fds = [int(x) for x in sys.argv[2].split(",")]
per = int(sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()
got = {"sent": 0, "fds": 0, "errors": []}
for i in range(0, len(fds), per):
    chunk = array.array("i", fds[i:i + per])
    try:
        out.sendmsg([b"WATCHDOG=1\\nSTATUS=a stranger"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, chunk)])
        got["sent"] += 1
        got["fds"] += len(chunk)
    except OSError as e:
        got["errors"].append(repr(e))
print(json.dumps(got), flush=True)
os._exit(0)
"""


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Soak:
    def __init__(self, seconds: float, workdir: Path, seed: int, log: Callable[[str], None] = print,
                 pg: Optional[PgRing] = None):
        self.seconds = seconds
        self.work = workdir
        self.rnd = random.Random(seed)
        self.say = log
        self.pg = pg
        self.only: Set[str] = set()            # only these kinds (--only), else all
        self.tmpfs = Tmpfs(workdir / "fs")     # the state dir's file system (mounted by setup)
        self.state = self.tmpfs.at / "state"
        self.skipped: Dict[str, str] = {}
        self.wal_lost: Dict[str, int] = {}     # run id -> the WAL removal (its number) it was lost with
        self.wal_faults = 0
        self.pauses: List[Tuple[float, float]] = []    # the WAL faults' operator pauses (answered, lifted)
        self.outages: List[Tuple[int, int]] = []       # inodes filled, drivers started meanwhile
        self.loads: List[float] = []                   # 1-min load average, every ~5 s
        self.flood_stats: List[Tuple[int, int]] = []   # (fds passed, the driver's peak above its level)
        self.agents_dir = workdir / "agents"
        self.config = workdir / "ring.yaml"
        self.marks = workdir / "marks"
        self.env = dict(os.environ)
        for k in list(self.env):
            if k == "NOTIFY_SOCKET" or k.startswith("WATCHDOG_") or k.startswith("RING_"):
                self.env.pop(k)
        self.env["PYTHONPATH"] = str(REPO) + os.pathsep + self.env.get("PYTHONPATH", "")
        self.watchers: List[subprocess.Popen] = []
        self.watcher: Optional[subprocess.Popen] = None
        self.faults: Dict[str, List[int]] = {k: [0, 0] for k in KINDS}
        self.faults[READERS] = [0, 0]
        self.recovery: Dict[str, List[float]] = {k: [] for k in KINDS}   # s until recovered
        self.skips_used_by_ending_run = 0
        self.notes: List[str] = []
        self.reader_problems: List[str] = []
        self.roster_names: List[str] = list(BASE)
        self.roster_edits: List[float] = []          # times the roster file changed
        self.names_by_edit: Dict[float, List[str]] = {}  # ... and the membership from then on
        self.quick_variant = 0
        self.stopping = threading.Event()
        self.threads: List[threading.Thread] = []   # the soak's own: sampler and readers
        self.lock = threading.Lock()
        # samplers
        self.overlaps: List[str] = []
        self.samples = 0
        self.fd_samples: Dict[Tuple[int, float], List[Tuple[int, int]]] = {}
        self.drivers_seen: Set[Tuple[int, float]] = set()
        self.all_pids: Set[Tuple[int, Optional[int]]] = set()
        self.escapees_max = 0                        # escaped grandchildren alive at once
        self.escapees_seen: Set[Tuple[int, Optional[int]]] = set()

    # --- set-up ----------------------------------------------------------------------
    def setup(self) -> None:
        why = self.tmpfs.mount()
        if why:
            self.skipped["inodes exhausted"] = why
        if self.pg is None:
            self.skipped["PG connection dropped"] = "SQLite journal (--pg for a PostgreSQL ring)"
        else:
            self.skipped["WAL removed"] = "PostgreSQL journal: no WAL file in the state dir"
        if os.geteuid() != 0:
            self.skipped["fds passed by nobody"] = "not root: cannot send as another user"
        self.state.mkdir(mode=0o700, parents=True)
        self.agents_dir.mkdir()
        pg = PG_RING.format(dsn=self.pg.dsn) if self.pg else ""
        self.config.write_text(CONFIG.replace("ring:\n", "ring:\n" + pg, 1))
        os.chmod(self.config, 0o600)
        for name, (body, _) in AGENTS.items():
            p = self.agents_dir / f"{name}.sh"
            body = body.replace("{python}", sys.executable).replace("{escapee}", str(self.work / "escapee"))
            p.write_text(f"#!/bin/sh\necho $RING_RUN_ID >> {self.marks}\n{body}\n")
            p.chmod(0o755)
        self.write_roster(self.roster_names)

    def line(self, name: str) -> str:
        extra = f" --variant {self.quick_variant}" if name == "quick" and self.quick_variant else ""
        return f"{name} {self.agents_dir}/{name}.sh{extra}"

    def write_roster(self, names: List[str], broken: bool = False) -> None:
        lines = ["# soak roster"] + [self.line(n) for n in names]
        if broken:
            lines.append("broken 'unbalanced quote")
        tmp = self.state / ".ring.txt.soak"
        tmp.write_text("\n".join(lines) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.state / "ring.txt")
        if not broken:
            self.roster_names = list(names)
        t = time.time()
        self.roster_edits.append(t)
        self.names_by_edit[t] = list(self.roster_names)

    def common(self) -> List[str]:
        return ["--state", str(self.state), "--config", str(self.config)]

    def start_watcher(self) -> subprocess.Popen:
        n = len(self.watchers)
        err = open(self.work / f"ringwatch-{n}.err", "wb")
        p = subprocess.Popen([sys.executable, "-m", "ringwatch", *self.common()], env=self.env, cwd=REPO,
                             stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True)
        err.close()
        self.watchers.append(p)
        self.watcher = p
        return p

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        # (cwd: `python -m` looks there first, so a soak run from another checkout still tests this one)
        return subprocess.run([sys.executable, "-m", "ringd", args[0], *self.common(), *args[1:]],
                              env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout)

    # --- looking at the ring ---------------------------------------------------------
    def heartbeat(self) -> Optional[dict]:
        try:
            return json.loads((self.state / "ringd.heartbeat").read_text())
        except (OSError, ValueError):
            return None

    def driver(self) -> Optional[Tuple[int, float]]:
        """(pid, start) of the live driver named by the heartbeat, checked by pid,
        start time and command line - never a recycled pid."""
        hb = self.heartbeat()
        if not hb or hb.get("stopped"):
            return None
        pid, start = hb.get("pid"), hb.get("pid_start")
        try:
            p = psutil.Process(pid)
            if not same_process(pid, start):
                return None
            if str(self.state) not in " ".join(p.cmdline()):
                return None
        except (psutil.Error, TypeError, ValueError):
            return None
        return pid, float(start)

    def rows(self, sql: str = "SELECT * FROM runs ORDER BY id", *params) -> List[sqlite3.Row]:
        if self.pg is not None:
            return self.pg.rows(sql, *params)
        path = self.state / "journal.db"
        if not path.exists():
            return []
        for attempt in range(50):
            try:
                con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
                con.row_factory = sqlite3.Row
                try:
                    return con.execute(sql, params).fetchall()
                finally:
                    con.close()
            except sqlite3.OperationalError as e:
                if "no such table" in str(e):
                    return []
                time.sleep(0.05)
        raise RuntimeError("journal unreadable for 2.5 s")

    def last_id(self) -> int:
        r = self.rows("SELECT max(id) AS m FROM runs")
        return (r[0]["m"] or 0) if r else 0

    def wait(self, pred: Callable[[], object], timeout: float = RECOVER) -> object:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            v = pred()
            if v:
                return v
            time.sleep(0.05)
        return None

    def new_runs(self, after: int, n: int = 1, timeout: float = RECOVER) -> bool:
        return bool(self.wait(lambda: len(self.rows("SELECT id FROM runs WHERE id > ?", after)) >= n, timeout))

    def ring_processes(self) -> List[psutil.Process]:
        """Every live process of this soak: environment names our state dir, or the
        command line names our work dir (watchers, drivers, CLI readers, agents)."""
        key, work = str(self.state), str(self.work)
        found = []
        mine = {os.getpid()} | {a.pid for a in psutil.Process().parents()}   # e.g. `timeout ... soak.py`
        for p in psutil.process_iter(["pid", "cmdline"]):
            if p.pid in mine:
                continue
            try:
                if not _alive(p):
                    continue
                if any(work in part for part in (p.info["cmdline"] or [])):
                    found.append(p)
                elif p.environ().get("RING_STATE") == key:
                    found.append(p)
            except (psutil.Error, OSError):
                continue
        return found

    # --- samplers --------------------------------------------------------------------
    def sampler(self) -> None:
        key = str(self.state)
        while not self.stopping.is_set():
            runs: Dict[str, List[int]] = {}
            for p in psutil.process_iter(["pid"]):
                try:
                    env = p.environ()
                    if env.get("RING_STATE") != key or "RING_RUN_ID" not in env or not _alive(p):
                        continue
                    runs.setdefault(env["RING_RUN_ID"], []).append(p.pid)
                    self.all_pids.add((p.pid, start_ticks(p.pid)))
                except (psutil.Error, OSError):
                    continue
            escapees = [p for p in psutil.process_iter(["pid", "cmdline"])
                        if str(self.work / "escapee") in (p.info["cmdline"] or []) and _alive(p)]
            with self.lock:
                self.samples += 1
                self.escapees_max = max(self.escapees_max, len(escapees))
                self.escapees_seen.update((e.pid, start_ticks(e.pid)) for e in escapees)
                if len(runs) > 1:
                    self.overlaps.append(f"{time.strftime('%H:%M:%S')} runs alive at once: {runs}")
            drv = self.driver()
            if drv:
                self.drivers_seen.add(drv)
                try:
                    nfds = psutil.Process(drv[0]).num_fds()
                    hb = self.heartbeat() or {}
                    if hb.get("role") != "standby":   # (a standby holds no run's descriptors: not comparable)
                        self.fd_samples.setdefault(drv, []).append((int(hb.get("run_id") or 0), nfds))
                except (psutil.Error, OSError):
                    pass
            if self.samples % 33 == 1:
                self.loads.append(os.getloadavg()[0])
            self.stopping.wait(0.15)

    def reader(self, which: str) -> None:
        args = ("status", "--json") if which == "status" else ("history", "--json", "--limit", "50")
        ok_codes = {0, 1, 3} if which == "status" else {0}
        while not self.stopping.is_set():
            try:
                r = self.cli(*args, timeout=60)
                problem = None
                text = r.stdout + r.stderr
                if "database is locked" in text:
                    problem = "database is locked"
                elif "Traceback" in text:
                    problem = "traceback"
                elif r.returncode not in ok_codes:
                    problem = f"exit {r.returncode}"
                else:
                    try:
                        doc = json.loads(r.stdout)
                        if which == "status" and not isinstance(doc, dict):
                            problem = "status JSON is not an object"
                        if which == "history" and not isinstance(doc, list):
                            problem = "history JSON is not a list"
                    except ValueError:
                        problem = "unparsable JSON"
            except subprocess.TimeoutExpired:
                problem = "reader hung for 60 s"
                r = None
            with self.lock:
                self.faults[READERS][0] += 1
                if problem is None:
                    self.faults[READERS][1] += 1
                else:
                    detail = (r.stderr.strip().splitlines() or [""])[-1][:200] if r else ""
                    self.reader_problems.append(f"{which}: {problem}: {detail}")
            self.stopping.wait(0.25)

    # --- faults ------------------------------------------------------------------------
    def fault(self, kind: str) -> Optional[bool]:
        """Inject one fault and wait for the recovery. None: could not be injected now."""
        return {
            "driver SIGKILL": self.f_driver_sigkill,
            "driver SIGSTOP": self.f_driver_sigstop,
            "agent SIGKILL": self.f_agent_sigkill,
            "skip current": self.f_skip_current,
            "skip named": self.f_skip_named,
            "roster valid edit": self.f_roster_valid_edit,
            "roster broken+fixed": self.f_roster_broken_fixed,
            "roster remove+re-add": self.f_roster_remove_re_add,
            "roster add+remove": self.f_roster_add_remove,
            "ringwatch SIGKILL+fresh": self.f_ringwatch_sigkill_fresh,
            "lock file deleted": self.f_lock_deleted,
            "SIGHUP storm": self.f_sighup_storm,
            "unstartable roster": self.f_unstartable_roster,
            "WAL removed": self.f_wal_removed,
            "inodes exhausted": self.f_inodes_exhausted,
            "PG connection dropped": self.f_pg_connection_dropped,
            "fds passed by nobody": self.f_fds_passed_by_nobody,
        }[kind]()

    def _replaced(self, old: Tuple[int, float]) -> bool:
        def new_driver():
            d = self.driver()
            hb = self.heartbeat() or {}
            return d and d != old and hb.get("seq", 0) >= 2
        return bool(self.wait(new_driver))

    def f_driver_sigkill(self) -> Optional[bool]:
        drv = self.driver()
        if not drv:
            return None
        before = self.last_id()
        os.kill(drv[0], signal.SIGKILL)
        return self._replaced(drv) and self.new_runs(before)

    def f_driver_sigstop(self) -> Optional[bool]:
        drv = self.driver()
        if not drv:
            return None
        before = self.last_id()
        os.kill(drv[0], signal.SIGSTOP)
        try:
            ok = self._replaced(drv)
        finally:
            try:
                p = psutil.Process(drv[0])
                if same_process(drv[0], drv[1]) and p.status() == psutil.STATUS_STOPPED:
                    self.notes.append(f"SIGSTOPped driver {drv[0]} not stopped by the watcher; SIGCONT")
                    p.send_signal(signal.SIGCONT)
                    ok = False
            except psutil.Error:
                pass
        return ok and self.new_runs(before)

    def f_agent_sigkill(self) -> Optional[bool]:
        hb = self.heartbeat() or {}
        pid, run_id = hb.get("run_pid"), hb.get("run_id")
        if not pid or not run_id:
            return None
        try:
            p = psutil.Process(pid)
            env = p.environ()
            if env.get("RING_STATE") != str(self.state) or env.get("RING_RUN_ID") != str(run_id) or not _alive(p):
                return None
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            return None

        def closed():
            r = self.rows("SELECT status FROM runs WHERE id = ?", run_id)
            return r and r[0]["status"] != "running"
        return bool(self.wait(closed)) and self.new_runs(run_id)

    def f_skip_current(self) -> Optional[bool]:
        hb = self.heartbeat() or {}
        run_id = hb.get("run_id")
        if not run_id:
            return None
        r = self.cli("skip")
        if r.returncode == 1 and ("nothing is running" in r.stderr or "had already ended" in r.stderr):
            return None   # nothing to skip by the time it landed: SPEC, skip by run id
        if r.returncode != 0 or "Traceback" in r.stderr:
            self.notes.append(f"skip: exit {r.returncode}: {r.stderr.strip()[:200]}")
            return False
        ended = self.wait(lambda: (self.rows("SELECT status FROM runs WHERE id = ?", run_id) or [{"status": "x"}])[0]
                          ["status"] != "running")
        return bool(ended) and self.new_runs(self.last_id())

    def f_skip_named(self) -> Optional[bool]:
        name = self.rnd.choice([n for n in self.roster_names if AGENTS[n][1]])
        t_req = time.time()
        r = self.cli("skip", name, "--no-wait")
        if r.returncode != 0 or "Traceback" in r.stderr:
            self.notes.append(f"skip {name}: exit {r.returncode}: {r.stderr.strip()[:200]}")
            return False
        skipped = self.wait(lambda: self.rows(
            "SELECT id FROM runs WHERE agent = ? AND status = 'skipped' AND ended_at >= ?", name, t_req), 10)
        if skipped:
            return True
        # The request reached NAME while it was running (it started before the
        # request) and that run ended on its own first: the request is used up
        # by the run it targeted (no skipped row; its next turn runs). Survived
        # if it did not linger. A run that *started* after the request must have
        # been skipped instead - that case fails here.
        # The request names the run it targeted (the event's run_id): the run
        # running when the request was written, whenever the CLI read its clock.
        ev = self.rows("SELECT run_id FROM events WHERE kind = 'skip-requested' AND detail = ? "
                       "ORDER BY id DESC LIMIT 1", f"agent={name}")
        state = self.rows("SELECT skip_requested FROM agents WHERE name = ?", name)
        if ev and ev[0]["run_id"] is not None and state and not state[0]["skip_requested"]:
            hit = self.rows("SELECT id, status FROM runs WHERE id = ? AND status != 'running'", ev[0]["run_id"])
            if hit:
                self.skips_used_by_ending_run += 1
                self.notes.append(f"skip {name}: landed on run {hit[0]['id']}, which ended by itself "
                                  f"({hit[0]['status']}); request used up, next turn ran")
                return True
        return False

    def _roster_error(self) -> Optional[str]:
        return (self.heartbeat() or {}).get("roster_error")

    def f_roster_valid_edit(self) -> Optional[bool]:
        self.quick_variant += 1
        before = self.last_id()
        self.write_roster(self.roster_names)
        return self.new_runs(before, 3) and not self._roster_error()

    def f_roster_broken_fixed(self) -> Optional[bool]:
        self.write_roster(self.roster_names, broken=True)
        if not self.wait(self._roster_error):
            self.notes.append("broken roster: no roster error recorded")
            return False
        before = self.last_id()
        turning = self.new_runs(before, 2)
        self.write_roster(self.roster_names)
        cleared = self.wait(lambda: not self._roster_error())
        return bool(turning and cleared)

    def f_roster_remove_re_add(self) -> Optional[bool]:
        candidates = [n for n in ("quick", "forker", "chatty") if n in self.roster_names]
        if not candidates:
            return None
        name = self.rnd.choice(candidates)
        names = list(self.roster_names)
        pos = names.index(name)
        self.write_roster([n for n in names if n != name])
        t = time.time()
        before = self.last_id()
        turned = self.new_runs(before, len(names) + 1)
        ran_after = self.rows("SELECT id FROM runs WHERE agent = ? AND started_at > ? + 0.05", name, t)
        if ran_after:
            self.notes.append(f"removed agent {name} still ran: {[r['id'] for r in ran_after]}")
        names_back = [n for n in self.roster_names]
        names_back.insert(min(pos, len(names_back)), name)
        t = time.time()
        self.write_roster(names_back)
        back = self.wait(lambda: self.rows("SELECT id FROM runs WHERE agent = ? AND started_at > ?", name, t))
        return bool(turned and not ran_after and back)

    def f_roster_add_remove(self) -> Optional[bool]:
        if "extra" in self.roster_names:
            return None
        t = time.time()
        self.write_roster(self.roster_names + ["extra"])
        ran = self.wait(lambda: self.rows("SELECT id FROM runs WHERE agent = 'extra' AND started_at > ?", t))
        self.write_roster([n for n in self.roster_names if n != "extra"])
        t = time.time()
        before = self.last_id()
        turned = self.new_runs(before, 3)
        late = self.rows("SELECT id FROM runs WHERE agent = 'extra' AND started_at > ? + 0.05", t)
        return bool(ran and turned and not late)

    def f_ringwatch_sigkill_fresh(self) -> Optional[bool]:
        old = self.watcher
        if old is None or old.poll() is not None:
            return None
        old.send_signal(signal.SIGKILL)
        old.wait(timeout=30)
        before = self.last_id()
        new = self.start_watcher()

        def adopted():
            try:
                data = json.loads((self.state / "ringwatch.json").read_text())
            except (OSError, ValueError):
                return False
            return data.get("pid") == new.pid and new.poll() is None
        return bool(self.wait(adopted)) and self.new_runs(before) and new.poll() is None

    def f_lock_deleted(self) -> Optional[bool]:
        """rm ringd.lock (tmpfiles cleaners, git clean -X do): the driver takes it
        again within a heartbeat; a second driver started then refuses (exit 75)
        and touches nothing."""
        drv = self.driver()
        lock = self.state / "ringd.lock"
        try:
            ino = os.stat(lock).st_ino
        except OSError:
            return None
        if not drv:
            return None
        os.unlink(lock)
        before = self.last_id()

        def retaken():
            try:
                return os.stat(lock).st_ino != ino and self.driver() == drv
            except OSError:
                return False
        if not self.wait(retaken, 10):
            self.notes.append("lock file deleted: the driver did not take it again")
            return False
        second = subprocess.run([sys.executable, "-m", "ringd", "run", *self.common()], env=self.env, cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        if second.returncode != 75:
            self.notes.append(f"lock file deleted: a second driver exited {second.returncode}: "
                              f"{second.stderr.strip()[-200:]}")
            return False
        reaped = self.rows("SELECT run_id FROM events WHERE source = 'reaper' AND run_id > ?", before - 1)
        if reaped:
            self.notes.append(f"lock file deleted: runs of the live driver reaped: {reaped}")
            return False
        return self.driver() == drv and self.new_runs(before)

    def f_sighup_storm(self) -> Optional[bool]:
        """50 SIGHUPs in ~0.2 s at the driver and at the watcher: both reload and
        live on; nothing is restarted."""
        drv = self.driver()
        w = self.watcher
        if not drv or w is None or w.poll() is not None:
            return None
        before = self.last_id()
        for _ in range(50):
            for pid in (drv[0], w.pid):
                try:
                    os.kill(pid, signal.SIGHUP)
                except OSError:
                    pass
            time.sleep(0.004)
        ok = self.new_runs(before, 2)
        if self.driver() != drv or w.poll() is not None:
            self.notes.append(f"SIGHUP storm: driver {drv[0]} -> {self.driver()}, watcher exit {w.poll()}")
            return False
        return ok

    def f_unstartable_roster(self) -> Optional[bool]:
        """Every agent unstartable for UNSTARTABLE_FOR s: the driver keeps beating
        (the watcher leaves it alone), backs off instead of spinning, then runs the
        fixed roster."""
        drv = self.driver()
        if not drv:
            return None
        names = list(self.roster_names)
        lines = ["# soak roster: nothing here can start"] + [f"{n} {self.work}/no-such-program-{n}" for n in names]
        tmp = self.state / ".ring.txt.soak"
        tmp.write_text("\n".join(lines) + "\n")
        os.chmod(tmp, 0o600)
        before, seq0 = self.last_id(), (self.heartbeat() or {}).get("seq", 0)
        t0 = time.time()
        os.replace(tmp, self.state / "ring.txt")
        self.roster_edits.append(t0)
        self.names_by_edit[t0] = []   # no healthy agent to expect meanwhile
        self.stopping.wait(UNSTARTABLE_FOR)
        rows = len(self.rows("SELECT id FROM runs WHERE id > ?", before))
        seq1 = (self.heartbeat() or {}).get("seq", 0)
        self.write_roster(names)
        ok = True
        if rows > self.error_row_bound(len(names), UNSTARTABLE_FOR):
            self.notes.append(f"unstartable roster: {rows} rows in {UNSTARTABLE_FOR:g}s (spinning; at most "
                              f"{self.error_row_bound(len(names), UNSTARTABLE_FOR)} with back-off)")
            ok = False
        if self.driver() != drv or seq1 <= seq0:
            self.notes.append(f"unstartable roster: driver {drv[0]} -> {self.driver()}, beats {seq0} -> {seq1}")
            ok = False
        after = self.last_id()
        back = self.wait(lambda: self.rows("SELECT id FROM runs WHERE id > ? AND status <> 'error'", after))
        return ok and bool(back)

    # --- this round's faults: the journal's WAL, inodes, PostgreSQL, notify fds -----------
    def marks_size(self) -> int:
        try:
            return self.marks.stat().st_size
        except OSError:
            return 0

    def marks_since(self, offset: int) -> List[str]:
        try:
            with open(self.marks, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace").split()
        except OSError:
            return []

    def missing(self) -> Set[str]:
        """Run ids an agent wrote to its marks file that have no row."""
        return set(self.marks_since(0)) - {str(r["id"]) for r in self.rows("SELECT id FROM runs")}

    def log_mark(self) -> Tuple[int, int]:
        try:
            st = os.stat(self.state / "logs" / "ringd.log")
            return st.st_ino, st.st_size
        except OSError:
            return 0, 0

    def log_since(self, mark: Tuple[int, int]) -> str:
        """What the driver wrote to logs/ringd.log since ``mark`` (across one rotation)."""
        logs = self.state / "logs"
        text = ""
        for name in ("ringd.log.1", "ringd.log"):
            try:
                with open(logs / name, "rb") as f:
                    st = os.fstat(f.fileno())
                    if st.st_ino == mark[0]:
                        f.seek(mark[1])
                    elif name == "ringd.log.1":
                        continue
                    text += f.read().decode(errors="replace")
            except OSError:
                continue
        return text

    def cli_retrying(self, *args: str) -> Optional[subprocess.CompletedProcess]:
        """A control command, tried again while it says "try again" (bounded); None if it never went through."""
        end = time.monotonic() + RECOVER
        while True:
            r = self.cli(*args)
            if r.returncode == 0:
                return r
            if "try again" not in r.stderr or time.monotonic() >= end:
                self.notes.append(f"{' '.join(args)}: exit {r.returncode}: {r.stderr.strip()[-200:]}")
                return None
            time.sleep(0.1)

    def quiet(self, hold: float = 1.2) -> bool:
        """No run in flight and no agent started for ``hold`` s, within RECOVER."""
        end = time.monotonic() + RECOVER
        size, calm = self.marks_size(), time.monotonic()
        while time.monotonic() < end:
            now = self.marks_size()
            if now != size or self.rows("SELECT id FROM runs WHERE status = 'running'"):
                size, calm = now, time.monotonic()
            elif time.monotonic() - calm >= hold:
                return True
            time.sleep(0.05)
        return False

    def f_wal_removed(self) -> Optional[bool]:
        """rm journal.db-wal journal.db-shm under the running driver, then (at once,
        or up to 1 s later) an operator's pause: the driver takes the journal up
        again and the pause holds - nothing starts after it but a start racing it
        - and a resume lifts it. Rows it cost are counted for "nothing lost"."""
        drv = self.driver()
        names = [self.state / "journal.db-wal", self.state / "journal.db-shm"]
        if not drv or not all(n.exists() for n in names):
            return None
        self.wal_faults += 1
        missing0, log0 = self.missing(), self.log_mark()
        for n in names:
            with suppress(FileNotFoundError):
                os.unlink(n)
        self.stopping.wait(self.rnd.choice([0.0, 0.0, self.rnd.uniform(0, 1.0)]))
        ok, paused = False, False
        try:
            if self.cli_retrying("pause") is None:
                return False
            paused, at, t_p = True, self.marks_size(), time.time()
            held = self.quiet()
            after = self.marks_since(at)
            doc = self.status_json() or {}
            ok = held and len(after) <= 1 and (doc.get("driver") or {}).get("paused") is True
            if not ok:
                self.notes.append(f"WAL removed: pause {'held' if held else 'did not hold'}; {len(after)} agents "
                                  f"started after it answered ({after[:10]}); status paused: "
                                  f"{(doc.get('driver') or {}).get('paused')}")
            if self.cli_retrying("resume") is None:
                return False
            paused, t_r = False, time.time()
            self.pauses.append((t_p, t_r))
            resumed = self.wait(lambda: self.rows("SELECT id FROM runs WHERE started_at > ?", t_r))
            if not resumed:
                self.notes.append(f"WAL removed: nothing ran within {RECOVER:g}s of the resume")
            ok = ok and bool(resumed)
        finally:
            if paused:
                self.cli("resume")
            lost = self.missing() - missing0
            said = self.log_since(log0)
            if lost:
                self.wal_lost.update({i: self.wal_faults for i in lost})
                told = ("the driver said its writes were lost" if "are lost" in said else
                        "the driver said NOTHING LOST" if "nothing lost" in said else "the driver said nothing of it")
                self.notes.append(f"WAL removed #{self.wal_faults}: {len(lost)} runs lost "
                                  f"({sorted(lost, key=int)[:5]}...; {told})")
            if "removed or replaced under the driver" not in said:
                self.notes.append(f"WAL removed #{self.wal_faults}: the driver did not say it noticed")
            sound = self.quick_check()
            if sound != "ok":
                self.notes.append(f"WAL removed #{self.wal_faults}: journal after it: {sound}; the driver said: "
                                  + " | ".join(line[21:][:160] for line in said.splitlines()
                                               if "journal" in line or "paused" in line)[:600])
                ok = False
        return ok

    def quick_check(self) -> str:
        """``PRAGMA quick_check`` of the journal, read-only: "ok", or what is wrong."""
        try:
            con = sqlite3.connect(f"file:{self.state / 'journal.db'}?mode=ro", uri=True, timeout=10)
            try:
                return str(con.execute("PRAGMA quick_check").fetchone()[0])
            finally:
                con.close()
        except sqlite3.Error as e:
            return f"{type(e).__name__}: {e}"

    def status_json(self) -> Optional[dict]:
        r = self.cli("status", "--json")
        try:
            return json.loads(r.stdout)
        except ValueError:
            return None

    def f_inodes_exhausted(self) -> Optional[bool]:
        """The state dir's file system out of inodes for FILL_FOR s (no new run log,
        socket, heartbeat or lock file can be made), then freed: the ring turns
        again, and no run was recorded `error` (an outage is never an agent's
        fault)."""
        drv = self.driver()
        if not drv or os.statvfs(self.tmpfs.at).f_ffree < 16:
            return None
        fill = self.tmpfs.at / "fill"
        before, drivers0 = self.last_id(), len(self.drivers_seen)
        fill.mkdir()
        made = 0
        try:
            while True:
                try:
                    os.close(os.open(fill / str(made), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
                made += 1
            self.stopping.wait(FILL_FOR)
        finally:
            for i in range(made):
                os.unlink(fill / str(i))
            fill.rmdir()
        t_freed = time.time()
        back = self.wait(lambda: len(self.rows("SELECT id FROM runs WHERE started_at > ? AND status NOT IN "
                                               "('running', 'error')", t_freed)) >= 2)
        errors = self.rows("SELECT id, agent, reason FROM runs WHERE id > ? AND status = 'error'", before)
        self.outages.append((made, int(self.driver() != drv or len(self.drivers_seen) > drivers0)))
        ok = bool(back) and not errors
        if errors:
            self.notes.append(f"inodes exhausted: {len(errors)} runs `error`: " + "; ".join(
                f"{r['id']} {r['agent']}: {(r['reason'] or '')[:80]}" for r in errors[:3]))
        if not back:
            self.notes.append(f"inodes exhausted: the ring did not turn within {RECOVER:g}s of the freeing")
        if self.watcher is None or self.watcher.poll() is not None:
            self.notes.append(f"inodes exhausted: ringwatch exited {self.watcher.poll() if self.watcher else None}"
                              f"; a fresh one started")
            self.start_watcher()
            ok = False
        return ok

    def in_flight(self) -> Optional[int]:
        """The run id of the heartbeat's current run while its row is `running`."""
        run_id = (self.heartbeat() or {}).get("run_id")
        if run_id and self.rows("SELECT id FROM runs WHERE id = ? AND status = 'running'", run_id):
            return int(run_id)
        return None

    def f_pg_connection_dropped(self) -> Optional[bool]:
        """pg_terminate_backend of every server process of the driver while a run is
        in flight: that run ends with its own status (never `interrupted`), and the
        ring turns on."""
        drv = self.driver()
        run_id = self.wait(self.in_flight, 5) if drv else None
        if not drv or not run_id:
            return None
        backends = self.rows("SELECT pid FROM pg_stat_activity WHERE application_name = ?", f"ringd pid={drv[0]}")
        dropped = [b["pid"] for b in backends
                   if self.rows("SELECT pg_terminate_backend(?::int) AS t", b["pid"])[0]["t"]]
        if not dropped:
            return None

        def ended():
            r = self.rows("SELECT status, reason FROM runs WHERE id = ? AND status <> 'running'", run_id)
            return r[0] if r else None
        row = self.wait(ended)
        if not row or row["status"] == "interrupted":
            self.notes.append(f"PG connection dropped ({len(dropped)} backends of driver {drv[0]}): run {run_id} "
                              + (f"interrupted: {row['reason']}" if row else f"not ended within {RECOVER:g}s"))
            return False
        return self.new_runs(run_id, 2)

    def pinger_socket(self) -> Optional[Tuple[int, str]]:
        """(run id, NOTIFY_SOCKET) of the pinger's run when it is the current one."""
        hb = self.heartbeat() or {}
        if hb.get("agent") != "pinger" or not hb.get("run_pid"):
            return None
        try:
            env = psutil.Process(hb["run_pid"]).environ()
        except psutil.Error:
            return None
        if env.get("RING_RUN_ID") != str(hb.get("run_id")) or not env.get("NOTIFY_SOCKET"):
            return None
        return int(hb["run_id"]), env["NOTIFY_SOCKET"]

    def nfds(self, pid: int) -> Optional[int]:
        try:
            return psutil.Process(pid).num_fds()
        except psutil.Error:
            return None

    def f_fds_passed_by_nobody(self) -> Optional[bool]:
        """nobody passes FLOOD_SOCKETS lingering TCP sockets (their last close
        blocks LINGER s) to the pinger's notify socket while it runs: its pings
        are still heard (neither that run nor its next is `stalled`), and the
        driver's open descriptors are back at their level within RECOVER, while
        the sockets' peers still hold them open."""
        drv = self.driver()
        target = self.wait(self.pinger_socket, 15) if drv else None
        if not drv or not target:
            return None
        run_id, path = target
        with self.lock:
            recent = [n for _, n in self.fd_samples.get(drv, [])[-20:]]
        baseline = max(recent + [self.nfds(drv[0]) or 0])
        flood = FdFlood()
        try:
            got = self._send_flood(flood, path)
            if not got:
                return None
            peak = [0]

            def back():
                n = self.nfds(drv[0])
                peak[0] = max(peak[0], n or 0)
                return self.driver() == drv and n is not None and n <= baseline + FD_SLACK
            fds_back = self.wait(back)
            self.flood_stats.append((got["fds"], peak[0] - baseline))
            if not fds_back:
                self.notes.append(f"fds passed by nobody: driver {drv[0]} holds {self.nfds(drv[0])} fds "
                                  f"{RECOVER:g}s on (level {baseline}, peak {peak[0]})")
        finally:
            flood.release()
        runs = self.wait(lambda: (lambda r: r if len(r) >= 2 else None)(self.rows(
            "SELECT id, status, reason FROM runs WHERE agent = 'pinger' AND id >= ? AND status <> 'running' "
            "ORDER BY id LIMIT 2", run_id)), RECOVER + 10) or []
        stalled = [f"{r['id']} {r['status']}: {(r['reason'] or '')[:60]}" for r in runs if r["status"] == "stalled"]
        if stalled or len(runs) < 2:
            self.notes.append(f"fds passed by nobody: pinger runs after {run_id}: "
                              f"{stalled or [(r['id'], r['status']) for r in runs]}")
        return bool(fds_back) and len(runs) == 2 and not stalled

    def _send_flood(self, flood: FdFlood, path: str) -> Optional[dict]:
        """Connect to ``path`` as root (it sits in a 0700 dir), hand the socket and
        the flood to a sender running as nobody, drop our copies, let it send.
        What it sent, or None when nothing got through (the run had ended)."""
        out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            out.connect("\0" + path[1:] if path.startswith("@") else path)
        except OSError:
            out.close()
            return None
        fds = [c.fileno() for c in flood.clients]
        child = subprocess.Popen(["/usr/bin/python3", "-I", "-c", FLOOD_SENDER, str(out.fileno()),
                                  ",".join(map(str, fds)), str(FLOOD_PER_DATAGRAM)],
                                 pass_fds=[out.fileno(), *fds], user="nobody", group="nogroup", extra_groups=[],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env={"PATH": "/usr/bin:/bin"}, cwd="/", start_new_session=True)
        out.close()
        ready = child.stdout.readline() == b"ready\n"
        flood.drop_clients(last=not ready)   # the sender's copies, and then the driver's, are the last
        try:
            stdout, stderr = child.communicate(b"go\n", timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            self.notes.append("fds passed by nobody: the sender hung for 60 s")
            return None
        try:
            got = json.loads(stdout)
        except ValueError:
            self.notes.append(f"fds passed by nobody: sender exit {child.returncode}: {stderr.decode()[-200:]}")
            return None
        return got if got["fds"] else None

    @staticmethod
    def error_row_bound(agents: int, window: float, initial: float = 0.5, most: float = 1.5) -> int:
        """Most `error` rows ``agents`` unstartable agents may write in ``window``
        s when each backs off (CONFIG: backoff_initial 0.5, backoff_max 1.5), plus
        one lap of slack for timing: a spinning ring writes hundreds."""
        per_agent, t, b = 1, 0.0, initial
        while t + b <= window:
            t, per_agent, b = t + b, per_agent + 1, min(2 * b, most)
        return agents * (per_agent + 1)

    # --- the run -------------------------------------------------------------------------
    def run(self) -> SoakResult:
        self.setup()
        t_start = time.time()
        self.start_watcher()
        self.threads = [threading.Thread(target=self.sampler, daemon=True)]
        self.threads += [threading.Thread(target=self.reader, args=(w,), daemon=True) for w in ("status", "history")]
        try:
            if not self.wait(lambda: self.driver() and len(self.rows()) >= 3, 60):
                raise RuntimeError("the ring never started turning")
            for t in self.threads:
                t.start()
            end = time.monotonic() + self.seconds
            rounds = 0
            while time.monotonic() < end:
                kinds = [k for k in KINDS if not self.only or k in self.only]
                self.rnd.shuffle(kinds)
                rounds += 1
                for kind in kinds:
                    if time.monotonic() >= end:
                        break
                    if kind in self.skipped:
                        continue
                    self.stopping.wait(self.rnd.uniform(0.2, 1.0))
                    t0 = time.monotonic()
                    try:
                        survived = self.fault(kind)
                    except Exception as e:  # noqa: BLE001 - a harness error is a failed fault, reported
                        survived = False
                        self.notes.append(f"{kind}: harness error {type(e).__name__}: {e}")
                    if survived is None:
                        continue
                    self.faults[kind][0] += 1
                    self.faults[kind][1] += int(bool(survived))
                    if survived:
                        self.recovery[kind].append(time.monotonic() - t0)
                    if not survived:
                        self.notes.append(f"{kind} at +{time.time() - t_start:.1f}s not survived")
                    self.say(f"  +{time.time() - t_start:6.1f}s {kind}: {'survived' if survived else 'NOT SURVIVED'}"
                             f" ({time.monotonic() - t0:.1f}s)")
        finally:
            stopped_cleanly = self.stop_all()
        return self.evaluate(t_start, stopped_cleanly)

    def stop_all(self) -> bool:
        """Stop the readers, then SIGTERM the watcher (it stops the driver). Whatever
        is still alive after that is killed by pid - and reported."""
        self.stopping.set()
        # its own threads only: in a test process another test's thread (a
        # driver's lease watchdog, which lives as long as its process) never
        # ends, and waiting for it cost a 20-second soak test 70 s
        for t in self.threads:
            if t.is_alive():
                t.join(timeout=70)
        clean = True
        w = self.watcher
        if w is not None and w.poll() is None:
            w.send_signal(signal.SIGTERM)
            try:
                rc = w.wait(timeout=40)
                if rc != 0:
                    clean = False
                    self.notes.append(f"final ringwatch exited {rc}")
            except subprocess.TimeoutExpired:
                clean = False
                self.notes.append("final ringwatch did not stop within 40 s")
        else:
            clean = False
            self.notes.append("no live watcher at the end")
        for p in self.watchers:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        return clean

    def kill_leftovers(self) -> List[str]:
        left = []
        for p in self.ring_processes():
            try:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
                p.send_signal(signal.SIGCONT)
                p.kill()
            except psutil.Error:
                pass
        return left

    # --- the verdict ------------------------------------------------------------------------
    def evaluate(self, t_start: float, stopped_cleanly: bool) -> SoakResult:
        checks: List[Check] = []
        leftovers = self.wait(lambda: not self.ring_processes(), 10)
        left = [] if leftovers else self.kill_leftovers()
        checks.append(Check("stopped cleanly", stopped_cleanly, "SIGTERM to ringwatch stopped it and its driver"
                            if stopped_cleanly else "; ".join(self.notes[-3:])))
        try:
            rows, broken = self.rows(), None
        except sqlite3.DatabaseError as e:   # (a malformed journal: reported, never a traceback)
            rows, broken = [], f"journal unreadable at the end: {e}"
            checks.append(Check("journal readable", False, broken))
        ids = {str(r["id"]) for r in rows}
        try:
            marks = self.marks.read_text().split()
        except OSError:
            marks = []
        lost = sorted(set(marks) - ids, key=int)
        with_wal = [i for i in lost if i in self.wal_lost]
        other = [i for i in lost if i not in self.wal_lost]
        checks.append(Check("nothing lost", not lost,
                            f"{len(set(marks))} agent starts, every one with its row" if not lost
                            else f"{len(lost)} of {len(set(marks))} agent starts without a row: {len(with_wal)} lost "
                                 f"with a removed WAL (in {len(set(self.wal_lost[i] for i in with_wal))} of "
                                 f"{self.wal_faults} removals), {len(other)} otherwise {other[:20]}"))
        running = [r["id"] for r in rows if r["status"] == "running"]
        checks.append(Check("no row left running", not running, f"{len(rows)} rows" if not running
                            else f"running: {running}"))
        bad = [broken] if broken else self.incoherent(rows)
        checks.append(Check("every terminal row coherent", not bad, "times, exit code/signal, one closing "
                            "event each, counters = rows" if not bad else "; ".join(bad[:8])))
        checks.append(self.integrity())
        checks.append(Check("one agent at a time", not self.overlaps,
                            f"{self.samples} samples, never two runs alive" if not self.overlaps
                            else "; ".join(self.overlaps[:5])))
        checks.append(Check("nothing leaked: processes", not left,
                            "no process of the soak alive after the stop" if not left else f"left: {left[:10]}"))
        fd_ok, fd_detail = self.fd_verdict()
        checks.append(Check("nothing leaked: driver fds", fd_ok, fd_detail))
        checks.append(Check("escaped grandchildren die with their run", self.escapees_max <= 1,
                            f"{len(self.escapees_seen)} `setsid env -i` grandchildren, at most "
                            f"{self.escapees_max} alive at once (its own run's)"))
        turn_ok, turn_detail, laps = (False, broken, 0) if broken else self.turning(rows)
        checks.append(Check("the ring kept turning", turn_ok, turn_detail))
        checks.append(Check("readers never saw a lock or a traceback", not self.reader_problems,
                            f"{self.faults[READERS][0]} reader calls, all clean" if not self.reader_problems
                            else "; ".join(self.reader_problems[:5])))
        by_status: Dict[str, int] = {}
        for r in rows:
            by_status[r["status"]] = by_status.get(r["status"], 0) + 1
        starts = sorted(r["started_at"] for r in rows if r["started_at"] >= t_start)
        gaps = [b - a for a, b in zip(starts, starts[1:])
                if not any(a < t1 and b > t0 for t0, t1 in self.pauses)]   # (an operator's pause is no gap)
        figures = {
            "duration": f"{time.time() - t_start:.0f} s",
            "runs": f"{len(rows)} ({', '.join(f'{k} {v}' for k, v in sorted(by_status.items()))})",
            "laps checked": laps,
            "drivers": len(self.drivers_seen),
            "watchers": len(self.watchers),
            "longest gap between two run starts": (f"{max(gaps):.1f} s" if gaps else "n/a")
                                                   + (" (outside the operator's pauses)" if self.pauses else ""),
            "agent processes seen": len(self.all_pids),
            "named skips used up by the run they landed on": self.skips_used_by_ending_run,
            "journal": "PostgreSQL (throwaway cluster)" if self.pg else "SQLite",
            "load average (1 min): at the start, highest, at the end": (
                f"{self.loads[0]:.2f}, {max(self.loads):.2f}, {os.getloadavg()[0]:.2f} (2 cores)"
                if self.loads else "n/a"),
        }
        if self.flood_stats:
            figures["fds passed by nobody"] = (f"{sum(n for n, _ in self.flood_stats)} in {len(self.flood_stats)} "
                                               f"floods; the driver's peak above its level "
                                               f"{max(d for _, d in self.flood_stats)}")
        if self.outages:
            figures["inode outages"] = (f"{len(self.outages)}, {min(n for n, _ in self.outages)}-"
                                        f"{max(n for n, _ in self.outages)} inodes filled each; a new driver "
                                        f"started during {sum(1 for _, d in self.outages if d)}")
        if self.wal_faults:
            figures["runs lost with a removed WAL"] = (f"{len(self.wal_lost)} in "
                                                       f"{len(set(self.wal_lost.values()))} of {self.wal_faults}")
        return SoakResult(seconds=self.seconds, faults=self.faults, checks=checks, figures=figures,
                          notes=self.notes, recovery=self.recovery, skipped=self.skipped)

    def integrity(self) -> Check:
        """SQLite: PRAGMA integrity_check. PostgreSQL: amcheck's bt_index_check of
        the journal's indexes, when the server has the extension."""
        if self.pg is None:
            con = sqlite3.connect(f"file:{self.state / 'journal.db'}?mode=ro", uri=True)
            try:
                integrity = con.execute("PRAGMA integrity_check").fetchone()[0]
            except sqlite3.DatabaseError as e:
                integrity = str(e)
            finally:
                con.close()
            return Check("integrity_check", integrity == "ok", integrity)
        try:
            self.pg.execute("CREATE EXTENSION IF NOT EXISTS amcheck")
            idx = self.rows("SELECT c.relname, bt_index_check(c.oid) FROM pg_index i JOIN pg_class c ON c.oid = "
                            "i.indexrelid JOIN pg_am a ON a.oid = c.relam WHERE a.amname = 'btree' AND i.indrelid "
                            "IN ('runs'::regclass, 'events'::regclass, 'agents'::regclass, 'run_counts'::regclass)")
        except Exception as e:  # noqa: BLE001 - reported as the check's detail
            return Check("amcheck (PostgreSQL)", False, f"{type(e).__name__}: {str(e)[:160]}")
        return Check("amcheck (PostgreSQL)", True, f"bt_index_check of {len(idx)} journal indexes: ok "
                     f"(PRAGMA integrity_check is SQLite's)")

    def incoherent(self, rows) -> List[str]:
        bad = []
        closing = {}
        for e in self.rows("SELECT run_id, kind FROM events WHERE run_id IS NOT NULL"):
            closing.setdefault(e["run_id"], []).append(e["kind"])
        prev_start = None
        for r in rows:
            rid, st = r["id"], r["status"]
            if st == "running":
                continue
            if r["ended_at"] is None or r["duration"] is None or r["ended_at"] < r["started_at"] \
                    or r["duration"] < 0 or abs(r["duration"] - (r["ended_at"] - r["started_at"])) > 0.01:
                bad.append(f"run {rid}: times")
            code, sig = r["exit_code"], r["signal"]
            if st == "ok" and code != 0:
                bad.append(f"run {rid}: ok with exit {code}")
            if st == "deferred" and code != 75:
                bad.append(f"run {rid}: deferred with exit {code}")
            if st == "failed" and code in (0, 75) and sig is None:
                bad.append(f"run {rid}: failed with exit {code}")
            # a watchdog's stall starts with SIGTERM to the group: an agent may die of it
            watchdog = st == "stalled" and (r["reason"] or "").startswith("watchdog:")
            if st == "stalled" and sig != signal.SIGKILL and not (watchdog and sig == signal.SIGTERM):
                bad.append(f"run {rid}: stalled without SIGKILL")
            if st == "error" and not r["reason"]:
                bad.append(f"run {rid}: error without a reason")
            kinds = closing.get(rid, [])
            # a quarantine entry is a skipped row whose closing event says why
            n_close = kinds.count(st) + (kinds.count("quarantined") if st == "skipped" else 0)
            if n_close != 1:
                bad.append(f"run {rid}: {n_close} closing events for '{st}' ({kinds})")
            if prev_start is not None and r["started_at"] + 1e-6 < prev_start:
                bad.append(f"run {rid}: started before the run before it")
            prev_start = r["started_at"]
        counted: Dict[str, int] = {}
        for r in rows:
            if r["status"] != "running":
                counted[r["agent"]] = counted.get(r["agent"], 0) + 1
        for a in self.rows("SELECT name, runs FROM agents"):
            if a["runs"] != counted.get(a["name"], 0):
                bad.append(f"agent {a['name']}: runs {a['runs']} != {counted.get(a['name'], 0)} rows")
        for a in self.rows("SELECT agent, sum(n) AS n FROM run_counts GROUP BY agent"):
            if a["n"] != counted.get(a["agent"], 0):
                bad.append(f"agent {a['agent']}: run_counts {a['n']} != rows")
        return bad

    def fd_verdict(self) -> Tuple[bool, str]:
        grew = []
        checked = 0
        lo, hi = None, None
        for drv, samples in self.fd_samples.items():
            hops = len({run for run, _ in samples})
            fds = [n for _, n in samples]
            lo = min(fds + ([lo] if lo is not None else []))
            hi = max(fds + ([hi] if hi is not None else []))
            if hops < 8 or len(samples) < 12:
                continue
            checked += 1
            q = max(3, len(samples) // 4)
            first, last = max(fds[:q]), max(fds[-q:])
            if last > first + FD_SLACK:
                grew.append(f"driver {drv[0]}: {first} -> {last} fds over {hops} hops")
        if grew:
            return False, "; ".join(grew)
        return True, (f"{checked} long-lived driver(s) checked; open fds stayed within {lo}..{hi}"
                      if checked else f"no driver lived 8+ hops (fds seen {lo}..{hi})")

    def turning(self, rows) -> Tuple[bool, str, int]:
        """Between roster edits, split the rows into laps (position wraps: the
        healthy agent at position 0 runs every lap) and check every healthy agent
        in the roster ran (any row counts as its turn) in every two consecutive
        complete laps."""
        edges = sorted(self.roster_edits)
        problems, laps_checked = [], 0
        windows = []
        for i, t in enumerate(edges):
            t_end = edges[i + 1] if i + 1 < len(edges) else float("inf")
            windows.append((t, t_end))
        for t0, t1 in windows:
            names = self.names_at(t0)
            healthy = {n for n in names if AGENTS[n][1]}
            win = [r for r in rows if t0 < r["started_at"] < t1 and r["agent"] in names]
            laps: List[List[sqlite3.Row]] = []
            cur: List[sqlite3.Row] = []
            prev = None
            for r in win:
                if prev is not None and r["position"] is not None and r["position"] < prev:
                    laps.append(cur)
                    cur = []
                cur.append(r)
                prev = r["position"]
            laps.append(cur)
            complete = laps[1:-1]   # the first and last may be partial
            for a, b in zip(complete, complete[1:]):
                laps_checked += 1
                seen = {r["agent"] for r in a + b}
                missing = healthy - seen
                if missing:
                    problems.append(f"runs {a[0]['id']}..{b[-1]['id']}: {sorted(missing)} missing")
        if problems:
            return False, "; ".join(problems[:5]), laps_checked
        return True, f"{laps_checked} two-lap stretches, every healthy agent in each", laps_checked

    def names_at(self, t: float) -> List[str]:
        return self.names_by_edit.get(t, BASE)


def run_soak(seconds: float = 120, workdir: Optional[Path] = None, seed: Optional[int] = None,
             log: Callable[[str], None] = print, pg: bool = False, keep: bool = False,
             only: Optional[List[str]] = None) -> SoakResult:
    """Run the soak for ``seconds`` in ``workdir`` (a fresh temp dir by default) and
    return the verdict; ``pg``: the ring's journal on a throwaway PostgreSQL
    cluster. Never leaves a process, a mount or a cluster behind; the state
    dir is copied out of its tmpfs first when the soak failed or ``keep``."""
    seed = seed if seed is not None else random.randrange(1 << 30)
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ring-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    cluster = PgRing() if pg else None
    soak = Soak(seconds, work, seed, log, pg=cluster)
    soak.only = set(only or ())
    log(f"soak: {seconds:g}s, seed {seed}, work dir {work}, journal {'PostgreSQL' if pg else 'SQLite'}, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    result = None
    try:
        result = soak.run()
    finally:
        soak.stopping.set()
        soak.kill_leftovers()
        try:
            if soak.tmpfs.mounted and (keep or result is None or not result.ok):
                shutil.copytree(soak.state, work / "state.kept", symlinks=True,
                                ignore=lambda d, names: [n for n in names if n.endswith(".sock")])
        finally:
            note = soak.tmpfs.unmount()
            if cluster is not None:
                cluster.destroy()
    if note:
        result.notes.append(note)
    result.figures["seed"] = seed
    result.figures["work dir"] = str(work)
    return result


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120, help="how long to inject faults (default 120)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (printed; replays the fault order)")
    ap.add_argument("--workdir", default=None, help="work dir (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (always kept on failure)")
    ap.add_argument("--pg", action="store_true", help="the ring's journal on a throwaway PostgreSQL cluster")
    ap.add_argument("--only", default="", help="comma-separated fault kinds to inject (default: every kind)")
    args = ap.parse_args(argv)
    # a SIGTERM (timeout(1), a CI's stop) unwinds like an error: the finally blocks stop the ring,
    # unmount the tmpfs and remove the cluster
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    only = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in only if k not in KINDS]
    if unknown:
        ap.error(f"unknown fault kind(s): {', '.join(unknown)} (kinds: {', '.join(KINDS)})")
    result = run_soak(args.seconds, Path(args.workdir) if args.workdir else None, args.seed, pg=args.pg,
                      keep=args.keep, only=only)
    print()
    print(result.table())
    print()
    print("SOAK PASSED" if result.ok else "SOAK FAILED")
    if result.ok and not args.keep and not args.workdir:
        shutil.rmtree(result.figures["work dir"], ignore_errors=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
