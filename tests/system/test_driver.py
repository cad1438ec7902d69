"""ringd run with real processes: order, one at a time, every ending, process
trees, hot reload, lock, reaping after SIGKILL, clean stop."""
import os
import random
import re
import signal
import sqlite3
import stat
import time

import psutil
import pytest

from conftest import line_written, processes_of, wait_until


def statuses(ring):
    return [(r["agent"], r["status"]) for r in ring.runs()]


def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def agent_run_ids(ring):
    """{pid: RING_RUN_ID} of live agent processes of this ring."""
    out = {}
    for p in processes_of(ring.state):
        try:
            run_id = p.environ().get("RING_RUN_ID")
            if run_id and p.status() != psutil.STATUS_ZOMBIE:
                out[p.pid] = run_id
        except psutil.Error:
            pass
    return out


def agent_processes(ring):
    return list(agent_run_ids(ring))


def finish(proc, timeout=15):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, err.decode()


def test_once_runs_each_agent_once_with_every_ending(ring):
    ring.agent("ok", "echo fine")
    ring.agent("bad", "exit 3")
    ring.agent("later", "exit 75")
    ring.agent("slow", "exec sleep 30")
    ring.agent("wedged", "trap '' TERM\nwhile :; do sleep 0.05; done")
    ring.write_config(agents={"slow": {"run_budget": 0.3, "stall_threshold": 2},
                              "wedged": {"run_budget": 0.3, "stall_threshold": 0.8}})
    a = ring.agents_dir
    ring.roster(f"ok {a}/ok.sh", f"bad {a}/bad.sh", f"later {a}/later.sh", "ghost ./no/such/program",
                f"slow {a}/slow.sh", f"wedged {a}/wedged.sh")
    code, err = finish(ring.start_driver("--once"), timeout=30)
    assert code == 0, err
    rows = ring.runs()
    assert [(r["agent"], r["status"]) for r in rows] == [
        ("ok", "ok"), ("bad", "failed"), ("later", "deferred"), ("ghost", "error"),
        ("slow", "timeout"), ("wedged", "stalled")]
    by = {r["agent"]: r for r in rows}
    assert by["bad"]["exit_code"] == 3
    assert by["later"]["exit_code"] == 75
    assert "No such file" in by["ghost"]["reason"]
    assert by["slow"]["signal"] == signal.SIGTERM
    assert by["wedged"]["signal"] == signal.SIGKILL
    assert 0.7 < by["wedged"]["duration"] < 2.5
    for r in rows:
        assert r["ended_at"] >= r["started_at"] and r["duration"] >= 0
    assert (ring.state / "logs" / "ok" / f"{by['ok']['id']}.log").read_text() == "fine\n"
    assert ring.heartbeat()["stopped"] is True


def test_order_wraps_around_and_never_two_at_once(ring):
    for n in "abc":
        ring.agent(n, "sleep 0.05")
    ring.roster(*(f"{n} {ring.agents_dir}/{n}.sh" for n in "abc"))
    ring.start_driver()
    max_alive = 0
    deadline = time.monotonic() + 30
    while len(ring.runs()) < 10 and time.monotonic() < deadline:
        run_ids = set(agent_run_ids(ring).values())
        max_alive = max(max_alive, len(run_ids))
        time.sleep(0.005)
    rows = ring.runs()
    assert len(rows) >= 10
    assert max_alive <= 1
    done = [r["agent"] for r in rows if r["status"] != "running"]
    assert done == ["a", "b", "c", "a", "b", "c", "a", "b", "c", "a", "b", "c"][:len(done)]
    spans = sorted((r["started_at"], r["ended_at"]) for r in rows if r["ended_at"])
    for (s1, e1), (s2, _) in zip(spans, spans[1:]):
        assert e1 <= s2, "two runs overlapped"


