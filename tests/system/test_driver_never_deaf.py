"""The driver never spins and never goes deaf: real ringd processes, real signals, real SQLite.
(The loop's timing rules - beats and signals between runs, back-off of runs that
cannot start, fast-fail laps - are unit-tested on a fake clock in
test_driver_unit.py.)"""
import json
import os
import shutil
import signal
import subprocess
import time

import psutil
import pytest

from conftest import wait_until
from ringd.host.lock import holder_pid


def running_row(ring):
    rows = ring.rows("SELECT * FROM runs WHERE status = 'running'")
    return rows[0] if rows else None


def stderr_of(p):
    return p.err_path.read_text() if p.err_path and p.err_path.exists() else ""


def can_unshare():
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                          capture_output=True).returncode == 0


@pytest.mark.skipif(not can_unshare(), reason="needs root and unshare(1) for a pid namespace")
def test_a_driver_that_is_pid_1_reaps_the_run_of_the_pid_1_before_it(ring):
    """Containers reuse pids: the dead driver was pid 1 and so is its successor.
    Holding the lock proves the old one dead; its run is reaped, the ring goes on."""
    ring.write_config(ring={"run_budget": 60, "stall_threshold": 90})   # no budget ends a run here
    ring.agent("long", "sleep 60")
    ring.agent("quick", "exit 0")
    ring.roster(f"long {ring.agents_dir}/long.sh", f"quick {ring.agents_dir}/quick.sh")

    def start_pid1():
        return ring.start(["unshare", "--pid", "--fork", "--mount-proc", "--",
                           *[a for a in __import__("conftest").ring_cmd("run", *ring.common())]])

    first = start_pid1()
    row = wait_until(lambda: running_row(ring), timeout=20, message="first run started")
    assert row["agent"] == "long" and row["driver_pid"] == 1
    driver = psutil.Process(first.pid).children()[0]   # ringd, pid 1 in its namespace
    driver.send_signal(signal.SIGKILL)                 # the namespace dies with its pid 1
    first.wait(timeout=10)
    assert ring.rows("SELECT status FROM runs WHERE id = ?", row["id"])[0]["status"] == "running"

    start_pid1()
    wait_until(lambda: ring.rows("SELECT status FROM runs WHERE id = ?", row["id"])[0]["status"] != "running",
               timeout=20, message="the old pid 1's run reaped")
    old = ring.rows("SELECT * FROM runs WHERE id = ?", row["id"])[0]
    assert old["status"] == "interrupted"
    ev = ring.rows("SELECT source FROM events WHERE run_id = ? AND kind = 'interrupted'", row["id"])
    assert [e["source"] for e in ev] == ["reaper"]
    wait_until(lambda: ring.rows("SELECT * FROM runs WHERE agent = 'quick' AND status = 'ok'"),
               timeout=20, message="the ring goes on")


def test_a_deleted_lock_file_is_taken_again_and_a_second_driver_never_reaps_a_live_run(ring):
    ring.write_config(ring={"run_budget": 60, "stall_threshold": 90})   # no budget ends the run here
    ring.agent("long", "sleep 60")
    ring.roster(f"long {ring.agents_dir}/long.sh")
    a = ring.start_driver()
    row = wait_until(lambda: running_row(ring), timeout=20, message="run started")
    lock = ring.state / "ringd.lock"
    lock.unlink()
    b = ring.start_driver()                  # finds no lock file: locks a fresh one at once
    assert b.wait(timeout=20) == 75
    assert f"pid {a.pid}" in stderr_of(b)
    # the first driver's run was never touched
    assert running_row(ring)["id"] == row["id"] and a.poll() is None
    assert psutil.pid_exists(ring.rows("SELECT pid FROM runs WHERE id = ?", row["id"])[0]["pid"] or a.pid)
    # and within a heartbeat or two the first driver holds ringd.lock again
    wait_until(lambda: lock.exists() and holder_pid(lock) == a.pid, timeout=10,
               message="lock taken again by the live driver")
    c = ring.start_driver()
    assert c.wait(timeout=20) == 75
    assert running_row(ring)["id"] == row["id"]
    assert "locked it again" in stderr_of(a)


