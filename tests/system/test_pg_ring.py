"""Two hosts, one ring: two state dirs sharing one PostgreSQL database, each with
its own driver (real processes, real signals, a real server).

Throughout every test a sampler reads /proc every few milliseconds and fails
the test if two agents of the ring were ever alive at once while both drivers
were alive and not frozen (SIGSTOPped)."""
import json
import os
import shutil
import signal
import subprocess
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import Ring, wait_until

TTL = 3.0


def pg_rows(dsn, sql, *params):
    import psycopg
    from psycopg.rows import dict_row
    with psycopg.connect(dsn, row_factory=dict_row) as con:
        return con.execute(sql, params).fetchall()


def proc_state(pid):
    """The process's state letter, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 2:].split()[0].decode()
    except (OSError, ValueError, IndexError):
        return None


OVERLAP_GRACE = 0.2   # s


class Sampler(threading.Thread):
    """Agents of the ring are the shells running its agent scripts (their
    command line names the shared agents dir); each one's parent is its driver."""

    def __init__(self, agents_dir: Path):
        super().__init__(daemon=True)
        self.key = str(agents_dir).encode()
        self.stop_flag = threading.Event()
        self.samples = 0
        self.violations = []

    def agents(self):
        found = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if self.key not in f.read():
                        continue
                with open(f"/proc/{d}/stat", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            fields = data[data.rindex(b")") + 2:].split()
            if fields[0] not in (b"Z", b"X"):
                found.append((int(d), int(fields[1])))
        pids = {pid for pid, _ in found}
        return [(pid, ppid) for pid, ppid in found if ppid not in pids]  # a shell's own fork is not an agent

    def run(self):
        # An overlap counts once it outlasts OVERLAP_GRACE: a driver resumed from
        # SIGSTOP is "live" to /proc before the scheduler has run it even once to
        # kill its agent (the test bounds that reaction at 1 s separately).
        seen = {}
        while not self.stop_flag.is_set():
            alive = self.agents()
            drivers = {ppid for _, ppid in alive}
            if len(alive) > 1 and len(drivers) > 1 and all(proc_state(p) not in (None, "T", "t", "Z")
                                                            for p in drivers):
                key = frozenset(alive)
                first = seen.setdefault(key, time.monotonic())
                if time.monotonic() - first >= OVERLAP_GRACE:
                    self.violations.append(alive)
            self.samples += 1
            time.sleep(0.005)

    def finish(self):
        self.stop_flag.set()
        self.join(5)
        assert self.samples > 50, "the sampler hardly ran"
        assert not self.violations, f"two agents alive at once under two live drivers: {self.violations[:3]}"


@pytest.fixture
def hosts(tmp_path, pg_dsn):
    """Hosts A and B: one roster and agents dir (A's), one database."""
    made = []

    def make(name):
        base = tmp_path / name
        base.mkdir()
        r = Ring(base)
        r.write_config(ring={"journal": pg_dsn, "lease_ttl": TTL, "run_budget": 60,
                             "stall_threshold": 90, "heartbeat_interval": 0.2})
        made.append(r)
        return r
    a, b = make("a"), make("b")
    b.agents_dir = a.agents_dir
    sampler = Sampler(a.agents_dir)
    sampler.start()
    yield a, b, pg_dsn, sampler
    sampler.stop_flag.set()
    for r in made:
        for p in r.procs:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        r.cleanup()


def _read(path):
    try:
        return path.read_text()
    except OSError:
        return ""


def roster_both(a, b, *lines):
    a.roster(*lines)
    b.roster(*lines)


def role(r):
    hb = r.heartbeat() or {}
    return hb.get("role")


def running_row(dsn):
    rows = pg_rows(dsn, "SELECT * FROM runs WHERE status = 'running'")
    assert len(rows) <= 1
    return rows[0] if rows else None


def agent_pid(dsn):
    row = running_row(dsn)
    return row["pid"] if row and row["pid"] else None


def test_failover_after_the_leader_box_dies(hosts):
    a, b, dsn, sampler = hosts
    for n in ("one", "two", "three"):
        # long enough that the run read below is still in flight when the "box dies",
        # however loaded the box (1.2 s was not, beside two busy loops)
        a.agent(n, "sleep 3\n")
    roster_both(a, b, *(f"{n} {a.agents_dir}/{n}.sh" for n in ("one", "two", "three")))
    da = a.start_driver()
    wait_until(lambda: role(a) == "leader" and agent_pid(dsn), timeout=15, message="A leads and runs")
    db = b.start_driver()
    wait_until(lambda: role(b) == "standby", timeout=15, message="B stands by")
    # B, a healthy standby, is a healthy driver for status (exit 0)
    st = b.cli("status", "--json")
    assert st.returncode == 0, st.stdout + st.stderr
    doc = json.loads(st.stdout)
    assert doc["driver"]["role"] == "standby" and doc["driver"]["host"] == socket.gethostname()
    assert f"pid={da.pid} " in doc["lease"]["holder"] and doc["lease"]["expires_at"]
    assert json.loads(a.cli("status", "--json").stdout)["driver"]["role"] == "leader"
    text = b.cli("status").stdout
    assert "standby on" in text and f"pid={da.pid}" in text
    wait_until(lambda: 'ring_driver_role{role="standby"} 1' in _read(b.state / "metrics.prom"),
               timeout=5, message="B's metrics say standby")
    # a run that has just started, its pid recorded (0.1 s after its start): it is
    # still in flight when its box dies below, however loaded this box is
    seen = wait_until(lambda: agent_pid(dsn) and running_row(dsn), timeout=10, message="a run in flight")
    row = wait_until(lambda: (r := running_row(dsn)) and r["pid"] and r["id"] > seen["id"] and r,
                     timeout=10, message="the next run in flight")
    # The box of A dies: its driver and its agent at once.
    os.kill(da.pid, signal.SIGKILL)
    os.killpg(row["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: role(b) == "leader", timeout=TTL + 3, message="B leads")
    took = time.monotonic() - killed_at
    assert took <= TTL + 1.0, f"standby took {took:.2f}s to lead"
    reaped = wait_until(lambda: pg_rows(dsn, "SELECT * FROM runs WHERE id = %s AND status <> 'running'",
                                        row["id"]), timeout=5, message="the lapsed run reaped")[0]
    assert reaped["status"] == "interrupted"
    assert "lost its lease" in reaped["reason"] and "host" in reaped["reason"]
    ev = pg_rows(dsn, "SELECT source FROM events WHERE run_id = %s AND kind = 'interrupted'", row["id"])
    assert [e["source"] for e in ev] == ["reaper"]
    order = ["one", "two", "three"]
    nxt = wait_until(lambda: pg_rows(dsn, "SELECT * FROM runs WHERE id > %s ORDER BY id LIMIT 1", row["id"]),
                     timeout=5, message="B runs the next agent")[0]
    assert nxt["agent"] == order[(order.index(row["agent"]) + 1) % 3]
    assert nxt["driver_pid"] == db.pid
    doc = json.loads(b.cli("status", "--json").stdout)
    assert doc["driver"]["role"] == "leader" and f"pid={db.pid} " in doc["lease"]["holder"]
    assert doc["agents"][order.index(row["agent"])]["last_status"] in ("interrupted", "running")
    sampler.finish()


def test_a_frozen_leader_kills_its_agent_at_once_and_records_nothing(hosts):
    a, b, dsn, sampler = hosts
    a.agent("long", "sleep 60\n")
    a.agent("next", "sleep 60\n")
    roster_both(a, b, f"long {a.agents_dir}/long.sh", f"next {a.agents_dir}/next.sh")
    da = a.start_driver()
    wait_until(lambda: role(a) == "leader" and agent_pid(dsn), timeout=15, message="A leads and runs")
    first = running_row(dsn)
    b.start_driver()
    wait_until(lambda: role(b) == "standby", timeout=15, message="B stands by")
    os.kill(da.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: role(b) == "leader", timeout=TTL + 5, message="B leads while A is frozen")
        wait_until(lambda: (running_row(dsn) or {}).get("agent") == "next" and agent_pid(dsn),
                   timeout=5, message="B runs the next agent")
        time.sleep(0.3)  # A stays frozen a little past the hand-over
        a_rows = pg_rows(dsn, "SELECT count(*) AS n FROM runs WHERE driver_pid = %s", da.pid)[0]["n"]
        events_before = pg_rows(dsn, "SELECT max(id) AS m FROM events")[0]["m"]
    finally:
        os.kill(da.pid, signal.SIGCONT)
    resumed = time.monotonic()
    wait_until(lambda: proc_state(first["pid"]) in (None, "Z"), timeout=3, message="A's agent dead")
    assert time.monotonic() - resumed < 1.0, "A's agent outlived its driver's resumption by 1 s"
    wait_until(lambda: role(a) == "standby", timeout=5, message="A stands by")
    time.sleep(0.5)
    # A recorded nothing after its epoch moved: no run, no event of its own since.
    assert pg_rows(dsn, "SELECT count(*) AS n FROM runs WHERE driver_pid = %s", da.pid)[0]["n"] == a_rows
    later = pg_rows(dsn, "SELECT e.*, r.driver_pid FROM events e LEFT JOIN runs r ON r.id = e.run_id "
                         "WHERE e.id > %s", events_before)
    assert all(e["driver_pid"] != da.pid for e in later), later
    assert pg_rows(dsn, "SELECT status FROM runs WHERE id = %s", first["id"])[0]["status"] == "interrupted"
    sampler.finish()


def test_a_partition_stops_the_agent_before_the_ttl_and_the_ring_resumes(hosts, pg_cluster):
    a, b, dsn, sampler = hosts
    a.agent("x", "sleep 60\n")
    a.agent("y", "sleep 0.3\n")
    a.roster(f"x {a.agents_dir}/x.sh", f"y {a.agents_dir}/y.sh")
    a.start_driver()
    wait_until(lambda: role(a) == "leader" and agent_pid(dsn), timeout=15, message="A leads and runs")
    row = running_row(dsn)
    before = pg_rows(dsn, "SELECT agent, status, count(*) AS n FROM runs GROUP BY agent, status")
    pg_cluster.stop("immediate")
    cut = time.monotonic()
    try:
        wait_until(lambda: proc_state(row["pid"]) in (None, "Z"), timeout=TTL + 2,
                   message="the agent stopped while the database is away")
        stopped_after = time.monotonic() - cut
        assert stopped_after < TTL, f"agent stopped {stopped_after:.2f}s after the partition"
        time.sleep(0.5)
    finally:
        pg_cluster.start()
    wait_until(lambda: pg_rows(dsn, "SELECT 1 FROM runs WHERE id = %s AND status = 'interrupted'", row["id"]),
               timeout=TTL + 10, message="the cut run closed once the database is back")
    wait_until(lambda: pg_rows(dsn, "SELECT 1 FROM runs WHERE agent = 'y' AND status = 'ok' AND id > %s",
                               row["id"]), timeout=10, message="the ring resumes after x")
    # Nothing twice, nothing lost: every run once, the counters agree with the rows.
    rows = pg_rows(dsn, "SELECT * FROM runs ORDER BY id")
    assert len({r["id"] for r in rows}) == len(rows)
    assert [r for r in rows if r["id"] == row["id"]][0]["status"] == "interrupted"
    counts = {(c["agent"], c["status"]): c["n"] for c in pg_rows(dsn, "SELECT * FROM run_counts")}
    terminal = {}
    for r in rows:
        if r["status"] != "running":
            terminal[(r["agent"], r["status"])] = terminal.get((r["agent"], r["status"]), 0) + 1
    assert counts == terminal
    assert before  # the cut run existed before the partition
    sampler.finish()


def test_a_sqlite_ring_has_one_driver_always_leading_and_no_lease(ring):
    ring.agent("a", "sleep 0.2\n")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.start_driver()
    wait_until(lambda: ring.heartbeat(), timeout=10, message="first beat")
    doc = json.loads(ring.cli("status", "--json").stdout)
    assert doc["driver"]["role"] == "leader" and doc["driver"]["host"] == socket.gethostname()
    assert doc["lease"] is None
    wait_until(lambda: 'ring_driver_role{role="leader"} 1' in _read(ring.state / "metrics.prom"),
               timeout=5, message="metrics say leader")


def test_operators_on_the_leader_box_and_a_watched_standby_left_alone(hosts):
    a, b, dsn, sampler = hosts
    a.agent("slow", "sleep 30\n")
    a.agent("quick", "sleep 0.2\n")
    roster_both(a, b, f"slow {a.agents_dir}/slow.sh", f"quick {a.agents_dir}/quick.sh")
    a.start_driver()
    wait_until(lambda: role(a) == "leader" and agent_pid(dsn), timeout=15, message="A leads and runs")
    b.write_config(watch={"stale_after": 3.0})  # a loaded 2-core box: start-up headroom
    b.start_watcher()
    wait_until(lambda: role(b) == "standby", timeout=15, message="B (under ringwatch) stands by")
    standby_pid = b.heartbeat()["pid"]
    row = running_row(dsn)
    assert row["agent"] == "slow"
    r = a.cli("skip")
    assert r.returncode == 0, r.stdout + r.stderr
    wait_until(lambda: pg_rows(dsn, "SELECT 1 FROM runs WHERE id = %s AND status = 'skipped'", row["id"]),
               timeout=5, message="the skipped run closed")
    hist = json.loads(b.cli("history", "--json").stdout)  # any box reads the shared journal
    assert any(h["id"] == row["id"] and h["status"] == "skipped" for h in hist)
    time.sleep(3.5)  # > watch.stale_after: a beating standby is healthy, never restarted
    w = json.loads((b.state / "ringwatch.json").read_text())
    assert w["restarts"] == [] and not w["gave_up"]
    assert b.heartbeat()["pid"] == standby_pid and role(b) == "standby"
    assert b.cli("status").returncode == 0
    # A clean stop of the leader hands the lease over at once, not after the TTL.
    da = a.procs[0]
    da.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    wait_until(lambda: role(b) == "leader", timeout=TTL, message="B leads after A's clean stop")
    assert time.monotonic() - stopped < TTL / 2, "the lease was not released on a clean stop"
    da.wait(10)
    sampler.finish()


def test_a_ring_of_quick_agents_keeps_its_lease(hosts):
    a, b, dsn, sampler = hosts
    a.roster("t1 /bin/true", "t2 /bin/true")
    a.start_driver()
    wait_until(lambda: role(a) == "leader", timeout=15, message="A leads")
    time.sleep(TTL * 1.5)  # runs of a few ms never wait long enough inside a hop to beat there
    epochs = pg_rows(dsn, "SELECT epoch FROM lease")
    assert epochs == [{"epoch": 1}], "the leader lost its lease between quick runs"
    assert role(a) == "leader"
    sampler.finish()


def test_a_leader_stuck_in_a_database_call_still_kills_its_agent_in_time(hosts, pg_cluster):
    """The whole server is stopped (the process serving the leader and the one
    that accepts connections): the leader's call is dropped after its bound
    (pgcall), and its next connection attempt waits for connect_timeout, past
    the half-TTL switch. Its watchdog must still kill the agent before the
    lease can pass."""
    a, b, dsn, sampler = hosts
    escaped = a.base / "escaped.pid"
    a.agent("long", f"setsid sh -c 'echo $$ > {escaped}; exec sleep 60' &\nsleep 60\n")
    a.agent("next", "sleep 60\n")
    roster_both(a, b, f"long {a.agents_dir}/long.sh", f"next {a.agents_dir}/next.sh")
    da = a.start_driver()
    wait_until(lambda: role(a) == "leader" and agent_pid(dsn), timeout=15, message="A leads and runs")
    first = running_row(dsn)
    esc = int(wait_until(lambda: escaped.exists() and escaped.read_text().strip(), timeout=5,
                         message="the agent's setsid child"))
    b.start_driver()
    wait_until(lambda: role(b) == "standby", timeout=15, message="B stands by")
    backend = wait_until(lambda: pg_rows(dsn, "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                                         f"ringd pid={da.pid}"), timeout=5, message="A's server process")[0]["pid"]
    postmaster = int((pg_cluster.data / "postmaster.pid").read_text().split()[0])
    os.kill(postmaster, signal.SIGSTOP)
    os.kill(backend, signal.SIGSTOP)
    stuck = time.monotonic()
    try:
        wait_until(lambda: proc_state(first["pid"]) in (None, "Z"), timeout=TTL + 2,
                   message="A's agent killed while A is stuck")
        wait_until(lambda: proc_state(esc) in (None, "Z"), timeout=TTL, message="its setsid child killed too")
        assert time.monotonic() - stuck < TTL, "the agent outlived the lease"
        assert proc_state(da.pid) not in (None, "T"), "A itself is alive and not frozen"
        # by the watchdog, while the loop waits on its new connection
        wait_until(lambda: "while the driver waits on the journal; killed run" in _read(da.err_path), timeout=5,
                   message="the watchdog's word on the kill")
    finally:
        os.kill(backend, signal.SIGCONT)
        os.kill(postmaster, signal.SIGCONT)
    wait_until(lambda: (running_row(dsn) or {}).get("agent") == "next", timeout=TTL + 10,
               message="the ring goes on")
    # the killed run is not the agent's failure: interrupted, never `failed (signal 9)`
    assert pg_rows(dsn, "SELECT status FROM runs WHERE id = %s", first["id"])[0]["status"] == "interrupted"
    sampler.finish()


class ConnectionCutter:
    """A unix-socket proxy in front of the test's server: it forwards every
    connection both ways, except once, when ``cut(state, data)`` says so of
    what a client sends: "now" drops that connection before the data reaches
    the server; "after-answer" lets it reach the server, waits for the answer
    (the statement is done: a COMMIT has committed) and drops the connection
    instead of passing that answer on (a network lost at the wrong moment).
    ``state`` is a dict per connection the predicate may keep notes in."""

    def __init__(self, server_dir: Path, cut):
        self.server = str(server_dir / ".s.PGSQL.5432")
        self.cut = cut
        self.dir = Path(tempfile.mkdtemp(prefix="ring-proxy-", dir="/tmp"))  # a socket path is short
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.dir / ".s.PGSQL.5432"))
        self.listener.listen(16)
        self.armed = True
        self.dropped = threading.Event()
        self.socks = []
        threading.Thread(target=self._accept, daemon=True).start()

    def dsn(self, dsn: str) -> str:
        return dsn.replace(f"host={os.path.dirname(self.server)}", f"host={self.dir}")

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(self.server)
            self.socks += [client, upstream]
            state = {"drop": False}
            threading.Thread(target=self._up, args=(client, upstream, state), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, state), daemon=True).start()

    def _drop(self, *socks):
        for s in socks:
            s.shutdown(socket.SHUT_RDWR)
        self.dropped.set()

    def _up(self, client, upstream, state):
        try:
            while data := client.recv(65536):
                how = self.cut(state, data) if self.armed else None
                if how == "now":
                    self.armed = False
                    return self._drop(client, upstream)
                if how == "after-answer":
                    self.armed = False
                    state["drop"] = True
                upstream.sendall(data)
        except OSError:
            pass

    def _down(self, upstream, client, state):
        try:
            while data := upstream.recv(65536):
                if state["drop"]:
                    return self._drop(client, upstream)
                client.sendall(data)
        except OSError:
            pass

    def close(self):
        self.listener.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


def _a_start_committed(state, data):
    """The COMMIT of a transaction that wrote a run's start (``INSERT INTO runs ... 'running'``)."""
    if b"INSERT INTO runs" in data and b"'running'" in data:
        state["started"] = True
    elif state.get("started") and b"COMMIT" in data:
        return "after-answer"
    return None


def test_a_run_start_whose_commit_answer_is_lost_does_not_wedge_the_ring(tmp_path, pg_cluster, pg_dsn):
    """The connection drops after the server committed a run's start but before
    the driver heard so: the row is `running` though no agent was started. The
    driver must not leave it running forever (every later start would be refused
    by the one-running index: a ring wedged with a live, leading driver)."""
    proxy = ConnectionCutter(pg_cluster.dir, _a_start_committed)
    (tmp_path / "a").mkdir()
    r = Ring(tmp_path / "a")
    try:
        r.write_config(ring={"journal": proxy.dsn(pg_dsn), "lease_ttl": TTL, "heartbeat_interval": 0.2})
        r.roster("a /bin/true")
        r.start_driver()
        assert proxy.dropped.wait(20), "no run's start went through the proxy"
        lost = wait_until(lambda: pg_rows(pg_dsn, "SELECT * FROM runs ORDER BY id LIMIT 1"),
                          timeout=5, message="the run whose commit answer was lost")[0]
        wait_until(lambda: pg_rows(pg_dsn, "SELECT 1 FROM runs WHERE status = 'ok' AND id > %s", lost["id"]),
                   timeout=15, message="the ring going on after the lost answer")
        row = pg_rows(pg_dsn, "SELECT * FROM runs WHERE id = %s", lost["id"])[0]
        assert row["status"] == "interrupted" and row["pid"] is None, row
        assert "commit" in row["reason"], row["reason"]
        ev = pg_rows(pg_dsn, "SELECT source FROM events WHERE run_id = %s AND kind = 'interrupted'", lost["id"])
        assert [e["source"] for e in ev] == ["driver"]
    finally:
        r.cleanup()
        proxy.close()


def test_a_journal_failure_just_after_taking_the_lease_is_no_configuration_error(tmp_path, pg_cluster, pg_dsn):
    """The connection drops at the new leader's first write of the ring (before
    its first turn). That is an outage, not a configuration error: the driver
    must not exit 78 (ringwatch and systemd's RestartPreventExitStatus= would
    never start it again, and the ring would not survive its box)."""
    proxy = ConnectionCutter(pg_cluster.dir, lambda state, data: "now" if b"roster_error" in data else None)
    (tmp_path / "a").mkdir()
    r = Ring(tmp_path / "a")
    try:
        r.write_config(ring={"journal": proxy.dsn(pg_dsn), "lease_ttl": TTL, "heartbeat_interval": 0.2})
        r.roster("a /bin/true")
        d = r.start_driver()
        assert proxy.dropped.wait(20), "the driver's first write never went through the proxy"
        d.wait(TTL + 10)
        err = d.communicate()[1].decode()
        assert d.returncode == 69, (d.returncode, err)   # EX_UNAVAILABLE: restart me
        assert "Traceback" not in err and "connection" in err
        # started again (as ringwatch would), the driver leads and runs the ring
        r.start_driver()
        wait_until(lambda: pg_rows(pg_dsn, "SELECT 1 FROM runs WHERE status = 'ok'"), timeout=TTL + 15,
                   message="the restarted driver runs the ring")
    finally:
        r.cleanup()
        proxy.close()


def test_a_journal_a_newer_ring_wrote_is_a_configuration_error_never_a_restart_loop(tmp_path, pg_dsn):
    """An outage exits 69 (restart me), but a PostgreSQL journal of a newer
    schema is no outage: restarting cannot help, so the driver exits 78 as it
    does on SQLite (ringwatch and systemd then stop), leaving the journal as it was."""
    r = _one_lap_then(tmp_path, pg_dsn, "UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    try:
        res = r.cli("run", "--once", timeout=60)
        assert res.returncode == 78, (res.returncode, res.stderr)
        assert "newer ring" in res.stderr and "Traceback" not in res.stderr
        assert pg_rows(pg_dsn, "SELECT value FROM meta WHERE key = 'schema_version'") == [{"value": "99"}]
    finally:
        r.cleanup()


def _an_end_committed(state, data):
    """The COMMIT of a transaction that closed a run (``UPDATE runs SET status``)."""
    if b"UPDATE runs SET status" in data:
        state["closed"] = True
    elif state.get("closed") and b"COMMIT" in data:
        return "after-answer"
    return None


def test_an_end_whose_commit_answer_is_lost_is_still_the_drivers_own_and_alerts(tmp_path, pg_cluster, pg_dsn):
    """The connection drops after the server committed a failed run's end but
    before the driver heard so. Retried, the guarded close finds the row closed:
    by this driver's own lost commit, not by an operator or the reaper - its
    failure alert must still be raised, and the log must not blame anyone else."""
    proxy = ConnectionCutter(pg_cluster.dir, _an_end_committed)
    (tmp_path / "a").mkdir()
    r = Ring(tmp_path / "a")
    seen = tmp_path / "alerts.jsonl"
    try:
        alert = r.agent("alert", f"cat >> {seen}; echo >> {seen}")
        r.agent("bad", "exit 1")
        r.write_config(ring={"journal": proxy.dsn(pg_dsn), "lease_ttl": TTL, "heartbeat_interval": 0.2},
                       alerts={"command": [str(alert)], "failures_in_a_row": 1})
        r.roster(f"bad {r.agents_dir}/bad.sh", "ok /bin/true")
        d = r.start_driver()
        assert proxy.dropped.wait(20), "no run's end went through the proxy"
        first = wait_until(lambda: pg_rows(pg_dsn, "SELECT * FROM runs WHERE agent = 'bad' ORDER BY id LIMIT 1"),
                           timeout=5, message="bad's first run")[0]
        assert first["status"] == "failed", first
        wait_until(lambda: pg_rows(pg_dsn, "SELECT 1 FROM runs WHERE status = 'ok'"), timeout=TTL + 15,
                   message="the ring going on after the lost answer")

        def alerts():
            return [json.loads(line) for line in seen.read_text().splitlines() if line.strip()] if seen.exists() else []
        wait_until(lambda: any(e.get("run_id") == first["id"] for e in alerts()), timeout=10,
                   message=f"the failure alert of run {first['id']}, whose end's commit answer was lost")
        assert [e["event"] for e in alerts() if e.get("run_id") == first["id"]] == ["failures"]
        d.send_signal(signal.SIGTERM)
        err = d.communicate(timeout=30)[1].decode()
        assert "already closed" not in err, err
    finally:
        r.cleanup()
        proxy.close()


# --- a database call that never answers (the server process serving the driver stopped) ---

def _backend_of(dsn, driver_pid):
    """The pid of the server process serving ``driver_pid``'s connection (each
    driver names itself in application_name); waits until there is exactly one."""
    rows = wait_until(lambda: (lambda r: r if len(r) == 1 else None)(
        pg_rows(dsn, "SELECT pid FROM pg_stat_activity WHERE application_name = %s", f"ringd pid={driver_pid}")),
        timeout=10, message=f"the one server process of driver {driver_pid}")
    return rows[0]["pid"]


def _beat_age(r):
    try:
        return time.time() - os.stat(r.state / "ringd.heartbeat").st_mtime
    except OSError:
        return 0.0


def _continue(pid):
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _one_pg_ring(tmp_path, dsn, ttl):
    (tmp_path / "a").mkdir()
    r = Ring(tmp_path / "a")
    r.write_config(ring={"journal": dsn, "lease_ttl": ttl, "heartbeat_interval": 0.2,
                         "run_budget": 120, "stall_threshold": 150})
    r.roster("long /bin/sleep 100")
    return r


def test_a_stop_while_a_database_call_hangs_ends_the_call_and_the_driver(tmp_path, pg_dsn):
    """SPEC: the driver acts on SIGTERM within 1 s. Its server process is stopped:
    the lease renewal in flight never answers. A SIGTERM must end that call at
    once (not when its bound, a fifth of the long TTL here, runs out) and the
    driver stops as usual."""
    ttl = 50.0   # the bound on a call (ttl/5 = 10 s) is far beyond what the test allows
    r = _one_pg_ring(tmp_path, pg_dsn, ttl)
    backend = None
    try:
        d = r.start_driver()
        wait_until(lambda: role(r) == "leader" and agent_pid(pg_dsn), timeout=20, message="the driver leads and runs")
        backend = _backend_of(pg_dsn, d.pid)
        os.kill(backend, signal.SIGSTOP)
        # beats are 0.2 s apart: a heartbeat this old means the driver is inside the hung call
        wait_until(lambda: _beat_age(r) > 1.0, timeout=10, message="the driver stuck in a database call")
        err = _clean_stop_on_sigterm(d, "the driver's exit on SIGTERM during a hung database call")
        assert "driver stopped" in err, err
    finally:
        if backend is not None:
            _continue(backend)
        r.cleanup()
    # the run was closed (interrupted by the driver) on a fresh connection
    rows = pg_rows(pg_dsn, "SELECT status FROM runs ORDER BY id")
    assert [x["status"] for x in rows] == ["interrupted"], rows


def test_a_stop_while_the_whole_server_hangs_waits_no_call_out_to_its_bound(tmp_path, pg_cluster, pg_dsn):
    """The whole server stopped (the process serving the driver and the one that
    accepts connections): a SIGTERM ends the call in flight at once, but the
    stop's own calls - the run's end, the lease's release, the last metrics,
    each on a new connection that is never answered - waited out the full
    bound each (a fifth of the TTL: 10 s here, 6 s at the default TTL),
    30 s in all, past the watcher's 10 s before SIGKILL and systemd's
    TimeoutStopSec. A stopping driver gives each call the stop's grace only."""
    ttl = 50.0   # the bound on a call (ttl/5 = 10 s) is far beyond what the test allows
    r = _one_pg_ring(tmp_path, pg_dsn, ttl)
    backend = postmaster = None
    try:
        d = r.start_driver()
        wait_until(lambda: role(r) == "leader" and agent_pid(pg_dsn), timeout=20, message="the driver leads and runs")
        backend = _backend_of(pg_dsn, d.pid)
        postmaster = int((pg_cluster.data / "postmaster.pid").read_text().split()[0])
        os.kill(postmaster, signal.SIGSTOP)
        os.kill(backend, signal.SIGSTOP)
        # beats are 0.2 s apart: a heartbeat this old means the driver is inside the hung call
        wait_until(lambda: _beat_age(r) > 1.0, timeout=10, message="the driver stuck in a database call")
        sent = time.monotonic()
        d.send_signal(signal.SIGTERM)
        wait_until(lambda: d.poll() is not None, timeout=60, interval=0.01, message="the driver's exit")
        took = time.monotonic() - sent
        err = d.communicate()[1].decode()
        assert d.returncode == 0 and "Traceback" not in err, (d.returncode, err)
        # its agent's SIGTERM (a sleep: it dies at once), a few calls' grace, and headroom
        assert took < 4.0, f"the stop took {took:.1f}s: {err[-2000:]}"
    finally:
        for pid in (backend, postmaster):
            if pid is not None:
                _continue(pid)
        r.cleanup()


def test_a_database_call_that_never_answers_fails_within_its_bound_and_the_driver_beats_on(tmp_path, pg_dsn):
    """The server process serving the driver is stopped: without a client-side
    bound the driver hung in the call (no heartbeat, no lease renewal). The
    call must fail after a fifth of the TTL; the driver drops that connection,
    keeps beating and renews (or stands by) on a new one."""
    r = _one_pg_ring(tmp_path, pg_dsn, TTL)
    backend = None
    try:
        d = r.start_driver()
        wait_until(lambda: role(r) == "leader" and agent_pid(pg_dsn), timeout=20, message="the driver leads and runs")
        backend = _backend_of(pg_dsn, d.pid)
        os.kill(backend, signal.SIGSTOP)
        stopped = time.time()
        # a heartbeat written well after the hung call began (and more than its bound), and then fresh ones
        wait_until(lambda: _beat_age(r) < 0.5 and time.time() - stopped > 2 * TTL, timeout=4 * TTL + 10,
                   interval=0.05, message="the driver beating again after the hung call")
        hb = r.heartbeat()
        assert hb["role"] in ("leader", "standby") and hb["pid"] == d.pid, hb
        assert d.poll() is None
        # served by a new server process; the stopped one is no longer the driver's
        new = pg_rows(pg_dsn, "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND pid <> %s",
                      f"ringd pid={d.pid}", backend)
        assert len(new) == 1, new
        err = _read(d.err_path)
        assert "no answer" in err, err
    finally:
        if backend is not None:
            _continue(backend)
        r.cleanup()


def test_a_stop_while_the_first_connection_hangs_is_a_clean_stop(tmp_path):
    """SPEC: a signal that arrives while the driver is still starting up is
    honoured once it is ready. A driver whose first connection hangs (a server
    that takes the connection and never speaks) is stopped by SIGTERM: the
    connect is ended at once, and that is a stop (exit 0, what a service manager
    expects of a stop), not "journal unreachable" (69, a failed unit)."""
    pytest.importorskip("psycopg")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    silent.settimeout(20)
    (tmp_path / "a").mkdir()
    r = Ring(tmp_path / "a")
    try:
        r.write_config(ring={"journal": f"postgresql://ring@127.0.0.1:{silent.getsockname()[1]}/ring",
                             "lease_ttl": 50.0})   # a call's bound, ttl/5 = 10 s: far past what the test allows
        r.roster("a /bin/true")
        d = r.start_driver()
        conn, _ = silent.accept()   # the driver is inside its first connect
        try:
            err = _clean_stop_on_sigterm(d, "the driver's exit on SIGTERM during its first connect")
            assert "stopped while starting" in err, err
        finally:
            conn.close()
    finally:
        silent.close()
        r.cleanup()


def test_a_reload_while_a_start_up_call_waits_is_honoured_once_ready(tmp_path, pg_dsn):
    """SPEC: a signal that arrives while the driver is still starting up is
    honoured once it is ready. A SIGHUP that came while the driver's first
    migration waited for another ring's migration lock ended that call, and the
    driver exited 69 ("journal unreachable"). Now only a stop ends a start-up
    call; the reload waits for the loop and is done there."""
    import psycopg
    from ringd.journal.schema_pg import MIGRATION_LOCK
    holder = psycopg.connect(pg_dsn, autocommit=True)
    watcher = psycopg.connect(pg_dsn, autocommit=True)
    holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
    (tmp_path / "a").mkdir()
    r = Ring(tmp_path / "a")
    try:
        r.write_config(ring={"journal": pg_dsn, "lease_ttl": 50.0})   # a call's bound: 10 s
        r.roster("a /bin/true")
        d = r.start_driver()

        def waiting_for_the_lock():
            return watcher.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                                   " AND NOT granted").fetchone()[0]
        wait_until(waiting_for_the_lock, 20, message="the driver waiting for the migration lock")
        d.send_signal(signal.SIGHUP)
        until = time.monotonic() + 1.0   # five times the grace after which a stop ends the call
        while time.monotonic() < until:
            assert d.poll() is None, (d.returncode, _read(d.err_path))
            assert waiting_for_the_lock(), "the call waiting for the lock was ended"
            time.sleep(0.05)
        holder.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))
        wait_until(lambda: "config reloaded" in _read(d.err_path), 20, message="the reload done once ready")
        assert d.poll() is None, _read(d.err_path)
        d.send_signal(signal.SIGTERM)
        assert d.wait(timeout=20) == 0, _read(d.err_path)
    finally:
        holder.close()
        watcher.close()
        r.cleanup()


