"""The operator CLI against a real driver and real agents: status, skip, history,
logs, force-fail, resume; exit codes; SPEC JSON shapes; plain output; bad input."""
from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import datetime

import psutil
import pytest

from conftest import line_written, read_until, ring_cmd, wait_until

STATUS_KEYS = {"state_dir", "driver", "watcher", "current", "roster", "agents", "quotas"}
DRIVER_KEYS = {"pid", "health", "heartbeat_age", "started_at", "lap"}
WATCHER_KEYS = {"pid", "alive", "last_poll_at", "restarts", "gave_up"}
CURRENT_KEYS = {"agent", "run_id", "pid", "elapsed", "run_budget", "stall_threshold"}
ROSTER_KEYS = {"path", "agents", "error"}
AGENT_KEYS = {"name", "position", "last_status", "last_started_at", "last_duration", "last_exit_code",
              "runs", "consecutive_failures", "backoff_until", "skip_requested", "quarantined_until",
              "quota"}
HISTORY_KEYS = {"id", "agent", "status", "started_at", "ended_at", "duration", "exit_code", "signal", "reason",
                "phase", "cpu_seconds", "used", "actor"}
STATUSES = {"running", "ok", "failed", "deferred", "timeout", "stalled", "skipped", "interrupted", "error"}


def is_iso_utc(value) -> bool:
    if not isinstance(value, str):
        return False
    t = datetime.fromisoformat(value)
    return t.utcoffset() is not None and t.utcoffset().total_seconds() == 0


def num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_status_shape(doc: dict) -> None:
    """Key by key against SPEC (extra keys are allowed: the contract grows by adding)."""
    assert STATUS_KEYS <= set(doc)
    assert isinstance(doc["state_dir"], str)
    d = doc["driver"]
    assert DRIVER_KEYS <= set(d)
    assert d["health"] in ("ok", "stale", "dead", "stopped")
    assert d["pid"] is None or isinstance(d["pid"], int)
    assert d["heartbeat_age"] is None or num(d["heartbeat_age"])
    assert d["started_at"] is None or is_iso_utc(d["started_at"])
    assert d["lap"] is None or isinstance(d["lap"], int)
    w = doc["watcher"]
    assert WATCHER_KEYS <= set(w)
    assert w["pid"] is None or isinstance(w["pid"], int)
    assert isinstance(w["alive"], bool) and isinstance(w["gave_up"], bool)
    assert isinstance(w["restarts"], int)
    assert w["last_poll_at"] is None or is_iso_utc(w["last_poll_at"])
    c = doc["current"]
    if c is not None:
        assert CURRENT_KEYS <= set(c)
        assert isinstance(c["agent"], str) and isinstance(c["run_id"], int)
        assert c["pid"] is None or isinstance(c["pid"], int)
        assert num(c["elapsed"]) and num(c["run_budget"]) and num(c["stall_threshold"])
    r = doc["roster"]
    assert ROSTER_KEYS <= set(r)
    assert isinstance(r["path"], str) and isinstance(r["agents"], int)
    assert r["error"] is None or isinstance(r["error"], str)
    assert isinstance(doc["agents"], list) and len(doc["agents"]) == r["agents"]
    for i, a in enumerate(doc["agents"]):
        assert AGENT_KEYS <= set(a)
        assert a["position"] == i and isinstance(a["name"], str)
        assert a["last_status"] is None or a["last_status"] in STATUSES
        for k in ("last_started_at", "backoff_until", "quarantined_until"):
            assert a[k] is None or is_iso_utc(a[k]), k
        assert a["last_duration"] is None or num(a["last_duration"])
        assert a["last_exit_code"] is None or isinstance(a["last_exit_code"], int)
        assert isinstance(a["runs"], int) and isinstance(a["consecutive_failures"], int)
        assert isinstance(a["skip_requested"], bool)


def status_json(ring, env=None):
    res = ring.cli("status", "--json", env=env)
    assert res.stdout.strip(), res.stderr
    doc = json.loads(res.stdout)  # stdout is the JSON and nothing else
    check_status_shape(doc)
    return doc, res.returncode


def one_error_line(res) -> str:
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("ringd: ")
    return lines[0]


def running_of(ring, agent):
    rows = ring.rows("SELECT * FROM runs WHERE status = 'running' AND agent = ?", agent)
    return rows[0] if rows else None


def events_of(ring, run_id):
    return ring.rows("SELECT * FROM events WHERE run_id = ? ORDER BY id", run_id)


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# --- status --------------------------------------------------------------------------

def test_status_never_ran_and_missing_state_dir(ring):
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    before = sorted(os.listdir(ring.state))
    doc, code = status_json(ring)
    assert code == 3
    assert doc["driver"]["health"] == "stopped" and doc["driver"]["pid"] is None
    assert doc["current"] is None and doc["agents"][0]["last_status"] is None
    res = ring.cli("status")  # table, plain (not a TTY)
    assert res.returncode == 3 and "\x1b" not in res.stdout and "a" in res.stdout
    hist = ring.cli("history", "--json")
    assert hist.returncode == 0 and json.loads(hist.stdout) == []
    assert sorted(os.listdir(ring.state)) == before, "a reading command created files"

    missing = ring.base / "no-such-state"
    for args in (("status", "--json"), ("status",), ("history",), ("logs", "a"), ("skip", "a"),
                 ("force-fail",), ("resume", "a")):
        argv = ring_cmd(args[0], "--state", str(missing), "--config", str(ring.config_path), *args[1:])
        res = subprocess.run(argv, env=ring.env, capture_output=True, text=True, timeout=30)
        line = one_error_line(res)
        assert "no such state directory" in line
        assert res.stdout == ""
        if args[0] == "status":
            assert res.returncode == 4
    assert not missing.exists()