def test_no_process_of_a_run_survives_it(ring):
    pids = ring.base / "pids"
    ring.agent("escaper", f"""
        trap '' TERM
        setsid sh -c 'trap "" TERM; echo $$ >> {pids}; exec sleep 60' &
        ( sh -c 'echo $$ >> {pids}; exec sleep 60' & )
        sleep 60
        """)
    ring.agent("quitter", f"""
        sh -c 'echo $$ >> {pids}; exec sleep 60' &
        setsid sh -c 'echo $$ >> {pids}; exec sleep 60' &
        while [ $(wc -l < {pids}) -lt 4 ]; do sleep 0.01; done
        exit 0
        """)
    ring.write_config(agents={"escaper": {"run_budget": 0.3, "stall_threshold": 0.8}})
    ring.roster(f"escaper {ring.agents_dir}/escaper.sh", f"quitter {ring.agents_dir}/quitter.sh")
    code, err = finish(ring.start_driver("--once"), timeout=30)
    assert code == 0, err
    assert statuses(ring) == [("escaper", "stalled"), ("quitter", "ok")]
    started = [int(x) for x in pids.read_text().split()]
    assert len(started) == 4
    assert all(gone(pid) for pid in started), "a descendant outlived its run"
    assert not agent_processes(ring)
    # docs/failures.md: what an exit 0 left behind is killed, and said so
    assert re.search(r"run \d+: quitter left [12] process\(es\) behind; killed them", err), err