def test_a_reload_while_a_database_call_hangs_is_acted_on_once_the_driver_is_ready(tmp_path, pg_dsn):
    """docs/failures.md: a SIGHUP ends a hung call too once the driver is ready, and is then
    acted on (SPEC: within 1 s). pgcall decides by the wake-up pipe's ``ready``,
    which only RealEnv.ready sets: unset, the reload waited out the call's bound
    (10 s here), and no other test noticed. A paused ring (no run to wait for:
    a reload is done between runs) whose lease renewal hangs, its server
    process stopped, is sent SIGHUP."""
    ttl = 50.0   # the bound on a call (ttl/5 = 10 s) is far beyond what the test allows
    (tmp_path / "a").mkdir()
    r = Ring(tmp_path / "a")
    backend = d = None
    try:
        r.write_config(ring={"journal": pg_dsn, "lease_ttl": ttl, "heartbeat_interval": 0.2})
        r.roster("a /bin/true")
        d = r.start_driver()
        wait_until(lambda: role(r) == "leader", timeout=20, message="the driver leads")
        assert r.cli("pause").returncode == 0
        wait_until(lambda: "ring paused" in _read(d.err_path), timeout=20, message="the ring paused")
        backend = _backend_of(pg_dsn, d.pid)
        os.kill(backend, signal.SIGSTOP)
        # beats are 0.2 s apart: a heartbeat this old means the driver is inside the hung call
        wait_until(lambda: _beat_age(r) > 1.0, timeout=10, message="the driver stuck in a database call")
        before = _read(d.err_path).count("config reloaded")
        sent = time.monotonic()
        d.send_signal(signal.SIGHUP)
        wait_until(lambda: _read(d.err_path).count("config reloaded") > before, timeout=15, interval=0.01,
                   message="the reload")
        took = time.monotonic() - sent
        err = _read(d.err_path)
        # the signal ended the call (not its 10 s bound): the SPEC's second is the
        # 0.2 s grace; the wall clock gets a loaded box's headroom below the bound
        assert "has a signal to act on" in err and d.poll() is None, err
        assert took < 5.0, (took, err)
    finally:
        try:
            if backend is not None:
                _continue(backend)
            if d is not None and d.poll() is None:
                d.send_signal(signal.SIGTERM)
                d.wait(timeout=20)
        finally:
            r.cleanup()