def test_lock_file_and_heartbeat_deleted_together_a_second_driver_still_sees_the_live_one(ring):
    """``rm STATE/ringd.*`` under a running driver: with its heartbeat gone too, a
    second driver saw no live driver. It went on beside the first - its start-up
    sweep killed the run cgroup the first driver's agent was in, and the first
    gave way - where it should exit 75. The run in flight names its driver."""
    ring.write_config(ring={"run_budget": 60, "stall_threshold": 90, "heartbeat_interval": 30})
    ring.agent("long", "sleep 60")
    ring.roster(f"long {ring.agents_dir}/long.sh")
    a = ring.start_driver()
    row = wait_until(lambda: running_row(ring), timeout=20, message="run started")
    agent = wait_until(lambda: ring.rows("SELECT pid FROM runs WHERE id = ?", row["id"])[0]["pid"], timeout=20,
                       message="the agent's pid recorded")
    ticks = __import__("ringd.host.procid", fromlist=["start_ticks"]).start_ticks(agent)
    (ring.state / "ringd.lock").unlink()
    (ring.state / "ringd.heartbeat").unlink()
    b = ring.start_driver()
    assert b.wait(timeout=20) == 75, stderr_of(b)
    assert f"another driver (pid {a.pid}) is alive" in stderr_of(b)
    assert running_row(ring)["id"] == row["id"] and a.poll() is None
    from ringd.host.procid import same_process
    assert same_process(agent, ticks), "the live driver's agent was killed by the second driver's start-up"


def test_clean_stops_during_a_run_count_nothing_against_the_agent(ring):
    """Three stops (SIGINT or SIGTERM) during runs of one agent: no failures, no quarantine."""
    ring.write_config(ring={"quarantine_after": 3, "run_budget": 60, "stall_threshold": 90})
    ring.agent("long", "sleep 60")
    ring.roster(f"long {ring.agents_dir}/long.sh")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):
        d = ring.start_driver()
        wait_until(lambda: running_row(ring), timeout=20, message="run started")
        d.send_signal(sig)
        assert d.wait(timeout=20) == 0
    rows = ring.runs()
    assert [r["status"] for r in rows] == ["interrupted"] * 3
    st = ring.rows("SELECT * FROM agents WHERE name = 'long'")[0]
    assert st["consecutive_failures"] == 0 and st["bad_streak"] == 0 and st["quarantined_until"] is None
    doc = json.loads(ring.cli("status", "--json").stdout)
    assert doc["agents"][0]["consecutive_failures"] == 0


def test_force_fail_counts_against_the_agent(ring):
    ring.write_config(ring={"run_budget": 60, "stall_threshold": 90})
    ring.agent("long", "sleep 60")
    ring.roster(f"long {ring.agents_dir}/long.sh")
    ring.start_driver()
    wait_until(lambda: running_row(ring), timeout=20, message="run started")
    assert ring.cli("force-fail", "long").returncode == 0
    wait_until(lambda: ring.rows("SELECT * FROM agents WHERE name = 'long' AND consecutive_failures = 1"),
               timeout=10, message="force-fail counted")


def test_a_skip_stays_skipped_when_the_driver_stops_during_its_grace(ring):
    ring.write_config(ring={"run_budget": 60, "stall_threshold": 90})
    ring.agent("stubborn", "trap '' TERM\nsleep 60 &\nwait")   # ignores SIGTERM: the grace runs out
    ring.roster(f"stubborn {ring.agents_dir}/stubborn.sh")
    d = ring.start_driver()
    row = wait_until(lambda: running_row(ring), timeout=20, message="run started")
    assert ring.cli("skip", "--no-wait").returncode == 0
    wait_until(lambda: "skipped by operator" in stderr_of(d), timeout=10, message="skip begun")
    d.send_signal(signal.SIGTERM)
    assert d.wait(timeout=20) == 0
    r = ring.rows("SELECT * FROM runs WHERE id = ?", row["id"])[0]
    assert r["status"] == "skipped"
    assert [e["source"] for e in ring.rows("SELECT source FROM events WHERE run_id = ? AND kind = 'skipped'",
                                           row["id"])] == ["operator"]


def test_skip_without_a_name_is_keyed_by_the_run_it_saw(tmp_path):
    from ringd.journal import transitions
    from ringd.journal.sqlite import Journal
    j = Journal.open(tmp_path)
    with j.transaction() as tx:
        rid = tx.start_run("a", 0, now=time.time(), run_budget=1, stall_threshold=2, driver_pid=1, driver_start=1.0)
    req = transitions.request_skip(j, None, rid, time.time())
    assert req.run_id == rid and transitions.skip_requested_for(j, rid)
    with j.transaction() as tx:
        tx.close_run(rid, "ok", source="driver", now=time.time())
        rid2 = tx.start_run("b", 1, now=time.time(), run_budget=1, stall_threshold=2, driver_pid=1, driver_start=1.0)
    with pytest.raises(transitions.RunEnded, match=f"run {rid} had already ended"):
        transitions.request_skip(j, None, rid, time.time())
    assert not transitions.skip_requested_for(j, rid2)   # the next run is never hit
    assert not j.agent_state("b").skip_requested