def test_an_agent_sigkilled_by_someone_else_is_failed_signal_9_and_its_tree_dies(ring):
    """docs/failures.md: an agent killed by someone else (SIGKILL,
    the OOM killer) is a ``failed`` row with signal 9, what it left is killed, and
    the ring moves on at once."""
    child_file = ring.base / "child.pid"
    ring.agent("victim", f"""
        setsid sleep 60 &
        echo $! > {child_file}.tmp && mv {child_file}.tmp {child_file}
        exec sleep 60
        """)
    ring.agent("next", "exec sleep 60")
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"victim {ring.agents_dir}/victim.sh", f"next {ring.agents_dir}/next.sh")
    ring.start_driver()
    row = wait_until(lambda: ring.rows("SELECT * FROM runs WHERE agent = 'victim' AND pid IS NOT NULL"),
                     message="victim running with its pid recorded")[0]
    child = int(wait_until(lambda: child_file.exists() and child_file.read_text().strip(), message="child up"))
    assert not gone(child)
    os.kill(row["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    nxt = wait_until(lambda: ring.rows("SELECT * FROM runs WHERE agent = 'next'"), message="next agent's turn")
    took = time.monotonic() - t0
    final = ring.rows("SELECT * FROM runs WHERE id = ?", row["id"])[0]
    assert final["status"] == "failed" and final["signal"] == signal.SIGKILL, dict(final)
    assert final["exit_code"] is None
    assert nxt[0]["id"] > row["id"] and took < 5.0, took   # at once (generous bound for a loaded box)
    wait_until(lambda: gone(child), timeout=5, message="the killed agent's child killed with its run")


def test_environment_and_descriptors_of_an_agent(ring):
    out = ring.base / "env.txt"
    ring.agent("envy", f"env > {out}; exec python3 -c 'import os; d=\"/proc/self/fd\"; "
                       f"print(*(os.readlink(d+\"/\"+f) for f in os.listdir(d) if os.path.exists(d+\"/\"+f)))' > {out}.fds")
    ring.roster(f"envy {ring.agents_dir}/envy.sh")
    env = dict(ring.env, NOTIFY_SOCKET="/nonexistent/notify", WATCHDOG_USEC="1000000", WATCHDOG_PID="1")
    code, err = finish(ring.start_driver("--once", env=env))
    assert code == 0, err
    seen = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    row = ring.runs()[0]
    # the driver's own systemd socket never reaches an agent: it gets the run's own
    assert seen["NOTIFY_SOCKET"] == str(ring.state / f"notify-{row['id']}.sock")
    assert not any(k.startswith("WATCHDOG_") for k in seen)
    assert seen["RING_AGENT"] == "envy" and seen["RING_RUN_ID"] == str(row["id"])
    assert seen["RING_STATE"] == str(ring.state)
    assert float(seen["RING_RUN_BUDGET"]) == 2.0
    assert abs(float(seen["RING_DEADLINE"]) - (row["started_at"] + 2.0)) < 0.01
    targets = (out.parent / "env.txt.fds").read_text().split()
    leaked = [t for t in targets if str(ring.state) in t and "/logs/" not in t or t.startswith("socket:")]
    assert not leaked, f"agent inherited the driver's descriptors: {leaked}"


def test_files_are_private_whatever_the_umask(ring, tmp_path):
    state = tmp_path / "fresh"
    ring.state = state  # the fixture's cleanup scans this one too
    ring.agent("a", "echo hi")
    ring.write_config(ring={"roster": str(tmp_path / "r.txt")})
    (tmp_path / "r.txt").write_text(f"a {ring.agents_dir}/a.sh\n")
    os.chmod(tmp_path / "r.txt", 0o600)
    old = os.umask(0)
    try:
        code, err = finish(ring.start_driver("--once"))
    finally:
        os.umask(old)
    assert code == 0, err
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    for f in ("journal.db", "ringd.heartbeat", "logs/a/1.log"):
        assert stat.S_IMODE(os.stat(state / f).st_mode) == 0o600, f


def test_keep_logs(ring):
    ring.write_config(ring={"keep_logs": 2})
    ring.agent("a", "echo $RING_RUN_ID")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    for _ in range(4):
        code, err = finish(ring.start_driver("--once"))
        assert code == 0, err
    assert sorted(os.listdir(ring.state / "logs" / "a")) == ["3.log", "4.log"]


def test_hot_reload_and_broken_edit_keeps_last_good_roster(ring):
    ring.agent("a", "sleep 0.05")
    ring.agent("b", "sleep 0.05")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.start_driver()
    wait_until(lambda: len(ring.runs()) >= 2, message="a ran twice")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")
    wait_until(lambda: any(r["agent"] == "b" for r in ring.runs()), message="b added without restart")
    ring.roster(f"a {ring.agents_dir}/a.sh", "b 'unbalanced")
    wait_until(lambda: (ring.heartbeat() or {}).get("roster_error"), message="roster error recorded")
    assert "ring.txt:2" in ring.heartbeat()["roster_error"]
    n = len(ring.runs())
    wait_until(lambda: len(ring.runs()) >= n + 4, message="ring keeps turning on the last good roster")
    assert {r["agent"] for r in ring.runs()[n:]} == {"a", "b"}
    ring.roster(f"a {ring.agents_dir}/a.sh")
    wait_until(lambda: not (ring.heartbeat() or {}).get("roster_error"), message="error cleared")
    n = len(ring.runs())
    wait_until(lambda: len(ring.runs()) >= n + 3, message="ring turns on the fixed roster")
    assert {r["agent"] for r in ring.runs()[n + 1:]} == {"a"}


def test_second_driver_exits_75_naming_the_holder(ring):
    ring.agent("a", "sleep 0.2")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    first = ring.start_driver()
    wait_until(lambda: ring.heartbeat(), message="first driver's heartbeat")
    code, err = finish(ring.start_driver())
    assert code == 75
    assert f"pid {first.pid}" in err and "\n" == err[-1] and err.count("\n") == 1


def test_sigterm_stops_cleanly(ring):
    ring.agent("stubborn", "trap '' TERM\nsleep 30")
    ring.roster(f"stubborn {ring.agents_dir}/stubborn.sh")
    drv = ring.start_driver()
    wait_until(lambda: agent_processes(ring), message="agent running")
    drv.send_signal(signal.SIGTERM)
    code, err = finish(drv, timeout=15)
    assert code == 0, err
    (row,) = ring.runs()
    assert row["status"] == "interrupted"
    ev = ring.rows("SELECT source FROM events WHERE run_id = ? AND kind = 'interrupted'", row["id"])
    assert [e["source"] for e in ev] == ["driver"]
    assert not agent_processes(ring)
    assert ring.heartbeat()["stopped"] is True


def test_sigkilled_driver_orphan_is_reaped_by_the_next(ring):
    pids = ring.base / "pids"
    ring.agent("long", f"[ -e {pids} ] && exit 0\necho $$ >> {pids}\nsetsid sh -c 'echo $$ >> {pids}; exec sleep 60' &\nsleep 60")
    ring.agent("next", "true")
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"long {ring.agents_dir}/long.sh", f"next {ring.agents_dir}/next.sh")
    drv = ring.start_driver()
    wait_until(lambda: pids.exists() and len(pids.read_text().split()) == 2, message="agent and grandchild up")
    drv.send_signal(signal.SIGKILL)
    drv.wait(timeout=10)
    orphans = [int(x) for x in pids.read_text().split()]
    assert not any(gone(p) for p in orphans), "orphans should still be alive before the reaper"
    assert ring.runs()[0]["status"] == "running"
    code, err = finish(ring.start_driver("--once"), timeout=30)
    assert code == 0, err
    rows = ring.runs()
    assert rows[0]["status"] == "interrupted" and rows[0]["agent"] == "long"
    ev = ring.rows("SELECT source, detail FROM events WHERE run_id = ? AND kind = 'interrupted'", rows[0]["id"])
    assert ev[0]["source"] == "reaper" and "from=running" in ev[0]["detail"]
    assert wait_until(lambda: all(gone(p) for p in orphans), timeout=5, message="orphans killed")
    assert rows[1]["agent"] == "next", "the ring moves on after the reaped agent, not re-running it"


def test_deferral_backoff_survives_a_restart(ring):
    ring.write_config(ring={"backoff_initial": 60, "backoff_max": 120})
    ring.agent("limited", "exit 75")
    ring.agent("fine", "true")
    ring.roster(f"limited {ring.agents_dir}/limited.sh", f"fine {ring.agents_dir}/fine.sh")
    for _ in range(2):
        code, err = finish(ring.start_driver("--once"))
        assert code == 0, err
    assert statuses(ring) == [("limited", "deferred"), ("fine", "ok"), ("fine", "ok")]
    (state,) = ring.rows("SELECT backoff_until FROM agents WHERE name = 'limited'")
    assert state["backoff_until"] > time.time() + 50


def test_driver_leaves_no_zombies(ring):
    ring.agent("forker", "for i in 1 2 3; do (sleep 0.01 &) ; done; sleep 0.1")
    ring.roster(f"forker {ring.agents_dir}/forker.sh")
    drv = ring.start_driver()
    wait_until(lambda: len(ring.runs()) >= 4, message="a few runs")
    def no_zombies():
        running = {r["pid"] for r in ring.runs() if r["status"] == "running"}
        zombies = []
        for k in psutil.Process(drv.pid).children():
            try:
                if k.status() == psutil.STATUS_ZOMBIE and k.pid not in running:
                    zombies.append(k.pid)
            except psutil.NoSuchProcess:
                pass  # reaped while we looked
        return not zombies
    wait_until(no_zombies, timeout=5, message="no zombie children of the driver")


def test_config_errors_exit_78_with_the_key(ring):
    ring.agent("a", "true")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.write_config(ring={"run_budget": -5})
    code, err = finish(ring.start_driver())
    assert code == 78 and "ring.run_budget" in err and "Traceback" not in err
    r = ring.cli("check")
    assert r.returncode == 78 and "ring.run_budget" in r.stderr
    ring.write_config(ring={"run_budget": 2})
    assert ring.cli("check").returncode == 0
    ring.roster("a 'oops")
    code, err = finish(ring.start_driver())
    assert code == 78 and "ring.txt:1" in err and "Traceback" not in err
    assert ring.cli("check").returncode == 78


def test_corrupt_journal_refuses_to_start_and_is_kept(ring):
    ring.agent("a", "true")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.journal_path.write_bytes(b"\x00garbage" * 100)
    code, err = finish(ring.start_driver("--once"))
    assert code == 78 and "journal.db" in err and "not a valid SQLite" in err
    assert ring.journal_path.read_bytes() == b"\x00garbage" * 100


def test_thirty_sigkills_leave_a_coherent_journal(ring):
    marks = ring.base / "marks"
    ring.agent("a", f"echo $RING_RUN_ID >> {marks}; sleep 0.02")
    ring.agent("b", f"echo $RING_RUN_ID >> {marks}; sleep 0.05")
    ring.agent("c", f"echo $RING_RUN_ID >> {marks}; exit 1")
    ring.roster(*(f"{n} {ring.agents_dir}/{n}.sh" for n in "abc"))
    rnd = random.Random(1234)
    for _ in range(30):
        drv = ring.start_driver()
        wait_until(lambda: ring.heartbeat() and ring.heartbeat()["pid"] == drv.pid, timeout=10,
                   message="driver up")
        time.sleep(rnd.uniform(0, 0.15))  # a random moment in the driver's life
        drv.send_signal(signal.SIGKILL)
        drv.wait(timeout=10)
    code, err = finish(ring.start_driver("--once"), timeout=30)
    assert code == 0, err
    con = sqlite3.connect(ring.journal_path)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()
    rows = ring.runs()
    assert rows and not [r for r in rows if r["status"] == "running"]
    ids = [r["id"] for r in rows]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    started = [r["started_at"] for r in rows]
    assert started == sorted(started), "ids increase with time"
    recorded = {str(r["id"]) for r in rows}
    assert set(marks.read_text().split()) <= recorded, "an agent ran without a row"
    assert any(r["status"] == "interrupted" for r in rows)


def test_sighup_rereads_the_config(ring):
    ring.agent("nap", "sleep 1")
    ring.roster(f"nap {ring.agents_dir}/nap.sh")
    drv = ring.start_driver()
    wait_until(lambda: any(r["status"] == "ok" for r in ring.runs()), timeout=15, message="a run ok")
    ring.write_config(agents={"nap": {"run_budget": 0.2, "stall_threshold": 0.5}})
    drv.send_signal(signal.SIGHUP)
    wait_until(lambda: any(r["status"] == "timeout" for r in ring.runs()), timeout=15,
               message="the new budget applies without a restart")


def test_speaks_sd_notify_and_keeps_it_from_agents(ring, tmp_path):
    import socket
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    try:
        out = ring.base / "agent-env"
        ring.agent("a", f"env > {out}; sleep 0.3")
        ring.roster(f"a {ring.agents_dir}/a.sh")
        drv = ring.start_driver(env=dict(ring.env, NOTIFY_SOCKET=path))
        got = []
        def heard_all():
            try:
                got.append(sock.recv(4096).decode())
            except socket.timeout:
                pass
            text = "\n".join(got)
            return "READY=1" in text and "WATCHDOG=1" in text and "STATUS=" in text
        wait_until(heard_all, timeout=15, message="READY, WATCHDOG and STATUS from the driver")
        wait_until(lambda: out.exists() and out.read_text(), timeout=10, message="agent ran")
        assert f"NOTIFY_SOCKET={path}" not in out.read_text()
        drv.send_signal(signal.SIGTERM)
        assert drv.wait(timeout=15) == 0
    finally:
        sock.close()


def test_pings_systemds_watchdog_within_watchdogsec_whatever_heartbeat_interval(ring, tmp_path):
    """The driver sent WATCHDOG=1 only with its heartbeat: a heartbeat_interval
    longer than half of ringd.service's WatchdogSec (60 s or more under the
    shipped 60) had systemd abort and restart a healthy driver, agent and all,
    every minute. It now beats at least every half WatchdogSec under systemd,
    after a reload too."""
    import socket
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    try:
        ring.write_config(ring={"heartbeat_interval": 5}, watch={"stale_after": 20})
        ring.agent("a", "sleep 30")
        ring.roster(f"a {ring.agents_dir}/a.sh")
        drv = ring.start_driver(env=dict(ring.env, NOTIFY_SOCKET=path, WATCHDOG_USEC="1000000"))
        pings: list = []

        def pinged(n):
            def more():
                try:
                    if "WATCHDOG=1" in sock.recv(4096).decode():
                        pings.append(time.monotonic())
                except socket.timeout:
                    pass
                return len(pings) >= n
            return more
        wait_until(pinged(4), timeout=15, message="WATCHDOG=1 within WatchdogSec (1 s)")
        drv.send_signal(signal.SIGHUP)   # the reloaded config keeps the watchdog's pace
        wait_until(pinged(10), timeout=15, message="WATCHDOG=1 within WatchdogSec after a reload")
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        assert max(gaps) < 1.0, gaps
        drv.send_signal(signal.SIGTERM)
        assert drv.wait(timeout=15) == 0
    finally:
        sock.close()


def test_a_write_lock_held_by_another_process_never_holds_up_the_agents_budget(ring):
    """0.1 s into a run the driver records its agent's pid on the row, in a write
    transaction. While another process held the journal's write lock (an
    operator's ``sqlite3`` shell, or the agent itself), that write waited for
    the lock up to the busy timeout, 10 s, and the budget's SIGTERM waited with
    it. Now the pid is tried again a second later, and the SIGTERM comes on time."""
    termed = ring.base / "termed"
    ring.agent("a", f"""
        trap 'date +%s.%N > {termed}.$RING_RUN_ID; exit 0' TERM
        sleep 30 & wait
        """)
    ring.write_config(ring={"run_budget": 1, "stall_threshold": 6})
    ring.roster(f"a {ring.agents_dir}/a.sh")
    drv = ring.start_driver()
    wait_until(lambda: [r for r in ring.runs() if r["status"] == "running"], 20, message="the first run")
    holder = sqlite3.connect(str(ring.journal_path), isolation_level=None, timeout=0)
    reader = sqlite3.connect(f"file:{ring.journal_path}?mode=ro", uri=True, timeout=5)
    seen = 0   # the first run may be older than 0.1 s already: the loop takes the next
    try:
        for _attempt in range(4):   # the lock must be ours before the run is 0.1 s old
            def started():
                rows = reader.execute("SELECT id, started_at FROM runs WHERE status = 'running' AND id > ?",
                                      (seen,)).fetchall()
                return rows[0] if rows else None
            run_id, started_at = wait_until(started, 20, interval=0.001, message="a run started")
            wait_until(lambda: _try_lock(holder), 5, interval=0.001, message="the journal's write lock")
            if time.time() - started_at < 0.08:
                break
            holder.execute("ROLLBACK")   # too late for this run's pid record: the next run
            seen = run_id
        else:
            pytest.skip("could not take the journal's write lock within 0.08 s of a run's start")
        termed = termed.with_name(f"termed.{run_id}")
        term_after = float(line_written(termed, 15, message="the budget's SIGTERM")) - started_at
    finally:
        holder.close()   # (rolls back: the run's end can be recorded)
        reader.close()
    assert 0.9 < term_after < 6.0, f"SIGTERM {term_after:.2f}s into a run with a 1 s budget"
    wait_until(lambda: [r for r in ring.runs() if r["id"] == run_id and r["status"] == "timeout"], 20,
               message="the run closed as timeout")
    drv.send_signal(signal.SIGTERM)
    code, err = finish(drv, timeout=30)
    assert code == 0, err
    assert f"run {run_id}: a cannot record its pid yet" in err and "trying again every 1s" in err, err


def _try_lock(con) -> bool:
    try:
        con.execute("BEGIN IMMEDIATE")
        return True
    except sqlite3.OperationalError:
        return False


def test_a_stop_while_the_journal_is_held_at_start_up_is_heard_at_once(ring):
    """An operator's ``sqlite3`` shell holds the journal's write lock
    (``BEGIN EXCLUSIVE``) while a driver starts: its first write waited for
    the lock for the whole busy timeout (10 s), deaf to the SIGTERM that came
    meanwhile - as long as a watcher allows a driver to stop before SIGKILL.
    The wait now looks for a stop between its steps: a clean stop (exit 0)."""
    from ringd.host.lock import holder_pid
    ring.roster("a /bin/true")
    first = ring.cli("run", "--once")
    assert first.returncode == 0, first.stderr   # a journal to hold
    holder = sqlite3.connect(str(ring.journal_path), isolation_level=None, timeout=0)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        drv = ring.start_driver()
        # the lock is taken just before the journal is opened
        wait_until(lambda: holder_pid(ring.state / "ringd.lock") == drv.pid, 20, message="the driver's lock")
        sent = time.monotonic()
        drv.send_signal(signal.SIGTERM)
        wait_until(lambda: drv.poll() is not None, 30, interval=0.01, message="the driver's exit")
        took = time.monotonic() - sent
        err = drv.communicate(timeout=10)[1].decode()
        assert drv.returncode == 0 and "stopped while starting" in err, (drv.returncode, err)
        assert took < 5.0, f"the stop took {took:.1f}s: {err}"   # (10.1 s: the busy timeout)
    finally:
        holder.close()   # (rolls back)