def test_a_lease_table_dropped_by_hand_is_made_again_and_the_ring_runs(tmp_path, pg_dsn):
    """The lease table dropped between two drivers (an operator's DROP, a
    partial restore): the next driver stood by for good, healthy to status and
    ringwatch, its one line blaming the network ("cannot reach the journal").
    It makes the table again (named in one line) and, one TTL later, leads."""
    r = _one_lap_then(tmp_path, pg_dsn, "DROP TABLE lease")
    try:
        res = r.cli("run", "--once", timeout=TTL + 60)
        assert res.returncode == 0, res.stderr
        assert "journal schema: lease missing" in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert len(pg_rows(pg_dsn, "SELECT 1 FROM runs WHERE status = 'ok'")) == 2
    finally:
        r.cleanup()


def _clean_stop_on_sigterm(d, what):
    """SIGTERM to driver ``d``: it exits 0 within 5 s, no traceback; its stderr."""
    sent = time.monotonic()
    d.send_signal(signal.SIGTERM)
    wait_until(lambda: d.poll() is not None, timeout=30, interval=0.01, message=what)
    took = time.monotonic() - sent
    err = d.communicate()[1].decode()
    assert d.returncode == 0, (d.returncode, err)
    assert took < 8 and "Traceback" not in err, (took, err)   # (the call's bound: 10 s)
    return err


