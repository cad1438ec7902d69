"""Shared quotas against a real driver and real agents that report through
the real clients (systemd-notify, Python's sdnotify, ``ringd notify``): use
recorded with each run and shown in status, history and metrics; bad reports
and strangers ignored; an exhausted pool with exit 75; use that survives the
driver's death; the shipped midnight-meeting example, in seconds."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import pytest

from conftest import REPO, history_json, status_json, wait_until
from test_pg_ring import hosts  # noqa: F401 - two hosts, one PostgreSQL journal

NOTIFY = f"{sys.executable} -m ringd notify"
POOL = {"model": {"limit": 100000, "window": 3600}}


def stop(ring, drv) -> str:
    if drv.poll() is None:
        drv.send_signal(signal.SIGTERM)
    assert drv.wait(timeout=20) == 0
    return drv.communicate()[1].decode()


def test_use_reported_through_each_real_client_is_kept_with_its_run(ring):
    """systemd-notify (a child of the agent's shell), sdnotify (the agent
    itself) and ``ringd notify``: each run's last report is its use, in
    history, status and the metrics; a stranger's report to the run's socket
    counts for nothing."""
    if shutil.which("systemd-notify") is None:
        pytest.skip("systemd-notify is not installed")
    sock_file, go = ring.base / "sock", ring.base / "go"
    ring.agent("sysd", "systemd-notify X_RING_USED=model:1000\nsystemd-notify X_RING_USED=model:1234")
    sdn = ring.agents_dir / "sdn.py"
    sdn.write_text("import sdnotify\nsdnotify.SystemdNotifier(debug=True).notify('X_RING_USED=model:2345')\n")
    ring.agent("cli", f"""
        echo "$NOTIFY_SOCKET" > {sock_file}.tmp && mv {sock_file}.tmp {sock_file}
        while [ ! -e {go} ]; do sleep 0.05; done
        {NOTIFY} --used model:3456 --status "spent"
        """)
    ring.write_config(quotas=POOL, agents={n: {"quota": "model"} for n in ("sysd", "sdn", "cli")},
                      ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"sysd {ring.agents_dir}/sysd.sh", f"sdn {sys.executable} {sdn}", f"cli {ring.agents_dir}/cli.sh")
    drv = ring.start_driver("--once")
    path = wait_until(lambda: sock_file.exists() and sock_file.read_text().strip(), timeout=30,
                      message="the cli agent's socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:   # this test process: a stranger
        s.sendto(b"X_RING_USED=model:99999", path)   # (queued before the agent's own: read first)
    go.write_text("")
    out, err = drv.communicate(timeout=60)
    assert drv.returncode == 0, err.decode()
    used = {r["agent"]: r["used"] for r in history_json(ring)}
    assert used == {"sysd": {"model": 1234}, "sdn": {"model": 2345}, "cli": {"model": 3456}}, used
    doc = status_json(ring)
    assert doc["quotas"] == [{"name": "model", "limit": 100000, "window": 3600.0, "used": 7035, "reserved": 0,
                              "left": 92965, "exhausted_until": None, "reset_at": doc["quotas"][0]["reset_at"],
                              "reserves": {}}]
    assert {a["name"]: a["quota"] for a in doc["agents"]} == {"sysd": "model", "sdn": "model", "cli": "model"}
    metrics = (ring.state / "metrics.prom").read_text()
    for line in ('ring_quota_used{quota="model"} 7035', 'ring_quota_limit{quota="model"} 100000',
                 'ring_quota_left{quota="model"} 92965',
                 'ring_quota_spent_total{quota="model",agent="cli"} 3456'):
        assert line in metrics, metrics
    table = ring.cli("status", env=dict(ring.env, COLUMNS="200")).stdout
    assert "quota    model  7,035 / 100,000 in 1h00m, 92,965 left" in table, table


def test_bad_reports_are_said_once_and_ignored_never_a_crash(ring):
    """Reports that do not parse, name no pool, or carry a negative or absurd
    number (1e400, -5, thousands of digits, a 10 kB datagram) change nothing
    and are said once a run each; the run, the driver and the good report go on."""
    agent = ring.agents_dir / "noisy.py"
    agent.write_text(
        "import os, socket\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
        "s.connect(os.environ['NOTIFY_SOCKET'])\n"
        "for m in ['X_RING_USED=model:-5', 'X_RING_USED=model:1e400', 'X_RING_USED=model:' + '9' * 4000,\n"
        "          'X_RING_USED=nope:5', 'X_RING_USED=nope:6', 'X_RING_EXHAUSTED=model:whenever',\n"
        "          'X_RING_USED=junk', 'X_RING_USED=model:7']:\n"
        "    s.send(m.encode())\n"
        "try:\n"
        "    s.send(b'X_RING_USED=model:' + b'9' * 10240)\n"
        "except OSError:\n"
        "    pass\n"
        "import sdnotify; sdnotify.SystemdNotifier().notify('STATUS=done')\n")
    ring.write_config(quotas=POOL, agents={"noisy": {"quota": "model"}})
    ring.roster(f"noisy {sys.executable} {agent}")
    drv = ring.start_driver()
    wait_until(lambda: len([r for r in ring.runs() if r["status"] == "ok"]) >= 2, timeout=30,
               message="two runs done")
    assert status_json(ring)["driver"]["health"] == "ok"
    log = stop(ring, drv)
    runs = history_json(ring)
    assert all(r["used"] == {"model": 7} for r in runs if r["status"] == "ok"), runs
    first = [line for line in log.splitlines() if "run 1: noisy sent a quota report that is ignored" in line]
    assert len(first) == 3, log        # a bad number, an unknown pool, one that does not parse: once each
    assert all(len(line) < 300 for line in first) and "999999999999" not in log


def test_an_exhausted_report_with_exit_75_waits_for_the_pool_then_retries_without_a_back_off(ring):
    """``ringd notify --exhausted model --until 3`` then exit 75: the run is
    deferred, status shows the pool exhausted, every agent of the pool waits
    the 3 s while one of no pool runs, and the agent is retried once the pool
    reopens - not after its 60 s back-off."""
    marks = ring.base / "marks"
    ring.agent("limited", f"""
        echo "$RING_RUN_ID $(date +%s.%N)" >> {marks}
        if [ "$RING_RUN_ID" = 1 ]; then {NOTIFY} --exhausted model --until 3; exit 75; fi
        {NOTIFY} --used model:10
        """)
    ring.agent("other", f"{NOTIFY} --used model:1")
    ring.agent("free", "sleep 0.2")
    ring.write_config(quotas=POOL, agents={"limited": {"quota": "model"}, "other": {"quota": "model"}},
                      ring={"backoff_initial": 60, "backoff_max": 120})
    ring.roster(f"limited {ring.agents_dir}/limited.sh", f"other {ring.agents_dir}/other.sh",
                f"free {ring.agents_dir}/free.sh")
    drv = ring.start_driver()
    doc = wait_until(lambda: (d := status_json(ring))["quotas"][0]["exhausted_until"] and d, timeout=30,
                     message="the pool exhausted in status")
    assert "EXHAUSTED until" in ring.cli("status").stdout
    rows = wait_until(lambda: (rs := [r for r in ring.runs() if r["agent"] == "limited"])[1:] and rs
                      and rs[1]["status"] == "ok" and rs, timeout=30, message="limited retried")
    log = stop(ring, drv)
    first, second = rows[0], rows[1]
    assert first["status"] == "deferred"
    assert 2.5 <= second["started_at"] - first["ended_at"] < 12, (first["ended_at"], second["started_at"])
    pooled = [r for r in ring.runs() if r["agent"] == "other"]
    assert not [r for r in pooled if first["ended_at"] < r["started_at"] < first["ended_at"] + 2.5]
    assert [r for r in ring.runs() if r["agent"] == "free" and first["ended_at"] < r["started_at"]
            < second["started_at"]]                                  # no pool: it went on meanwhile
    assert doc["agents"][0]["backoff_until"] is None
    assert "run 1: limited reports quota model exhausted for 3s" in log, log


def test_use_recorded_while_the_run_goes_survives_the_drivers_death(ring):
    """An agent reports 500 and keeps running; the driver is SIGKILLed: the
    reaper closes the run, and the use is in the journal with it - the next
    driver's agents are told 500 less."""
    seen = ring.base / "left"
    ring.agent("spender", f"""
        if [ "$RING_RUN_ID" = 1 ]; then {NOTIFY} --used model:500; exec sleep 60; fi
        echo "$RING_QUOTA_LEFT" > {seen}
        """)
    ring.write_config(quotas={"model": {"limit": 1000, "window": 3600}}, agents={"spender": {"quota": "model"}},
                      ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"spender {ring.agents_dir}/spender.sh")
    drv = ring.start_driver()
    wait_until(lambda: [tuple(r) for r in ring.rows("SELECT units FROM quota_use WHERE run_id = 1")] == [(500,)],
               timeout=30, message="the use recorded while the run goes")
    drv.kill()
    drv.wait(timeout=10)
    runs = history_json(ring)   # (reaps first)
    assert runs[0]["status"] == "interrupted" and runs[0]["used"] == {"model": 500}
    drv = ring.start_driver()
    left = wait_until(lambda: seen.exists() and seen.read_text().strip(), timeout=30, message="run 2's env")
    stop(ring, drv)
    assert left == "500"