def test_status_ok_then_stale_then_stopped_plain_never_cut(ring):
    ring.agent("slow", "echo started; exec sleep 30")
    ring.agent("b", "exit 0")
    ring.write_config(ring={"run_budget": 20, "stall_threshold": 25})
    ring.roster(f"slow {ring.agents_dir}/slow.sh", f"b {ring.agents_dir}/b.sh")
    driver = ring.start_driver()
    wait_until(lambda: running_of(ring, "slow"), message="slow running")
    wait_until(lambda: (ring.heartbeat() or {}).get("agent") == "slow", message="heartbeat names slow")

    doc, code = status_json(ring)
    assert code == 0, doc
    assert doc["driver"]["health"] == "ok" and doc["driver"]["pid"] == driver.pid
    assert doc["driver"]["lap"] == 1 and doc["driver"]["heartbeat_age"] < 1.0
    cur = doc["current"]
    assert cur["agent"] == "slow" and cur["run_budget"] == 20 and cur["stall_threshold"] == 25
    assert cur["pid"] and pid_alive(cur["pid"]) and 0 <= cur["elapsed"] < 20
    assert doc["agents"][0]["last_status"] == "running" and doc["agents"][1]["last_status"] is None
    assert doc["watcher"] == {"pid": None, "alive": False, "last_poll_at": None, "restarts": 0, "gave_up": False}
    assert doc["roster"]["agents"] == 2 and doc["roster"]["error"] is None

    env = dict(ring.env, NO_COLOR="1", COLUMNS="80")
    table = ring.cli("status", env=env)
    assert table.returncode == 0, table.stderr
    assert "\x1b" not in table.stdout
    # piped: never cut to 80 columns, even with COLUMNS=80 (the long state path is whole)
    assert f"{ring.roster_path}  (2 agents)" in table.stdout and "\u2026" not in table.stdout
    assert "slow" in table.stdout and "running" in table.stdout and "% of" in table.stdout

    # A hung driver: heartbeat older than 2 x heartbeat_interval (0.2 s) -> stale, exit 1.
    os.kill(driver.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: time.time() - ring.heartbeat()["at_epoch"] > 0.6, timeout=5,
                   message="heartbeat older than 2 x heartbeat_interval")
        doc, code = status_json(ring)
        assert code == 1 and doc["driver"]["health"] == "stale"
        table = ring.cli("status", env=env)
        assert table.returncode == 1
        assert "likely stuck: heartbeat" in table.stdout and "s old" in table.stdout
        assert "\x1b" not in table.stdout
    finally:
        os.kill(driver.pid, signal.SIGCONT)
    wait_until(lambda: status_json(ring)[1] == 0, message="healthy again")

    # A clean stop: stopped, exit 3; the run was closed by the driver itself.
    driver.send_signal(signal.SIGTERM)
    driver.wait(timeout=10)
    doc, code = status_json(ring)
    assert code == 3 and doc["driver"]["health"] == "stopped" and doc["current"] is None
    assert doc["agents"][0]["last_status"] == "interrupted"


def test_status_of_sigkilled_driver_is_dead_and_reaps(ring):
    ring.agent("slow", "sleep 30 & wait")
    ring.write_config(ring={"run_budget": 20, "stall_threshold": 25},
                      alerts={"command": ["sh", "-c", 'cat > "$RING_STATE/alert-$RING_EVENT.json"']})
    ring.roster(f"slow {ring.agents_dir}/slow.sh")
    driver = ring.start_driver()
    row = wait_until(lambda: running_of(ring, "slow"), message="slow running")
    wait_until(lambda: ring.rows("SELECT pid FROM runs WHERE id = ? AND pid IS NOT NULL", row["id"]))
    agent_pid = ring.rows("SELECT pid FROM runs WHERE id = ?", row["id"])[0]["pid"]
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=10)
    assert pid_alive(agent_pid)  # the orphan is still there until someone reaps

    doc, code = status_json(ring)
    assert code == 1 and doc["driver"]["health"] == "dead" and doc["driver"]["pid"] is None
    assert doc["current"] is None, "status must reap before it counts"
    assert doc["agents"][0]["last_status"] == "interrupted"
    final = ring.rows("SELECT * FROM runs WHERE id = ?", row["id"])[0]
    assert final["status"] == "interrupted"
    assert [e["source"] for e in events_of(ring, row["id"])][-1] == "reaper"
    wait_until(lambda: not pid_alive(agent_pid), timeout=5, message="orphan killed")
    alert = ring.state / "alert-run-reaped.json"
    wait_until(lambda: alert.exists() and alert.read_text().strip(), timeout=5, message="run-reaped alert")
    assert json.loads(alert.read_text())["agent"] == "slow"
    table = ring.cli("status", env=dict(ring.env, NO_COLOR="1"))
    assert table.returncode == 1 and "DEAD" in table.stdout and "interrupted" in table.stdout