def _one_lap_then(tmp_path, pg_dsn, sql):
    """A PostgreSQL ring that ran one lap, then ``sql`` done to its journal by hand."""
    import psycopg
    (tmp_path / "a").mkdir()
    r = Ring(tmp_path / "a")
    try:
        r.write_config(ring={"journal": pg_dsn, "lease_ttl": TTL, "heartbeat_interval": 0.2})
        r.roster("a /bin/true")
        first = r.cli("run", "--once", timeout=60)
        assert first.returncode == 0, first.stderr
        with psycopg.connect(pg_dsn, autocommit=True) as con:
            con.execute(sql)
    except BaseException:
        r.cleanup()
        raise
    return r


# --- the second round: dead connections, outages, a dropped table, a pooler ---

def _waiting_ring(tmp_path, dsn, ttl=TTL, heartbeat=0.2, **ring):
    """A one-driver PostgreSQL ring whose first agent runs until ``flag`` exists,
    then exits 0; the next one sleeps. Returns (ring, flag)."""
    flag = tmp_path / "go"
    (tmp_path / "a").mkdir()
    r = Ring(tmp_path / "a")
    r.write_config(ring={"journal": dsn, "lease_ttl": ttl, "heartbeat_interval": heartbeat,
                         "run_budget": 120, "stall_threshold": 150, **ring})
    r.agent("waits", f"while [ ! -e {flag} ]; do sleep 0.02; done\n")
    r.agent("after", "sleep 60\n")
    r.roster(f"waits {r.agents_dir}/waits.sh", f"after {r.agents_dir}/after.sh")
    return r, flag