def test_the_midnight_example_keeps_the_meetings_reserve_while_the_others_wait(ring, tmp_path):
    """examples/midnight/quick.yaml, as shipped: 100 units per 6 s, 40 kept
    for a meeting due every 8 s, ordinary runs of 30. Every meeting run gets
    its 40; the ordinary agents are held (no rows) and the driver waits for the
    window's reset; no window ever holds more than the limit."""
    example = tmp_path / "midnight"
    shutil.copytree(REPO / "examples" / "midnight", example)
    for p in (example / "quick.yaml", example / "ring.yaml", example / "ring.txt"):
        p.chmod(0o600)
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "ringd").write_text(f"#!/bin/sh\nexec {sys.executable} -m ringd \"$@\"\n")
    (shim / "ringd").chmod(0o755)
    env = dict(ring.env, PATH=f"{shim}{os.pathsep}{ring.env.get('PATH', '')}")
    check = ring.start(["ringd", "check", "--config", str(example / "ring.yaml"), "--state", str(ring.state)],
                       env=env)
    assert check.wait(timeout=30) == 0, check.communicate()[1]
    drv = ring.start(["ringd", "run", "--config", str(example / "quick.yaml"), "--state", str(ring.state)],
                     env=env)
    wait_until(lambda: len([r for r in ring.runs() if r["agent"] == "meeting" and r["status"] == "ok"]) >= 3,
               timeout=60, message="three meetings")
    drv.send_signal(signal.SIGTERM)
    assert drv.wait(timeout=20) == 0
    log = drv.communicate()[1].decode()
    runs = [dict(r) for r in ring.runs()]
    logs = {r["id"]: Path(r["log_path"]).read_text() for r in runs if r["log_path"]}
    meetings = [logs[r["id"]] for r in runs if r["agent"] == "meeting"]
    assert meetings and all("spending 40 of 40" in text for text in meetings), meetings
    assert "its agents wait until" in log and "quota model: open again" in log, log
    assert "nothing to run" in log
    spends = [tuple(r) for r in ring.rows("SELECT at, units FROM quota_use")]
    for t, _ in spends:   # each use at the time it was reported: never more than the limit in a window
        assert sum(u for at, u in spends if t - 6 < at <= t) <= 100, spends
    ordinary = sorted(r["started_at"] for r in runs if r["agent"] != "meeting")
    assert max(b - a for a, b in zip(ordinary, ordinary[1:])) > 2.5   # they waited for the reset