def test_status_json_does_not_import_rich(ring):
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    argv = [sys.executable, "-X", "importtime", "-m", "ringd", "status", *ring.common(), "--json"]
    res = subprocess.run(argv, env=ring.env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 3
    imported = [line.split("|")[-1].strip() for line in res.stderr.splitlines() if "|" in line]
    assert "ringd.cli.status" in imported
    assert not [m for m in imported if m == "rich" or m.startswith("rich.")]
    # plain table output does not need rich either
    argv = [sys.executable, "-X", "importtime", "-m", "ringd", "status", *ring.common()]
    res = subprocess.run(argv, env=ring.env, capture_output=True, text=True, timeout=30)
    assert not [line for line in res.stderr.splitlines() if line.split("|")[-1].strip() == "rich"]


def run_on_tty(argv, env, timeout=30):
    """Run with stdout on a pseudo-terminal; returns (exit code, bytes written)."""
    import pty
    import select
    master, slave = pty.openpty()
    p = None
    try:
        p = subprocess.Popen(argv, stdout=slave, stderr=subprocess.PIPE, env=env, start_new_session=True)
        os.close(slave)
        out = b""
        deadline = time.monotonic() + timeout
        # bounded: a bare read blocks for as long as the child keeps the terminal open
        while (left := deadline - time.monotonic()) > 0 and select.select([master], [], [], left)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            out += chunk
        return p.wait(timeout=max(deadline - time.monotonic(), 1)), out
    finally:
        os.close(master)
        if p is not None:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
            p.stderr.close()


def test_status_on_a_terminal_colours_unless_no_color(ring):
    ring.agent("a", "exit 3")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.start_driver("--once").wait(timeout=20)
    argv = ring_cmd("status", *ring.common())
    env = dict(ring.env, COLUMNS="80", TERM="xterm-256color")
    env.pop("NO_COLOR", None)
    code, out = run_on_tty(argv, env)
    assert code == 3 and b"\x1b[" in out and b"failed" in out
    code, out = run_on_tty(argv, dict(env, NO_COLOR="1"))
    assert code == 3 and b"\x1b" not in out and b"failed" in out


def test_tables_into_a_pipe_or_file_never_cut_a_column_only_a_terminal_is_fitted(ring):
    """``history`` and ``status`` into a pipe or a file show every agent's name
    and reason whole, whatever COLUMNS says; on a terminal of 80 columns the same
    tables are fitted to it (the name cut with an ellipsis)."""
    name = "agent-with-a-rather-long-name-of-forty-x"
    ring.agent("a", "exit 3")
    ring.roster(f"{name} {ring.agents_dir}/a.sh")
    ring.start_driver("--once").wait(timeout=20)
    env = dict(ring.env, COLUMNS="80", NO_COLOR="1")
    for args in (("history",), ("status",)):
        piped = ring.cli(*args, env=env)
        assert piped.returncode in (0, 3) and name in piped.stdout, (args, piped.stdout)
        assert "..." not in piped.stdout and "\u2026" not in piped.stdout, (args, piped.stdout)
        out = ring.base / "table.txt"
        with open(out, "w") as f:
            subprocess.run(ring_cmd(args[0], *ring.common()), env=env, stdout=f, timeout=30)
        assert name in out.read_text(), (args, out.read_text())
        code, shown = run_on_tty(ring_cmd(args[0], *ring.common()), env)
        assert re.search(rb"agent-with-a-[a-z-]*\.\.\.  ", shown), (args, shown)   # the column, fitted


# --- skip -------------------------------------------------------------------------------

def test_skip_current_run_lands_within_a_second(ring):
    # The agent leaves a grandchild in its own session: skip must end the whole tree.
    ring.agent("slow", """
        setsid sleep 30 &
        echo $! > "$RING_STATE/slow-child.pid"
        exec sleep 30
    """)
    ring.agent("next", "exec sleep 30")
    ring.write_config(ring={"run_budget": 20, "stall_threshold": 25})
    ring.roster(f"slow {ring.agents_dir}/slow.sh", f"next {ring.agents_dir}/next.sh")
    ring.start_driver()
    row = wait_until(lambda: running_of(ring, "slow"), message="slow running")
    child_file = ring.state / "slow-child.pid"
    child = int(line_written(child_file, message="grandchild pid"))
    assert pid_alive(child)

    t0 = time.monotonic()
    res = ring.cli("skip")
    t_cli = time.monotonic() - t0
    wait_until(lambda: running_of(ring, "next"), timeout=30, message="next agent started")
    t_next = time.monotonic() - t0
    final = ring.rows("SELECT * FROM runs WHERE id = ?", row["id"])[0]
    print(f"\nskip: driver closed the run {res.stdout.strip()!r}; CLI round trip {t_cli:.3f}s "
          f"(incl. interpreter start), next agent running {t_next:.3f}s after the command started")
    assert res.returncode == 0, res.stderr
    assert final["status"] == "skipped"
    assert [e["source"] for e in events_of(ring, row["id"])][-1] == "operator"
    assert final["ended_at"] - final["started_at"] >= 0
    asked = [e["at"] for e in events_of(ring, row["id"]) if e["kind"] == "skip-requested"][0]
    assert final["ended_at"] - asked < 1.0, res.stdout  # the driver acted within 1 s of the request
    assert t_next < 10.0                # two interpreter starts on a loaded 2-core box (a budget: 20 s)
    wait_until(lambda: not pid_alive(child), timeout=10, message="escaped grandchild killed")
    # the request was used up: slow's next turn is not skipped again
    state = ring.rows("SELECT skip_requested FROM agents WHERE name = 'slow'")[0]
    assert state["skip_requested"] == 0


def test_skip_other_agent_unknown_and_nothing_running(ring):
    # a holds its turn while the test's gate file exists, so `ringd skip b` lands
    # while it runs however slow the box is (bounded by its budget)
    hold, held = ring.base / "hold-a", ring.base / "held-a"
    ring.agent("a", f"""
        if [ -e {hold} ]; then
            echo "$RING_RUN_ID" > {held}.tmp && mv {held}.tmp {held}
            while [ -e {hold} ]; do sleep 0.02; done
        fi
    """)
    ring.write_config(ring={"run_budget": 10, "stall_threshold": 15})
    ring.agent("b", "echo b ran")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")

    res = ring.cli("skip")
    assert res.returncode == 1 and "nothing is running" in one_error_line(res)
    res = ring.cli("skip", "nosuch")
    line = one_error_line(res)
    assert res.returncode == 2 and "unknown agent 'nosuch'" in line and "a, b" in line
    res = ring.cli("skip", "x" * 100_000)
    assert res.returncode == 2 and len(one_error_line(res)) < 1000

    # No driver running: the request waits for the next driver.
    res = ring.cli("skip", "b")
    assert res.returncode == 0 and "no driver is running" in res.stdout
    assert ring.cli("status", "--json").returncode == 3
    assert json.loads(ring.cli("status", "--json").stdout)["agents"][1]["skip_requested"] is True
    ring.start_driver()
    row = wait_until(lambda: ring.rows("SELECT * FROM runs WHERE agent = 'b'"), message="b's turn")[0]
    assert row["status"] == "skipped" and row["pid"] is None and "operator" in row["reason"]
    # b's following turn runs normally
    wait_until(lambda: ring.rows("SELECT * FROM runs WHERE agent = 'b' AND status = 'ok'"),
               message="b ran on the next lap")

    # Another agent while one runs: its next turn is skipped, the current run goes on.
    hold.touch()
    # the run that saw the gate says so itself: no race with a run that started just before
    held_id = int(wait_until(lambda: held.exists() and held.read_text().strip(), message="a holding"))
    cur = ring.rows("SELECT * FROM runs WHERE id = ?", held_id)[0]
    assert cur["status"] == "running"
    res = ring.cli("skip", "b")
    hold.unlink()
    assert res.returncode == 0 and "next turn will be skipped" in res.stdout
    wait_until(lambda: ring.rows("SELECT * FROM runs WHERE agent = 'b' AND id > ? AND status != 'running'",
                                 cur["id"]), message="b's next turn")
    assert ring.rows("SELECT status FROM runs WHERE id = ?", cur["id"])[0]["status"] == "ok"
    nxt = ring.rows("SELECT * FROM runs WHERE agent = 'b' AND id > ?", cur["id"])[0]
    assert nxt["status"] == "skipped" and nxt["pid"] is None


def test_skip_naming_the_running_agent_ends_its_run(ring):
    """docs/failures.md: a named skip that reaches its agent while it
    runs ends that run (``skipped``, source ``operator``); its next turn runs."""
    ring.agent("a", "[ -e \"$RING_STATE/a-ran\" ] && exit 0\ntouch \"$RING_STATE/a-ran\"\nexec sleep 30")
    ring.agent("b", "exec sleep 30")
    ring.write_config(ring={"run_budget": 20, "stall_threshold": 25})
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")
    ring.start_driver()
    row = wait_until(lambda: running_of(ring, "a"), message="a running")
    res = ring.cli("skip", "a")
    assert res.returncode == 0, res.stderr
    assert f"run {row['id']} skipped after " in res.stdout, res.stdout
    final = ring.rows("SELECT * FROM runs WHERE id = ?", row["id"])[0]
    assert final["status"] == "skipped"
    assert [e["source"] for e in events_of(ring, row["id"])][-1] == "operator"
    wait_until(lambda: running_of(ring, "b"), timeout=5, message="the ring moved on")
    assert ring.rows("SELECT skip_requested FROM agents WHERE name = 'a'")[0]["skip_requested"] == 0


def test_a_reader_that_goes_away_ends_a_command_quietly_and_status_says_unknown(ring):
    """``ringd history | head``: a closed pipe ends the command without a word.
    ``status`` then exits 4 ("unknown", like any output it cannot write), never
    1, which says "dead or stale" of a ring it could not report."""
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    assert ring.cli("run", "--once").returncode == 0
    for args, code in ((("history",), 1), (("history", "--json"), 1), (("status",), 4), (("status", "--json"), 4)):
        r, w = os.pipe()
        os.close(r)                     # the reader is gone before anything is written
        try:
            res = subprocess.run(ring_cmd(args[0], *ring.common(), *args[1:]), env=ring.env, stdout=w,
                                 stderr=subprocess.PIPE, text=True, timeout=30)
        finally:
            os.close(w)
        assert (res.returncode, res.stderr) == (code, ""), (args, res.returncode, res.stderr)


# --- history and logs -----------------------------------------------------------------------

def test_history_and_logs(ring):
    ring.agent("talk", """
        echo "first line of $RING_RUN_ID"
        sleep 0.5
        echo "second line"
        sleep 0.5
        echo "last line"
    """)
    ring.agent("bad", "echo oops >&2; exit 3")
    ring.roster(f"talk {ring.agents_dir}/talk.sh", f"bad {ring.agents_dir}/bad.sh")
    ring.write_config(ring={"keep_logs": 1000})   # the ring goes on: a slow box must not prune run 1's log
    ring.start_driver()
    row = wait_until(lambda: running_of(ring, "talk"), message="talk running")

    # --run ID -f follows that run's log until it ends, then exits by itself
    # (NAME -f goes on with later runs: tests/system/test_follow.py)
    t0 = time.monotonic()
    res = ring.cli("logs", "talk", "--run", str(row["id"]), "-f", timeout=15)
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [f"first line of {row['id']}", "second line", "last line"]
    assert took >= 0.3  # it really waited for the run
    assert ring.rows("SELECT status FROM runs WHERE id = ?", row["id"])[0]["status"] == "ok"

    wait_until(lambda: len(ring.rows("SELECT * FROM runs WHERE status != 'running'")) >= 4,
               message="two laps")
    res = ring.cli("history", "--json", "--limit", "3")
    assert res.returncode == 0, res.stderr
    runs = json.loads(res.stdout)
    assert len(runs) == 3
    for r in runs:
        assert set(r) == HISTORY_KEYS
        assert r["status"] in STATUSES and is_iso_utc(r["started_at"])
        assert r["ended_at"] is None or is_iso_utc(r["ended_at"])
    assert [r["id"] for r in runs] == sorted((r["id"] for r in runs), reverse=True)
    bad = [r for r in json.loads(ring.cli("history", "bad", "--json").stdout)
           if r["status"] != "running"]   # the ring goes on: bad may be in flight right now
    assert bad and all(r["agent"] == "bad" and r["status"] == "failed" and r["exit_code"] == 3 for r in bad)

    table = ring.cli("history", env=dict(ring.env, NO_COLOR="1"))
    assert table.returncode == 0 and "\x1b" not in table.stdout and "failed" in table.stdout
    assert "..." not in table.stdout   # piped: reasons are never cut

    # bad's last run has ended while talk runs: its log is whole. (On a loaded box the
    # CLI can take longer than talk's second, and bad's next run may have just begun:
    # its log is then rightly still empty, so ask until a moment when bad is not running.)
    def bad_log_when_bad_is_not_running():
        before = running_of(ring, "talk")
        if before is None:
            return None
        res = ring.cli("logs", "bad")
        after = running_of(ring, "talk")   # the same talk run all along: bad did not run meanwhile
        return res if after is not None and after["id"] == before["id"] else None
    res = wait_until(bad_log_when_bad_is_not_running, timeout=30, message="bad's log read while talk runs")
    assert res.returncode == 0 and res.stdout == "oops\n"
    res = ring.cli("logs", "talk", "--run", str(row["id"]))
    assert res.returncode == 0 and res.stdout.startswith(f"first line of {row['id']}")
    res = ring.cli("logs", "bad", "--run", str(row["id"]))  # a run of another agent
    assert res.returncode == 2 and "no run" in one_error_line(res)
    res = ring.cli("logs", "ghost")
    assert res.returncode == 2 and "unknown agent" in one_error_line(res)
    res = ring.cli("history", "ghost")
    assert res.returncode == 2 and "known agents: talk, bad" in one_error_line(res)
    for bad_limit in ("-1", "0", "many"):
        res = ring.cli("history", "--limit", bad_limit)
        assert res.returncode == 2 and "--limit" in one_error_line(res)


# --- force-fail and resume -----------------------------------------------------------------

def test_logs_name_right_after_a_skip_shows_the_newest_run_that_has_a_log(ring):
    """``ringd logs NAME`` right after NAME's turn was skipped failed with "run
    2 of a (skipped) has no log". It shows the newest run of NAME that has a
    log and names, in one stderr line, the newer runs that had none."""
    ring.agent("a", 'echo "run $RING_RUN_ID said this"')
    ring.roster(f"a {ring.agents_dir}/a.sh")
    assert ring.start_driver("--once").wait(timeout=20) == 0
    for _ in range(2):
        res = ring.cli("skip", "a")
        assert res.returncode == 0, res.stderr
        assert ring.start_driver("--once").wait(timeout=20) == 0
    assert [r["status"] for r in ring.runs()] == ["ok", "skipped", "skipped"]
    res = ring.cli("logs", "a")
    assert res.returncode == 0 and res.stdout == "run 1 said this\n", (res.stdout, res.stderr)
    assert res.stderr == "ringd: showing run 1 of a; newer runs had no log: 3 (skipped), 2 (skipped)\n"
    res = ring.cli("logs", "a", "--run", "3")   # asked for by id: that run, which has none
    assert res.returncode == 1 and "has no log" in one_error_line(res)
    res = ring.cli("logs", "a", "-n", "1")
    assert res.returncode == 0 and res.stdout == "run 1 said this\n" and "newer runs had no log" in res.stderr


def test_force_fail_closes_and_kills_then_nothing_running(ring):
    ring.agent("stuck", """
        setsid sleep 30 &
        exec sleep 30
    """)
    ring.agent("after", "exec sleep 30")
    ring.write_config(ring={"run_budget": 20, "stall_threshold": 25})
    ring.roster(f"stuck {ring.agents_dir}/stuck.sh", f"after {ring.agents_dir}/after.sh")
    ring.start_driver()
    row = wait_until(lambda: running_of(ring, "stuck"), message="stuck running")
    wait_until(lambda: ring.rows("SELECT pid FROM runs WHERE id = ? AND pid IS NOT NULL", row["id"]))
    pid = ring.rows("SELECT pid FROM runs WHERE id = ?", row["id"])[0]["pid"]

    res = ring.cli("force-fail", "--run", str(row["id"] + 100))
    assert res.returncode == 1 and "not running" in one_error_line(res)
    res = ring.cli("force-fail", "after")   # another agent's: never this run
    assert res.returncode == 1 and "not running" in one_error_line(res)
    res = ring.cli("force-fail", "stuck", "--reason", "wedged on a lock\n" + "z" * 5000)
    assert res.returncode == 0, res.stderr
    assert f"run {row['id']} of stuck closed as interrupted" in res.stdout
    final = ring.rows("SELECT * FROM runs WHERE id = ?", row["id"])[0]
    assert final["status"] == "interrupted" and final["reason"].startswith("forced by operator: wedged on a lock z")
    assert len(final["reason"]) <= 520
    assert [e["source"] for e in events_of(ring, row["id"])][-1] == "operator"
    wait_until(lambda: not pid_alive(pid), timeout=3, message="agent killed")
    # The driver notices its agent died, leaves the operator's verdict alone and moves on.
    nxt = wait_until(lambda: running_of(ring, "after"), message="ring moved on")
    assert ring.rows("SELECT status FROM runs WHERE id = ?", row["id"])[0]["status"] == "interrupted"
    left = [p for p in psutil.process_iter() if _env_run(p) == (str(ring.state), str(row["id"]))]
    assert not left, "a process of the forced run survived"

    # A guarded update: the run that finished meanwhile is never clobbered.
    res = ring.cli("force-fail", "--run", str(row["id"]))
    assert res.returncode == 1
    assert ring.rows("SELECT status FROM runs WHERE id = ?", row["id"])[0]["status"] == "interrupted"
    res = ring.cli("force-fail", "--run", str(nxt["id"]))
    assert res.returncode == 0
    # with nothing running at all (driver stopped)
    ring.procs[0].send_signal(signal.SIGTERM)
    ring.procs[0].wait(timeout=10)
    res = ring.cli("force-fail")
    assert res.returncode == 1 and "nothing is running" in one_error_line(res)


def _env_run(p):
    try:
        env = p.environ()
    except (psutil.Error, OSError):
        return None
    return env.get("RING_STATE"), env.get("RING_RUN_ID")


def test_resume_lifts_quarantine(ring):
    ring.agent("wedgy", "exit 0")
    ring.agent("other", "exit 0")
    ring.roster(f"wedgy {ring.agents_dir}/wedgy.sh", f"other {ring.agents_dir}/other.sh")
    assert ring.cli("resume", "ghost").returncode == 2
    res = ring.cli("resume", "wedgy")
    assert res.returncode == 0 and "nothing to do" in res.stdout
    # Put wedgy in quarantine the way the driver records it.
    from ringd.journal.sqlite import Journal
    j = Journal.open(ring.state)
    try:
        with j.transaction() as tx:
            tx.put_agent(tx.agent("wedgy").with_(quarantined_until=time.time() + 3600,
                                                 quarantine_line=f"wedgy {ring.agents_dir}/wedgy.sh",
                                                 bad_streak=3))
    finally:
        j.close()
    doc, _ = status_json(ring)
    assert is_iso_utc(doc["agents"][0]["quarantined_until"]) and doc["agents"][1]["quarantined_until"] is None
    table = ring.cli("status", env=dict(ring.env, NO_COLOR="1"))
    assert "QUARANTINED" in table.stdout

    res = ring.cli("resume", "wedgy")
    assert res.returncode == 0 and "quarantine lifted" in res.stdout
    st = ring.rows("SELECT * FROM agents WHERE name = 'wedgy'")[0]
    assert st["quarantined_until"] is None and st["quarantine_line"] is None and st["bad_streak"] == 0
    ev = ring.rows("SELECT * FROM events WHERE kind = 'resumed'")
    assert ev and ev[-1]["source"] == "operator"
    assert json.loads(ring.cli("status", "--json").stdout)["agents"][0]["quarantined_until"] is None
    res = ring.cli("resume", "nosuch")
    assert res.returncode == 2 and "wedgy, other" in one_error_line(res)


# --- bad input ------------------------------------------------------------------------------

def test_bad_input_is_one_line(ring):
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    good = ring.config_path.read_text()

    # A config that does not load: the operator commands still act (SPEC "Operator
    # commands keep working when an edit is broken"), saying why in one line.
    ring.config_path.write_text("ring: [unclosed\n")
    for args, code in ((("status",), 3), (("status", "--json"), 3), (("history",), 0), (("skip", "a"), 0)):
        res = ring.cli(*args)
        lines = [x for x in res.stderr.splitlines() if x.strip()]
        assert res.returncode == code and len(lines) == 1 and "invalid YAML" in lines[0], (args, res.stderr)
        assert lines[0].startswith("ringd: warning: configuration error: ") and res.stdout, (args, res.stdout)
    ring.config_path.write_text(good + "bogus_key: 1\n")
    doc, code = status_json(ring)
    assert code == 3 and [p["kind"] for p in doc["problems"]] == ["config"]
    assert "bogus_key" in doc["problems"][0]["detail"] and doc["problems"][0]["path"] == str(ring.config_path)
    ring.config_path.write_text("a: &a [" + ",".join(["*a"] * 10) + "]\n" + "x" * 50_000 + ": 1\n")
    res = ring.cli("status")
    assert res.returncode == 3 and max(len(x) for x in res.stderr.splitlines()) < 400, res.stderr
    ring.config_path.write_text(good)

    # A roster that does not parse: shown in status, not fatal.
    ring.roster("a ok", "9-bad name?? 'unbalanced")
    doc, code = status_json(ring)
    assert code == 3 and doc["roster"]["error"] and "ring.txt:2" in doc["roster"]["error"]
    ring.roster(f"a {ring.agents_dir}/a.sh")

    # A journal that is not SQLite: one line naming it, nothing replaced.
    (ring.state / "journal.db").write_bytes(b"this is not a database" * 10)
    for args in (("status", "--json"), ("status",), ("history",), ("logs", "a"), ("skip", "a"),
                 ("force-fail",), ("resume", "a")):
        res = ring.cli(*args)
        line = one_error_line(res)
        assert "journal.db" in line, (args, line)
        if args[0] == "status":
            assert res.returncode == 4
    assert (ring.state / "journal.db").read_bytes().startswith(b"this is not")

    res = ring.cli("status", "--bogus")
    assert res.returncode == 2 and "--bogus" in one_error_line(res)
    res = ring.cli("logs")
    assert res.returncode == 2 and "NAME" in one_error_line(res)
    res = ring.cli("logs", "a", "--run", "9" * 100_000)
    assert res.returncode == 2 and len(one_error_line(res)) < 400
    res = subprocess.run(ring_cmd("--version"), env=ring.env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "ringd" in res.stdout


def test_status_watch_refreshes_until_interrupted(ring):
    ring.agent("a", "exec sleep 30")
    ring.write_config(ring={"run_budget": 20, "stall_threshold": 25})
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.start_driver()
    wait_until(lambda: running_of(ring, "a"), message="a running")
    # once per frame: a JSON document's health, a plain frame's first line (a plain
    # frame says "running" twice - the watcher's and the agent's - so counting that
    # passed on the first frame alone and never saw a refresh)
    for extra, marker in ((("--json",), b'"health": "ok"'), ((), b"\ndriver ")):
        p = ring.start(ring_cmd("status", *ring.common(), "--watch", *extra), stderr=subprocess.PIPE)
        # a second frame arrives about a second later (bounded: a watch gone quiet fails, not hangs)
        frames = read_until(p.stdout, lambda data: (b"\n" + data).count(marker) >= 2, 30,
                            message="a second frame")
        first = frames.split(b"\n")[0] + b"\n"
        assert b"running" in frames
        assert p.poll() is None, "watch ended by itself"
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=10) == 0
        err = p.stderr.read()
        assert b"Traceback" not in err and b"\x1b" not in frames
        if extra:
            assert json.loads(first)["current"]["agent"] == "a"


def test_a_closed_stdout_or_stderr_is_as_if_redirected_to_dev_null(ring):
    """``ringd status >&-`` said "internal error: AttributeError" and exited 1
    with a healthy ring (Python leaves sys.stdout None); ``ringd run 2>&-`` exited
    1 at its first log line, having run nothing."""
    ring.agent("a", "echo hello")
    ring.roster(f"a {ring.agents_dir}/a.sh")

    def closed(fd: int, *args: str) -> subprocess.CompletedProcess:
        argv = ["sh", "-c", f'exec "$@" {fd}>&-', "sh", *ring_cmd(args[0], *ring.common(), *args[1:])]
        return subprocess.run(argv, env=ring.env, capture_output=True, text=True, timeout=60)

    res = closed(2, "run", "--once")
    assert res.returncode == 0 and [r["status"] for r in ring.runs()] == ["ok"], res
    expected = ring.cli("status").returncode
    assert expected == 3
    for args, code in ((("status",), expected), (("status", "--json"), expected), (("history",), 0),
                       (("logs", "a"), 0)):
        res = closed(1, *args)
        assert (res.returncode, res.stderr) == (code, ""), (args, res)


def test_force_fail_reason_with_bytes_that_are_not_utf8_is_recorded(ring):
    """argv is decoded with surrogateescape: a reason holding a byte that is not
    UTF-8 died as "internal error: UnicodeEncodeError" and the run stayed running.
    Control characters in it are spaces, as in an agent's phase."""
    ring.agent("stuck", "exec sleep 30")
    ring.write_config(ring={"run_budget": 20, "stall_threshold": 25})
    ring.roster(f"stuck {ring.agents_dir}/stuck.sh")
    ring.start_driver()
    row = wait_until(lambda: running_of(ring, "stuck"), message="stuck running")
    # and an escape sequence and a right-to-left override, which history would print to a terminal
    argv = [os.fsencode(a) for a in ring_cmd("force-fail", *ring.common(), "stuck")] + \
        [b"--reason", b"caf\xc3\xa9 \xff\x1b[31m red\xe2\x80\xaeX"]
    res = subprocess.run(argv, env=ring.env, capture_output=True, timeout=30)
    assert res.returncode == 0, res.stderr
    final = ring.rows("SELECT * FROM runs WHERE id = ?", row["id"])[0]
    assert (final["status"], final["reason"]) == ("interrupted", "forced by operator: caf\u00e9 \ufffd [31m red X")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_output_that_cannot_be_written_is_one_line_for_every_command(ring):
    """``ringd check >/dev/full`` ended in a traceback (check was the one
    operator command outside the one-line error handling). And the exit code
    is an output error's, never one that reports a state: ``status`` exited 1,
    "driver dead or stale", for a ring that never ran (now 4, "unknown"); the
    others 74 (EX_IOERR), whatever was buffered at the interpreter's exit
    included (``history --json`` exited 120 with a traceback once the error
    was reported)."""
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    cases = [(("check",), 74), (("status",), 4), (("status", "--json"), 4), (("history",), 74),
             (("history", "--json"), 74), (("service", "print"), 74)]
    for args, code in cases:
        common = ring.common() if args[0] != "service" else []
        with open("/dev/full", "w") as full:
            res = subprocess.run(ring_cmd(args[0], *common, *args[1:]), env=ring.env, stdout=full,
                                 stderr=subprocess.PIPE, text=True, timeout=30)
        assert (res.returncode, one_error_line(res)) == (
            code, "ringd: cannot write to standard output: No space left on device"), (args, res.stderr)


def test_status_watch_on_a_terminal_that_hangs_up_ends(ring):
    """``ringd status --watch`` on a terminal that went away (its window closed,
    the ssh link dropped; SIGHUP ignored or never sent) must end. rich draws
    nothing on what is no longer a terminal, so the watch went on polling (and
    reaping) the journal every second, forever, for nobody."""
    import pty
    ring.roster("a true")
    master, slave = pty.openpty()
    try:
        p = ring.start(ring_cmd("status", *ring.common(), "--watch"), stdin=slave, stdout=slave, stderr=slave)
    finally:
        os.close(slave)
    try:
        seen = b""
        while b"STOPPED" not in seen:
            seen += os.read(master, 65536)   # the first frame is drawn on the terminal
    finally:
        os.close(master)                     # the terminal goes away
    wait_until(lambda: p.poll() is not None, timeout=10, message="watch ended once its terminal went away")


# Values SQLite keeps in a typed column whatever the type (every CHECK passes):
# any process of the ring's user can write them into the journal.
HOSTILE_JOURNAL = {
    "time no clock shows": "UPDATE runs SET ended_at = 1e300 WHERE id = 2; UPDATE runs SET started_at = -1e300 WHERE id = 1",
    "text for numbers": "UPDATE runs SET duration = 'abc', exit_code = 'x', ended_at = 'y', cpu_seconds = 'z' WHERE id = 2",
    "blobs": "UPDATE runs SET agent = X'ff41', reason = X'ff', phase = X'fe', signal = X'01', duration = X'00' WHERE id = 2",
    "infinity": "UPDATE runs SET duration = 1e999, cpu_seconds = 1e999 WHERE id = 2",
    "text not utf-8": "UPDATE runs SET reason = CAST(X'ff41' AS TEXT), phase = CAST(X'c3' AS TEXT) WHERE id = 2",
    "agent state": "UPDATE agents SET backoff_until = 'soon', quarantined_until = X'00', consecutive_failures = 'many', "
                   "runs = 1e999 WHERE name = 'b'; UPDATE run_counts SET n = 'lots' WHERE agent = 'a'",
}


@pytest.mark.parametrize("sql", list(HOSTILE_JOURNAL.values()), ids=list(HOSTILE_JOURNAL))
def test_any_value_in_the_journal_is_read_as_input_never_an_internal_error(ring, sql):
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/a.sh")
    assert ring.cli("run", "--once").returncode == 0
    con = sqlite3.connect(ring.journal_path)
    con.executescript(sql)
    con.close()
    for args, code in ((("status",), 3), (("status", "--json"), 3), (("history",), 0), (("history", "--json"), 0)):
        res = ring.cli(*args)
        assert res.returncode == code and "error" not in res.stderr, (args, res.stderr)
        if "--json" in args:
            json.loads(res.stdout, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    # the driver reads the same rows: it turns on, and writes metrics a collector takes
    res = ring.cli("run", "--once")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    for line in (ring.state / "metrics.prom").read_text().splitlines():
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_an_escape_sequence_in_the_journal_never_reaches_the_operators_terminal(ring):
    """Names, reasons and phases the journal holds are shown with their control
    characters as spaces: in history's table (plain, as under NO_COLOR on a
    terminal) and in an error line that lists the agents the journal knows."""
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/a.sh")
    assert ring.cli("run", "--once").returncode == 0
    evil = "'e' || char(27) || ']0;pwned' || char(7) || char(27) || '[1A' || char(13) || char(10) || '  9  forged'"
    con = sqlite3.connect(ring.journal_path)
    con.executescript(f"UPDATE runs SET agent = {evil}, reason = {evil}, phase = {evil} WHERE id = 2;"
                      f"UPDATE agents SET name = {evil} WHERE name = 'b'")
    con.close()
    hist, unknown = ring.cli("history"), ring.cli("history", "zzz")
    assert hist.returncode == 0 and unknown.returncode == 2 and "pwned" in hist.stdout + unknown.stderr
    for text in (hist.stdout, unknown.stderr):
        assert not any(c in text for c in "\x1b\x07\r"), text
    assert not any(line.lstrip().startswith("9  forged") for line in hist.stdout.splitlines()), hist.stdout
    ring.roster("-bad x")   # a roster that does not parse: status lists the agents the journal knows
    res = ring.cli("status")
    assert res.returncode == 3 and "pwned" in res.stdout and "\x1b" not in res.stdout, res.stdout


def test_ringd_debug_shows_the_traceback_of_an_internal_error(ring, monkeypatch):
    """docs/operating.md, "Conventions": errors are one line, but ``RINGD_DEBUG=1``
    lets an internal error's traceback through."""
    from click.testing import CliRunner
    from ringd.cli import status as status_module
    from ringd.cli.commands import main

    def broken(*_a, **_kw):
        raise RuntimeError("a bug")
    ring.roster("a /bin/true")
    monkeypatch.setattr(status_module, "gather_status", broken)
    monkeypatch.setenv("RINGD_DEBUG", "")
    quiet = CliRunner().invoke(main, ["status", *ring.common()])
    assert quiet.exit_code == 4 and "set RINGD_DEBUG=1 for a traceback" in quiet.output
    monkeypatch.setenv("RINGD_DEBUG", "1")
    loud = CliRunner().invoke(main, ["status", *ring.common()])
    assert isinstance(loud.exception, RuntimeError) and str(loud.exception) == "a bug"


@pytest.mark.parametrize("error", ["internal", "journal", "file", "general"])
def test_status_that_fails_says_unknown_never_dead(ring, monkeypatch, error):
    """``ringd status`` exits 1 only for a dead or stale driver (LSB). A failure
    with no code of its own - an internal error, a journal or file error, an
    error raised with the general 1 - exited 1 too, saying "dead" of a ring it
    could not read; it is 4, "unknown". Other commands keep their 1."""
    from click.testing import CliRunner
    from ringd.cli import status as status_module
    from ringd.cli.commands import main
    from ringd.journal.sqlite import JournalError
    from ringd.cli.status import OperatorError

    raised = {"internal": RuntimeError("a bug"), "journal": JournalError("journal.db: disk I/O error"),
              "file": OSError(5, "Input/output error", "journal.db"), "general": OperatorError("cannot")}[error]

    def broken(*_a, **_kw):
        raise raised
    ring.roster("a /bin/true")
    monkeypatch.setattr(status_module, "gather_status", broken)
    monkeypatch.setenv("RINGD_DEBUG", "")
    result = CliRunner().invoke(main, ["status", *ring.common()])
    assert result.exit_code == 4, (result.exit_code, result.output)
    assert "Traceback" not in result.output


def test_check_shows_the_paths_it_names_on_one_line_in_their_order():
    """A roster path (``ring.roster``) or config path holding a newline or a
    right-to-left override is shown as ``status`` shows it: one line, in order."""
    from pathlib import Path
    from ringd.cli.commands import check_ok_line
    line = check_ok_line(Path("/c\nok: forged.yaml"), Path("/r\u202etxt.gnir/ring.txt"), ["a", "b"], 1)
    assert line == "ok: config /c ok: forged.yaml, roster /r txt.gnir/ring.txt with 2 agent(s): a, b; 1 warning(s)"
    assert check_ok_line(None, Path("/r/ring.txt"), ["a"], 0) == \
        "ok: config (built-in defaults), roster /r/ring.txt with 1 agent(s): a"


def test_check_of_a_roster_in_a_folder_named_with_a_newline_prints_one_line(ring):
    folder = ring.base / "x\nok: config forged, roster forged with 9 agent(s): fake \u202e"
    folder.mkdir(mode=0o700)
    (folder / "ring.txt").write_text("real /bin/true\n")
    os.chmod(folder / "ring.txt", 0o600)
    ring.config["ring"]["roster"] = str(folder / "ring.txt")
    ring.write_config()
    r = ring.cli("check")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 1 and "\u202e" not in r.stdout, r.stdout
    assert r.stdout.startswith("ok: config ") and r.stdout.rstrip().endswith("with 1 agent(s): real"), r.stdout


@pytest.mark.parametrize("command", ["skip", "next", "pause", "resume", "logs", "history"])
def test_a_name_no_roster_can_hold_is_an_unknown_agent_never_a_path(ring, command):
    """A NAME with a NUL byte, a newline, ``..`` or ``/`` (or a byte that is not
    UTF-8) is checked against the known names before it is used for anything -
    a log folder, a journal query - and refused in one line, exit 2."""
    from click.testing import CliRunner
    from ringd.cli.commands import main
    ring.roster("web /bin/true")
    (ring.state / "logs" / "web").mkdir(parents=True)
    for name in ("a\x00b", "a\nb", "..", "../web", "web/../web", "/etc/passwd", "\udcff"):
        r = CliRunner().invoke(main, [command, *ring.common(), name])
        assert r.exit_code == 2, (name, r.output, r.exception)
        assert r.output.count("\n") == 1 and "unknown agent" in r.output, (name, r.output)
    assert not ring.runs()