def _in_flight(dsn, agent=None):
    """The running row once its agent's pid is recorded (of ``agent``, if given)."""
    import psycopg

    def found():
        try:
            x = running_row(dsn)
        except psycopg.errors.UndefinedTable:   # the driver has not made the schema yet
            return None
        return x if x and x["pid"] and (agent is None or x["agent"] == agent) else None
    return wait_until(found, timeout=20, message=f"a run of {agent or 'an agent'} in flight")


def _closed(dsn, run_id, timeout):
    return wait_until(lambda: pg_rows(dsn, "SELECT * FROM runs WHERE id = %s AND status <> 'running'", run_id),
                      timeout=timeout, message=f"run {run_id} closed")[0]


def _alter_system(dsn, setting, value):
    """ALTER SYSTEM SET (value None: RESET) and reload: the whole server, every session."""
    import psycopg
    with psycopg.connect(dsn, autocommit=True) as con:
        if value is None:
            con.execute(f"ALTER SYSTEM RESET {setting}")
        else:
            con.execute(f"ALTER SYSTEM SET {setting} = '{value}'")
        con.execute("SELECT pg_reload_conf()")


def _stays_alive(pid, seconds, what):
    """A bounded watch: ``pid`` lives (not a zombie) for all of ``seconds``."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        assert proc_state(pid) not in (None, "Z"), what
        time.sleep(0.02)


def test_a_run_that_ended_while_the_server_restarted_keeps_its_end(tmp_path, pg_cluster, pg_dsn):
    """The agent exits 0 while the server is restarting, and the outage outlasts
    the half-TTL switch. The driver knew the end, dropped it at the switch, took
    the lease again once the server was back and reaped its own row as
    `interrupted` ("lost its lease while it ran"). A driver never reaps a run it
    saw end: it keeps the end and writes it, fenced by its new lease."""
    r, flag = _waiting_ring(tmp_path, pg_dsn)
    try:
        d = r.start_driver()
        row = _in_flight(pg_dsn, "waits")
        pg_cluster.stop("fast")
        try:
            flag.touch()
            wait_until(lambda: proc_state(row["pid"]) in (None, "Z"), timeout=5, message="the agent's exit 0")
            wait_until(lambda: "no longer leading" in _read(d.err_path), timeout=TTL + 5,
                       message="the lease lost while the server is away")
        finally:
            pg_cluster.start()
        closed = _closed(pg_dsn, row["id"], timeout=TTL + 15)
        err = _read(d.err_path)
        assert (closed["status"], closed["exit_code"]) == ("ok", 0), (dict(closed), err[-3000:])
        ev = pg_rows(pg_dsn, "SELECT source FROM events WHERE run_id = %s AND kind = 'ok'", row["id"])
        assert [e["source"] for e in ev] == ["driver"]
        assert "lost its lease while it ran" not in err, err
        _in_flight(pg_dsn, "after")   # and the ring goes on
    finally:
        r.cleanup()


def _backend_gone(dsn, driver_pid, old):
    """The driver's server process once it is another than ``old`` (a new connection)."""
    return wait_until(lambda: (lambda rows: rows[0]["pid"] if len(rows) == 1 and rows[0]["pid"] != old else None)(
        pg_rows(dsn, "SELECT pid FROM pg_stat_activity WHERE application_name = %s", f"ringd pid={driver_pid}")),
        timeout=10, message="the driver on a new connection")