def test_a_standby_that_takes_over_knows_what_the_dead_leaders_agents_spent(hosts):
    """Two hosts, one PostgreSQL journal: host A's agent reports 600 of 1000
    and A's box dies (driver and agent SIGKILLed). B takes the lease, and the
    next run it starts is told 400 left."""
    from test_pg_ring import agent_pid, pg_rows, role, roster_both
    a, b, dsn, sampler = hosts
    left, once = a.base / "left", a.base / "spent-once"
    a.agent("spender", f"""
        if [ ! -e {once} ]; then touch {once}; {NOTIFY} --used model:600; exec sleep 60; fi
        echo "$RING_QUOTA_LEFT" > {left}
        exec sleep 60
        """)
    for r in (a, b):
        r.write_config(quotas={"model": {"limit": 1000, "window": 3600}}, agents={"spender": {"quota": "model"}})
    roster_both(a, b, f"spender {a.agents_dir}/spender.sh")
    da = a.start_driver()
    wait_until(lambda: role(a) == "leader" and pg_rows(dsn, "SELECT units FROM quota_use") == [{"units": 600}],
               timeout=30, message="A leads, its agent's use recorded")
    b.start_driver()
    wait_until(lambda: role(b) == "standby", timeout=15, message="B stands by")
    pid = wait_until(lambda: agent_pid(dsn), timeout=10, message="the agent's pid")
    os.kill(da.pid, signal.SIGKILL)
    os.killpg(pid, signal.SIGKILL)
    assert wait_until(lambda: left.exists() and left.read_text().strip(), timeout=30,
                      message="B's run told what is left") == "400"
    assert role(b) == "leader"
    doc = json.loads(b.cli("status", "--json").stdout)   # read from PostgreSQL, as history is
    assert doc["quotas"][0]["used"] == 600 and doc["quotas"][0]["left"] == 400, doc["quotas"]
    assert json.loads(b.cli("history", "--json").stdout)[-1]["used"] == {"model": 600}
    sampler.finish()