def test_a_dropped_connection_costs_a_healthy_run_nothing(tmp_path, pg_dsn):
    """pg_terminate_backend of the leader's server process while its agent runs:
    the next renewal failed on the dead connection, the one after came due
    exactly at the half-TTL switch, and the agent was killed 2 s later though
    the database answered at once. The connection is checked before it is
    trusted (and a dead one retried once at once on a fresh one)."""
    ttl = 4.0
    r = _one_pg_ring(tmp_path, pg_dsn, ttl)
    r.write_config(ring={"heartbeat_interval": 10})   # the beat is the lease's own
    try:
        d = r.start_driver()
        row = _in_flight(pg_dsn)
        backend = _backend_of(pg_dsn, d.pid)
        for _ in range(2):
            assert pg_rows(pg_dsn, "SELECT pg_terminate_backend(%s) AS t", backend)[0]["t"]
            backend = _backend_gone(pg_dsn, d.pid, backend)
        _stays_alive(row["pid"], ttl, "the agent killed after a dropped connection")
        err = _read(d.err_path)
        assert "lease: cannot" not in err and "no longer leading" not in err, err
        assert role(r) == "leader" and running_row(pg_dsn)["id"] == row["id"]
    finally:
        r.cleanup()


def test_a_renewal_that_fails_once_is_retried_before_the_half_ttl_switch(tmp_path, pg_dsn):
    """One renewal fails after its whole bound (the lease row locked by another
    session past lock_timeout). With a beat every quarter TTL and the same bound,
    the retry came due exactly at the half-TTL switch, and the healthy run was
    killed. The next renewal must come before the switch, with room to spare."""
    import psycopg
    ttl = 8.0
    r = _one_pg_ring(tmp_path, pg_dsn, ttl)
    r.write_config(ring={"heartbeat_interval": 10})   # the beat is the lease's own
    locker = psycopg.connect(pg_dsn)
    try:
        d = r.start_driver()
        row = _in_flight(pg_dsn)
        locker.execute("SELECT * FROM lease FOR UPDATE")   # (a transaction: psycopg's default)
        try:
            wait_until(lambda: "lease: cannot" in _read(d.err_path), timeout=ttl, interval=0.005,
                       message="a renewal failing on the locked row")
        finally:
            locker.rollback()
        wait_until(lambda: "lease: journal reachable again" in _read(d.err_path), timeout=ttl / 2,
                   message="the renewal retried")
        _stays_alive(row["pid"], ttl / 2, "the agent killed after one failed renewal")
        err = _read(d.err_path)
        assert "no longer leading" not in err and "killed run" not in err, err
        assert role(r) == "leader" and running_row(pg_dsn)["id"] == row["id"]
    finally:
        locker.close()
        r.cleanup()


def test_an_idle_session_timeout_shorter_than_the_beat_costs_nothing(tmp_path, pg_dsn):
    """The server closes every session idle longer than the beat
    (idle_session_timeout): each beat met a connection closed under it. The
    ring never led again, and a clean stop left a `running` row. A connection
    the server may have closed is checked before it is trusted."""
    r = _one_pg_ring(tmp_path, pg_dsn, TTL)
    r.write_config(ring={"heartbeat_interval": 10})   # the beat is the lease's own (TTL/5 or more)
    try:
        d = r.start_driver()
        row = _in_flight(pg_dsn)
        _alter_system(pg_dsn, "idle_session_timeout", "250ms")
        try:
            _stays_alive(row["pid"], 2 * TTL, "the agent killed while the server closes idle sessions")
            assert role(r) == "leader"
            err = _clean_stop_on_sigterm(d, "the driver's clean stop")
        finally:
            _alter_system(pg_dsn, "idle_session_timeout", None)
        closed = pg_rows(pg_dsn, "SELECT * FROM runs WHERE id = %s", row["id"])[0]
        assert closed["status"] == "interrupted", (dict(closed), err)
        assert pg_rows(pg_dsn, "SELECT holder FROM lease")[0]["holder"] is None, "the lease was not released"
        assert "lease: cannot" not in err and "no longer leading" not in err, err
    finally:
        r.cleanup()


def test_a_lease_table_dropped_under_a_running_ring_is_made_again(tmp_path, pg_dsn):
    """DROP TABLE lease while the leader's agent runs: the leader SIGKILLed its
    agent, stood by for good, left a `running` row, and status said ok. A table
    missing while running is made again at once; the leader, whose lease was
    still good on the server's clock, takes the new row and its run goes on."""
    import psycopg
    (tmp_path / "a").mkdir()
    r = Ring(tmp_path / "a")
    r.write_config(ring={"journal": pg_dsn, "lease_ttl": TTL, "heartbeat_interval": 0.2,
                         "run_budget": 60, "stall_threshold": 90})
    r.agent("long", f"sleep {TTL * 1.5}\n")
    r.roster(f"long {r.agents_dir}/long.sh", "quick /bin/true")
    try:
        d = r.start_driver()
        row = _in_flight(pg_dsn, "long")
        with psycopg.connect(pg_dsn, autocommit=True) as con:
            con.execute("DROP TABLE lease")
        wait_until(lambda: "journal schema: lease missing" in _read(d.err_path), timeout=5,
                   message="the table made again")
        closed = _closed(pg_dsn, row["id"], timeout=TTL * 1.5 + 10)
        assert (closed["status"], closed["exit_code"]) == ("ok", 0), (dict(closed), _read(d.err_path)[-3000:])
        wait_until(lambda: pg_rows(pg_dsn, "SELECT 1 FROM runs WHERE agent = 'quick' AND status = 'ok'"),
                   timeout=10, message="the ring going on")
        assert f"pid={d.pid} " in pg_rows(pg_dsn, "SELECT holder FROM lease")[0]["holder"]
        doc = json.loads(r.cli("status", "--json").stdout)
        assert doc["driver"]["role"] == "leader", doc["driver"]
    finally:
        r.cleanup()