def test_status_name_shows_the_agents_pool_used_limit_reserve_and_when_it_refills(ring):
    """``ringd status NAME`` of an agent in a pool: a ``quota`` line (and
    ``quota`` in its JSON) with the pool's use over its limit, the reserve
    kept for the scheduled meeting, what this agent may spend, and when the
    pool refills - the oldest use leaving the window, or an exhausted pool
    reopening."""
    ring.agent("worker", f"{NOTIFY} --used model:300")
    ring.agent("limited", f"{NOTIFY} --exhausted model --until 600; exit 75")
    ring.agent("meeting", "exit 0")
    ring.agent("free", "exit 0")
    ring.write_config(quotas={"model": {"limit": 1000, "window": "2d", "reserve": {"meeting": 200}}},
                      agents={"worker": {"quota": "model"}, "limited": {"quota": "model"},
                              "meeting": {"quota": "model", "schedule": "0 0 * * *"}},
                      ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"worker {ring.agents_dir}/worker.sh", f"free {ring.agents_dir}/free.sh",
                f"meeting {ring.agents_dir}/meeting.sh")
    drv = ring.start_driver("--once")
    assert drv.wait(timeout=60) == 0, drv.communicate()[1].decode()

    def agent_json(name):
        r = ring.cli("status", name, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)
    q = agent_json("worker")["quota"]
    reset = q.pop("reset_at")
    assert q == {"name": "model", "limit": 1000, "window": 172800.0, "used": 300, "reserved": 200, "left": 500,
                 "exhausted_until": None, "reserves": {"meeting": 200}, "left_for_agent": 500, "held": None}, q
    assert reset is not None
    assert agent_json("meeting")["quota"]["left_for_agent"] == 700   # its own reserve is its to spend
    assert agent_json("free")["quota"] is None
    wide = dict(ring.env, COLUMNS="200")
    text = ring.cli("status", "worker", env=wide).stdout
    line = next((ln for ln in text.splitlines() if ln.startswith("quota")), None)
    assert line is not None, text
    assert "model  300 / 1,000 in 2d" in line and "200 reserved for meeting" in line, line
    assert "500 left for worker" in line and "; oldest use leaves in 47h" in line, line
    assert "quota" not in "\n".join(ln for ln in ring.cli("status", "free", env=wide).stdout.splitlines()
                                    if ln.startswith("quota"))

    # an exhausted pool: the line says until when it is refused, and the agent waits
    ring.roster(f"limited {ring.agents_dir}/limited.sh", f"worker {ring.agents_dir}/worker.sh",
                f"meeting {ring.agents_dir}/meeting.sh")
    drv = ring.start_driver()
    doc = wait_until(lambda: (d := agent_json("worker"))["quota"]["exhausted_until"] and d, timeout=30,
                     message="the pool exhausted in status worker")
    stop(ring, drv)
    assert doc["quota"]["held"] == "quota model exhausted (reported)"
    text = ring.cli("status", "worker", env=wide).stdout
    line = next(ln for ln in text.splitlines() if ln.startswith("quota"))
    assert "EXHAUSTED until" in line and "left)" in line, line