def test_a_read_only_database_is_said_so_and_the_known_end_written_once_it_takes_writes(tmp_path, pg_dsn):
    """The server turned read-only (default_transaction_read_only) just as a run
    ends: its end cannot be written. The driver said it was "retrying until the
    state dir is writable" (a SQLite ring's words), and then reaped its own row.
    It names the database, and writes the known end once the server takes writes."""
    r, flag = _waiting_ring(tmp_path, pg_dsn)
    try:
        d = r.start_driver()
        row = _in_flight(pg_dsn, "waits")
        _alter_system(pg_dsn, "default_transaction_read_only", "on")
        try:
            flag.touch()
            line = wait_until(lambda: [x for x in _read(d.err_path).splitlines() if "cannot be recorded" in x],
                              timeout=10, message="the end that cannot be recorded")[0]
        finally:
            _alter_system(pg_dsn, "default_transaction_read_only", None)
        assert "read-only transaction" in line and "state dir" not in line, line
        closed = _closed(pg_dsn, row["id"], timeout=TTL + 10)
        assert (closed["status"], closed["exit_code"]) == ("ok", 0), (dict(closed), _read(d.err_path)[-3000:])
    finally:
        r.cleanup()


# --- behind pgbouncer in transaction mode ---

@pytest.fixture(params=["session", "transaction"])
def bouncer(request, pg_cluster):
    """pgbouncer in front of the test's server: in session mode (the tested path
    of docs/many-hosts.md), and in transaction mode with one server connection
    for every client (so a session setting that leaks reaches the next client
    for sure); on a fresh database (pgbouncer refuses the ``options`` startup
    parameter the schema-per-test DSNs use). Yields (its DSN, the database's
    own DSN)."""
    import psycopg
    exe = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if os.access("/usr/sbin/pgbouncer", os.X_OK) else None)
    if exe is None:
        pytest.skip("pgbouncer is not installed")
    mode = request.param
    name = f"ring_pgb_{os.getpid()}_{int(time.monotonic() * 1000)}"
    with psycopg.connect(pg_cluster.dsn(), autocommit=True) as con:
        con.execute(f"CREATE DATABASE {name}")
    d = Path(tempfile.mkdtemp(prefix="ring-pgb-", dir="/tmp"))
    (d / "users.txt").write_text('"postgres" ""\n')
    (d / "pgbouncer.ini").write_text(f"""[databases]
{name} = host={pg_cluster.dir} dbname={name} user=postgres
[pgbouncer]
listen_addr =
listen_port = 6432
unix_socket_dir = {d}
auth_type = trust
auth_file = {d}/users.txt
pool_mode = {mode}
default_pool_size = {1 if mode == "transaction" else 10}
max_client_conn = 100
logfile = {d}/pgbouncer.log
""")
    argv = [exe, str(d / "pgbouncer.ini")]
    if os.geteuid() == 0:   # pgbouncer refuses to run as root; setpriv execs it (one pid to end)
        import pwd
        pw = pwd.getpwnam("postgres")
        os.chown(d, pw.pw_uid, pw.pw_gid)
        for f in d.iterdir():
            os.chown(f, pw.pw_uid, pw.pw_gid)
        argv = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    try:
        wait_until(lambda: (d / ".s.PGSQL.6432").exists() or proc.poll() is not None, timeout=10,
                   message="pgbouncer listening")
        assert proc.poll() is None, _read(d / "pgbouncer.log")
        yield f"postgresql://postgres@/{name}?host={d}&port=6432", pg_cluster.dsn(name)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(d, ignore_errors=True)
        with psycopg.connect(pg_cluster.dsn(), autocommit=True) as con:
            con.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_a_ring_behind_pgbouncer_survives_its_readers(tmp_path, bouncer):
    """Behind a transaction-mode pooler a reader's session SET (read-only, its
    timeouts) stayed on the shared server connection: one `ringd status` made
    the driver's next write fail as read-only, and the ring stopped. Settings
    are scoped to the transaction (BEGIN READ ONLY, SET LOCAL)."""
    dsn, direct = bouncer
    (tmp_path / "a").mkdir()
    r = Ring(tmp_path / "a")
    r.write_config(ring={"journal": dsn, "lease_ttl": TTL, "heartbeat_interval": 0.2})
    r.agent("short", "sleep 0.05\n")
    r.roster(f"one {r.agents_dir}/short.sh", f"two {r.agents_dir}/short.sh")
    try:
        d = r.start_driver()

        def oks():
            import psycopg
            try:
                return pg_rows(direct, "SELECT count(*) AS n FROM runs WHERE status = 'ok'")[0]["n"]
            except psycopg.errors.UndefinedTable:   # the driver has not made the schema yet
                return 0
        wait_until(lambda: oks() >= 3, timeout=20, message="the ring turning behind pgbouncer")
        for _ in range(3):
            st = r.cli("status", "--json")
            assert st.returncode == 0, st.stdout + st.stderr
            assert r.cli("history").returncode == 0
        seen = oks()
        wait_until(lambda: oks() >= seen + 10, timeout=15, message="the ring going on after its readers")
        err = _read(d.err_path)
        assert "read-only" not in err and "no longer leading" not in err, err[-3000:]
        assert role(r) == "leader"
    finally:
        r.cleanup()


def test_a_connection_that_dies_at_its_first_statement_is_made_again_and_the_statement_sent_again(
        pg_cluster, pg_dsn):
    """A connection that passed its check dies as the first statement of a
    transaction goes out (a network cut, the server's timeout firing at that
    moment): nothing of it ran, so it is sent again, once, on a fresh
    connection, before anything is concluded about the lease."""
    from ringd.journal.pg import PgJournal
    from ringd.core.lease import RENEW, TAKE
    go = threading.Event()
    proxy = ConnectionCutter(pg_cluster.dir, lambda state, data: "now" if go.is_set() and b"BEGIN" in data else None)
    j = PgJournal.connect(proxy.dsn(pg_dsn), ttl=30)
    try:
        assert j.acquire("A", 30).action == TAKE
        go.set()
        assert j.acquire("A", 30).action == RENEW   # the cut BEGIN, sent again
        assert proxy.dropped.is_set()
        proxy.dropped.clear()
        proxy.armed = True
        assert j.meta("k") is None                  # a statement that is a transaction of its own
        assert proxy.dropped.is_set()
    finally:
        j.close()
        proxy.close()


def test_run_ids_that_meet_old_logs_of_a_state_dir_moved_from_sqlite_run_their_agents(ring, pg_dsn):
    """A state dir that ran on SQLite (its logs up to run 5), now on a fresh
    PostgreSQL journal whose ids start at 1: each run met an old log at its
    path and ended ``error`` (0 ok and 2 error in 6 s). The old log is set
    aside, never written through or thrown away, and the agent runs ``ok``."""
    ring.write_config(ring={"journal": pg_dsn, "lease_ttl": TTL, "heartbeat_interval": 0.2})
    ring.agent("a", "echo new run $RING_RUN_ID")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    logs = ring.state / "logs" / "a"
    logs.mkdir(parents=True, mode=0o700)
    for i in range(1, 6):
        (logs / f"{i}.log").write_text(f"old sqlite run {i}\n")
    for _ in range(2):
        res = ring.cli("run", "--once", timeout=60)
        assert res.returncode == 0, res.stderr
    runs = pg_rows(pg_dsn, "SELECT id, status FROM runs ORDER BY id")
    assert [r["status"] for r in runs] == ["ok", "ok"], runs
    for r in runs:
        assert (logs / f"{r['id']}.log").read_text() == f"new run {r['id']}\n"
        (old,) = logs.glob(f"{r['id']}.log.aside-*")
        assert old.read_text() == f"old sqlite run {r['id']}\n"
