"""Promises at the edges (issue 9): values `ringd check` accepts never crash a
command, and check, run and ringwatch agree on what they refuse; a state dir
reached through a symlink keys processes by its real path.

Each test starts real processes; each failed (traceback, hang, crash loop,
survivor) before its fix.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import line_written, one_line, ring_cmd, wait_until, watch_cmd
from ringd.inputs.config import MAX_DURATION
from ringd.host.atomicfile import read_json

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process semantics")


def run(argv, env, timeout=30.0):
    try:
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{argv[2:4]} hung (> {timeout}s)")
    return r.returncode, r.stderr


# --- #9: every value check accepts, run runs; every one it refuses, all refuse ---------

LONG = "x" * 300
BAD_CONFIGS = {
    "nul-in-cwd": ('agents: {a: {cwd: "/tmp\\0x"}}', "agents.a.cwd"),
    "nul-in-roster-path": ('ring: {roster: "/tmp\\0x"}', "ring.roster"),
    "nul-in-restart-command": ('watch: {restart_command: [sh, "-c\\0"]}', "watch.restart_command"),
    "nul-in-a-key": ('agents: {"a\\0b": {cwd: /tmp}}', "NUL"),
    "lone-surrogate": ('agents: {a: {cwd: "/tmp/\\ud800"}}', "agents.a.cwd"),
    "nested-sequences": ("a: " + "[" * 5000 + "]" * 5000, "nested"),
    "nested-mappings": ("ring: " + "{a: " * 300 + "1" + "}" * 300, "nested"),
    "cooloff-1e12": ("ring: {quarantine_cooloff: 1.0e+12}", "ring.quarantine_cooloff"),
    "heartbeat-past-the-cap": (f"ring: {{heartbeat_interval: {MAX_DURATION * 10}}}", "ring.heartbeat_interval"),
    "poll-past-the-cap": (f"watch: {{poll_interval: {MAX_DURATION + 1}}}", "watch.poll_interval"),
    "huge-count": (f"ring: {{keep_logs: {10 ** 30}}}", "ring.keep_logs"),
    "long-cwd-component": (f"agents: {{a: {{cwd: /tmp/{LONG}}}}}", "255"),
    "long-roster-component": (f"ring: {{roster: /tmp/{LONG}/ring.txt}}", "255"),
}


def _simple(ring):
    ring.agent("a", "true")
    ring.roster(f"a {ring.agents_dir}/a.sh")


@pytest.mark.parametrize("what", ["roster", "config"])
@pytest.mark.parametrize("mode", [0o620, 0o602], ids=["group-writable", "other-writable"])
def test_check_refuses_a_roster_or_config_others_may_write_with_runs_line(ring, what, mode):
    """check warned and exited 0 for a roster or config group or others may
    write, which run then refused: whatever check accepts, run runs. Both exit
    78 with the same reason; a reading command still only warns."""
    _simple(ring)
    path = ring.roster_path if what == "roster" else ring.config_path
    os.chmod(path, mode)
    code, err = run(ring_cmd("run", "--once", *ring.common()), ring.env)
    assert code == 78, (code, err)
    ran = one_line(err)
    code, err = run(ring_cmd("check", *ring.common()), ring.env)
    assert code == 78, (code, err)
    checked = one_line(err)
    assert f"{path}: " in checked and "writable by group or others" in checked, checked
    assert checked.split(f"{path}: ", 1)[1] == ran.split(f"{path}: ", 1)[1], (checked, ran)
    code, err = run(ring_cmd("status", *ring.common()), ring.env)
    assert code in (0, 3) and "warning" in err and "writable by group or others" in err, (code, err)
    assert not ring.runs(), "nothing may run"


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_config_values_no_command_could_use_are_refused_alike_by_check_run_and_ringwatch(ring, case):
    text, must = BAD_CONFIGS[case]
    _simple(ring)
    ring.config_path.write_text(text + "\n")
    for argv in (ring_cmd("check", *ring.common()), ring_cmd("run", "--once", *ring.common()),
                 watch_cmd(*ring.common())):
        code, err = run(argv, ring.env)
        assert code == 78, f"{argv[2:4]} exit {code}: {err[-1500:]}"
        assert must in one_line(err), err
    assert not ring.runs(), "nothing may run"


def test_a_relative_cwd_is_the_roster_folder_s_and_check_warns_of_a_missing_one(ring):
    """``agents.<name>.cwd: sub`` runs the agent in ``sub`` of the roster's folder
    (as a relative program resolves there), wherever the driver was started;
    a cwd that is not a directory is a warning from check, as a missing program
    is, before every run of it ends 'error'."""
    ring.agent("a", f"pwd > {ring.base}/a-cwd")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    (ring.state / "sub").mkdir()
    elsewhere = ring.base / "elsewhere"
    elsewhere.mkdir()
    ring.write_config(agents={"a": {"cwd": "sub"}})
    r = subprocess.run(ring_cmd("check", "--strict", *ring.common()), env=ring.env, cwd=elsewhere,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and not r.stderr, r.stderr
    drv = ring.start_driver("--once", cwd=elsewhere)
    assert drv.wait(timeout=30) == 0
    assert [(x["agent"], x["status"]) for x in ring.runs()] == [("a", "ok")]
    assert (ring.base / "a-cwd").read_text().strip() == str(ring.state / "sub")

    for cwd, why in (("gone", "not found"), (str(ring.roster_path), "is not a directory")):
        ring.write_config(agents={"a": {"cwd": cwd}})
        r = subprocess.run(ring_cmd("check", "--strict", *ring.common()), env=ring.env, cwd=elsewhere,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 1, (r.returncode, r.stderr)
        assert "agent a: working directory" in one_line(r.stderr) and why in r.stderr, r.stderr


@pytest.mark.parametrize("what", ["a-file", "world-writable"])
def test_check_judges_the_state_dir_by_the_rule_run_and_ringwatch_apply(ring, what):
    """check said "ok" (exit 0, silent) for a state dir that run and ringwatch
    refuse (78): a file, or a directory others may write. check refuses both
    with run's line: it validates for run."""
    _simple(ring)
    ring.write_config(ring={"roster": str(ring.roster_path)})   # the roster is not looked for in the state dir
    if what == "a-file":
        state = ring.base / "state-file"
        state.write_text("")
        reason = f"{state}: state dir is not a directory"
    else:
        state = ring.base / "shared"
        state.mkdir()
        os.chmod(state, 0o777)
        reason = f"{state}: state dir is writable by group or others (mode 0777)"
    common = ["--state", str(state), "--config", str(ring.config_path)]
    code, err = run(ring_cmd("check", *common), ring.env)
    line = one_line(err)
    assert reason in line, line
    assert code == 78, (code, err)
    for argv in (ring_cmd("run", "--once", *common), watch_cmd(*common)):
        code, err = run(argv, ring.env)
        assert code == 78 and reason in one_line(err), (argv[2:4], code, err)


def test_check_warns_of_an_agents_section_for_a_name_not_on_the_roster(ring):
    """``agents.webb`` for the roster's ``web``: the limits meant for web applied
    to nothing and check said "ok"; it now warns (--strict: exit 1)."""
    ring.agent("web", "true")
    ring.roster(f"web {ring.agents_dir}/web.sh")
    ring.write_config(agents={"webb": {"run_budget": 1, "stall_threshold": 2}})
    r = ring.cli("check", "--strict")
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "agents.webb: no agent webb in the roster" in one_line(r.stderr)
    ring.config["agents"] = {"web": {"run_budget": 1, "stall_threshold": 2}}
    ring.write_config()
    r = ring.cli("check", "--strict")
    assert r.returncode == 0 and not r.stderr, r.stderr


def test_a_config_or_roster_that_is_a_fifo_is_refused_never_waited_on(ring):
    _simple(ring)
    fifo = ring.base / "fifo.yaml"
    os.mkfifo(fifo, 0o600)
    common = ["--state", str(ring.state), "--config", str(fifo)]
    for argv in (ring_cmd("check", *common), ring_cmd("run", "--once", *common), watch_cmd(*common)):
        code, err = run(argv, ring.env, timeout=20)
        assert code == 78 and "not a regular file" in one_line(err), (argv[2:4], code, err)
    ring.roster_path.unlink()
    os.mkfifo(ring.roster_path, 0o600)
    for argv in (ring_cmd("check", *ring.common()), ring_cmd("run", "--once", *ring.common())):
        code, err = run(argv, ring.env, timeout=20)
        assert code == 78 and "not a regular file" in one_line(err), (argv[2:4], code, err)


@pytest.mark.parametrize("what", ["dev-null", "directory"])
def test_a_config_that_is_a_device_or_a_world_writable_directory_is_refused_alike_as_what_it_is(ring, what):
    """A symlink to /dev/null (a 0666 device) or a 1777 directory at the config:
    run said "writable by group or others ... chmod go-w" (about /dev/null!)
    where check said "not a regular file": one rule, one line, from both."""
    _simple(ring)
    cfg = ring.base / "cfg.yaml"
    if what == "dev-null":
        os.symlink("/dev/null", cfg)
        reason = "config file is not a regular file"
    else:
        cfg.mkdir()
        os.chmod(cfg, 0o1777)
        reason = "config file is a directory"
    common = ["--state", str(ring.state), "--config", str(cfg)]
    lines = []
    for argv in (ring_cmd("check", *common), ring_cmd("run", "--once", *common), watch_cmd(*common)):
        code, err = run(argv, ring.env, timeout=20)
        line = one_line(err)
        assert code == 78 and f"{cfg}: {reason}" in line, (argv[2:4], code, err)
        lines.append(line.split(f"{cfg}: ", 1)[1])
    assert len(set(lines)) == 1, lines
    assert not ring.runs()


def test_a_journal_that_is_a_fifo_is_refused_never_waited_on(ring):
    """An open of a FIFO blocks until a writer comes, and a signal does not end
    it: the driver and every operator command hung there, deaf to SIGTERM."""
    _simple(ring)
    os.mkfifo(ring.journal_path, 0o600)
    expected = {("status",): 4, ("history",): 1, ("force-fail",): 1, ("pause",): 1, ("skip", "a"): 1,
                ("run", "--once"): 78}
    for args, want in expected.items():
        code, err = run(ring_cmd(args[0], *ring.common(), *args[1:]), ring.env, timeout=20)
        assert code == want and "journal is not a regular file" in one_line(err), (args, code, err)
    assert stat.S_ISFIFO(os.lstat(ring.journal_path).st_mode), "left in place for the operator"


def test_a_journal_a_newer_ring_wrote_is_refused_and_left_as_it_was(ring):
    """Every writer's open marked a newer ring's journal with this ring's older
    schema version and went on writing it (an operator downgrading ring by
    mistake, or two versions on one state dir): refused in one line instead."""
    import sqlite3
    from ringd.journal.sqlite import Journal
    from ringd.journal.schema_sqlite import SCHEMA_VERSION
    _simple(ring)
    Journal.open(ring.state).close()
    con = sqlite3.connect(ring.journal_path, isolation_level=None)
    try:
        con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
        before = con.execute("SELECT count(*) FROM events").fetchone()
    finally:
        con.close()
    expected = {("run", "--once"): 78, ("pause",): 1, ("next", "a"): 1, ("skip", "a"): 1, ("resume", "a"): 1}
    for args, want in expected.items():
        code, err = run(ring_cmd(args[0], *ring.common(), *args[1:]), ring.env, timeout=20)
        assert code == want and f"schema version {SCHEMA_VERSION + 1} " in one_line(err), (args, code, err)
    assert ring.rows("SELECT value FROM meta WHERE key = 'schema_version'")[0][0] == str(SCHEMA_VERSION + 1)
    assert tuple(ring.rows("SELECT count(*) FROM events")[0]) == before and not ring.runs()
    assert not ring.rows("SELECT * FROM meta WHERE key LIKE 'paused%' OR key = 'next'")


@pytest.mark.parametrize("plant", ["fifo", "directory"])
def test_a_run_log_that_is_not_a_file_is_refused_by_logs_never_waited_on(ring, plant):
    """`ringd logs` opened a run log blocking: a FIFO put in its place hung it
    (and `logs -f`) until a writer came; a directory gave a bare "Is a directory"."""
    _simple(ring)
    code, err = run(ring_cmd("run", "--once", *ring.common()), ring.env, timeout=30)
    assert code == 0 and [r["status"] for r in ring.runs()] == ["ok"], err[-1500:]
    log = ring.state / "logs" / "a" / f"{ring.runs()[0]['id']}.log"
    log.unlink()
    os.mkfifo(log, 0o600) if plant == "fifo" else log.mkdir()
    what = "not a regular file" if plant == "fifo" else "a directory"
    # (`logs a -f` names it once and follows a's later runs: tests/system/test_follow.py)
    for args in (("a",), ("a", "--lines", "3"), ("a", "--run", str(ring.runs()[0]["id"]), "-f")):
        code, err = run(ring_cmd("logs", *ring.common(), *args), ring.env, timeout=20)
        assert code == 1 and f"{log}: log is {what}" in one_line(err), (args, code, err)
    follower = ring.start(ring_cmd("logs", *ring.common(), "a", "-f"))
    wait_until(lambda: f"{log}: log is {what}" in follower.err_path.read_text(), timeout=20,
               message="the follower named the log")
    assert follower.poll() is None, "one bad log ended the follow"
    assert follower.err_path.read_text().count(str(log)) == 1
    assert stat.S_ISFIFO(os.lstat(log).st_mode) if plant == "fifo" else log.is_dir(), "left in place"


def test_state_files_that_are_fifos_are_never_waited_on(ring):
    """The JSON state files were opened blocking: a FIFO at ringwatch.json or
    ringd.heartbeat hung `ringd status`, `skip`, `ringwatch reset` (and
    ringwatch at start); one at notify.json or run.cgroup the driver. A FIFO
    reads as a missing file, and the daemons write over it."""
    _simple(ring)
    names = ("ringwatch.json", "ringd.heartbeat", "notify.json", "run.cgroup")
    for name in names:
        os.mkfifo(ring.state / name, 0o600)
    try:
        for argv, want in ((watch_cmd("reset", "--state", str(ring.state)), 0),
                           (ring_cmd("status", "--json", *ring.common()), 3),
                           (ring_cmd("skip", "a", *ring.common()), 0),
                           (ring_cmd("run", "--once", *ring.common()), 0)):
            code, err = run(argv, ring.env, timeout=20)
            assert code == want and "Traceback" not in err, (argv[2:4], code, err[-1500:])
        assert [r["status"] for r in ring.runs()] == ["skipped"]   # the skip request was honoured
    finally:   # the fixture's own clean-up reads run.cgroup
        for name in names:
            if (ring.state / name).is_fifo():
                (ring.state / name).unlink()


@pytest.mark.parametrize("how", ["option", "env"])
def test_a_state_path_no_system_call_could_take_is_one_line(ring, how):
    bad = str(ring.base / LONG / "state")
    env = dict(ring.env)
    args = ["--config", str(ring.config_path)]
    if how == "option":
        args = ["--state", bad, *args]
    else:
        env["RING_STATE"] = bad
    for argv in (ring_cmd("check", *args), ring_cmd("run", "--once", *args), ring_cmd("status", *args),
                 ring_cmd("history", *args), watch_cmd(*args)):
        code, err = run(argv, env)
        assert code == 78, f"{argv[2:4]} exit {code}: {err[-1500:]}"
        line = one_line(err)
        assert "255" in line and LONG not in line, line   # an excerpt, never the whole input


def test_an_empty_state_or_config_option_is_refused_never_read_as_the_default(ring):
    """``--state "$RING"`` with ``RING`` unset: the command acted on ./STATE (or
    ``$RING_STATE``) - another ring than the one meant. Refused in one line."""
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    elsewhere = dict(ring.env, RING_STATE=str(ring.state))   # a ring the empty option would fall back to
    for opt in ("--state", "--config"):
        for argv in (ring_cmd("check", opt, ""), ring_cmd("status", opt, ""), ring_cmd("pause", opt, ""),
                     watch_cmd(opt, "")):
            code, err = run(argv, elsewhere)
            assert code == 78 and f"{opt}: an empty path" in one_line(err), (argv[2:], code, err)
    assert not ring.journal_path.exists(), "the ring an empty --state fell back to was paused"


def test_durations_up_to_the_cap_work_in_a_running_driver_and_watcher(ring):
    """Waits longer than the OS timers allow (poll: 2**31 ms, ~24.8 days) are
    clamped: the driver idles through a deferral with a 34-day heartbeat
    interval, the watcher polls every 34 days, and both stop on SIGTERM."""
    ring.agent("later", "exit 75")
    ring.roster(f"later {ring.agents_dir}/later.sh")
    ring.write_config(ring={"heartbeat_interval": 3_000_000, "backoff_initial": MAX_DURATION,
                            "backoff_max": MAX_DURATION, "quarantine_cooloff": MAX_DURATION},
                      watch={"poll_interval": 3_000_000, "stale_after": MAX_DURATION,
                             "start_limit_interval": MAX_DURATION})
    code, err = run(ring_cmd("check", *ring.common()), ring.env)
    assert code == 0, err
    w = ring.start_watcher()
    wait_until(lambda: [r for r in ring.runs() if r["status"] == "deferred"], 20, message="a deferral")
    time.sleep(1.0)   # the driver is now in its long idle wait, the watcher in its long poll
    assert w.poll() is None, w.communicate()[1][-2000:]
    driver = ring.heartbeat()["pid"]
    assert psutil.Process(driver).status() != psutil.STATUS_ZOMBIE
    r = subprocess.run(ring_cmd("status", "--json", *ring.common()), env=ring.env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    w.send_signal(signal.SIGTERM)
    err = w.communicate(timeout=30)[1].decode(errors="replace")
    assert w.returncode == 0, err[-2000:]
    assert not psutil.pid_exists(driver) or psutil.Process(driver).status() == psutil.STATUS_ZOMBIE


def test_a_deeply_nested_config_at_sighup_is_refused_and_the_ring_goes_on(ring):
    marks = ring.base / "marks"
    ring.agent("a", f"echo $RING_RUN_ID >> {marks}; sleep 0.3")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    drv = ring.start_driver()
    wait_until(lambda: marks.exists() and len(marks.read_text().split()) >= 2, 20, message="runs")
    ring.config_path.write_text("ring: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n")
    drv.send_signal(signal.SIGHUP)
    n = len(marks.read_text().split())
    wait_until(lambda: len(marks.read_text().split()) >= n + 3, 20, message="the ring still turning")
    assert drv.poll() is None
    drv.send_signal(signal.SIGTERM)
    err = drv.communicate(timeout=30)[1].decode(errors="replace")
    assert drv.returncode == 0, err[-2000:]
    assert "Traceback" not in err and "nested more than" in err, err[-2000:]


def test_sighup_keeps_the_running_journal_and_lease_ttl(ring):
    """ring.journal and ring.lease_ttl are used at start-up only. Read at SIGHUP
    they made the beat follow a lease the driver does not hold: here a SQLite
    driver given a URI and a 0.4 s TTL beat every 0.1 s instead of every 2 s
    (and a leader given a longer TTL beat too rarely for its running lease)."""
    pytest.importorskip("psycopg")
    long_runs = ring.base / "long"
    ring.agent("a", f"if [ -e {long_runs} ]; then sleep 30; else sleep 0.2; fi")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.write_config(ring={"heartbeat_interval": 2, "run_budget": 60, "stall_threshold": 70})
    err_path = ring.base / "driver.err"
    with open(err_path, "wb") as err_file:
        drv = ring.start_driver(stderr=err_file)
    wait_until(lambda: ring.runs(), 20, message="a run")
    ring.write_config(ring={"journal": "postgresql://ring:secret@127.0.0.1:1/ring", "lease_ttl": 0.4})
    drv.send_signal(signal.SIGHUP)
    wait_until(lambda: "config reloaded" in err_path.read_text(), 10, message="the reload")
    long_runs.touch()
    wait_until(lambda: any(r["status"] == "running" and time.time() - r["started_at"] > 0.5
                           for r in ring.runs()), 20, message="a long run (a short one lasts 0.2 s)")
    beats, deadline = set(), time.monotonic() + 3.5
    while time.monotonic() < deadline:       # bounded: how often the heartbeat is rewritten
        beats.add((ring.heartbeat() or {}).get("at"))
        time.sleep(0.02)
    assert len(beats) <= 3, f"{len(beats)} beats in 3.5 s with heartbeat_interval 2"
    drv.send_signal(signal.SIGTERM)
    assert drv.wait(timeout=20) == 0
    log = err_path.read_text()
    assert "take effect when the driver restarts" in log and "secret" not in log, log[-2000:]
    assert "Traceback" not in log


# --- #6: the process key is the state dir's real path ------------------------------------

def test_a_driver_started_through_a_symlink_keys_its_runs_by_the_real_path(ring):
    """Agents get RING_STATE as the real path, so a reaper started through the
    real path recognises the escaped grandchild of a run whose driver (started
    through a symlink) died."""
    link = ring.base / "state-link"
    os.symlink(ring.state, link)
    pid_file = ring.base / "grandchild.pid"
    env_file = ring.base / "agent.env"
    ring.agent("a", f"""
        echo "$RING_STATE" > {env_file}
        setsid sleep 120 & echo $! > {pid_file}
        exec sleep 120
        """)
    ring.write_config(ring={"run_budget": 60, "stall_threshold": 90})
    ring.roster(f"a {ring.agents_dir}/a.sh")
    drv = ring.start(ring_cmd("run", "--state", str(link), "--config", str(ring.config_path)))
    grandchild = int(line_written(pid_file, 20, message="grandchild started"))
    assert env_file.read_text().strip() == str(ring.state.resolve())
    drv.send_signal(signal.SIGKILL)
    drv.wait(timeout=10)
    r = subprocess.run(ring_cmd("status", *ring.common()), env=ring.env, capture_output=True, text=True,
                       timeout=30)   # reaps the orphaned run through the real path
    assert "Traceback" not in r.stderr, r.stderr

    def gone():
        try:
            return psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    wait_until(gone, 10, message="the escaped grandchild killed by the reaper")
    assert ring.runs()[0]["status"] == "interrupted"


# --- #10: stray files in an agent's log dir ------------------------------------------------

def test_stray_files_in_an_agents_log_dir_never_crash_the_driver(ring):
    """Agents can write into logs/<agent>/: only ASCII-digit names are run logs
    ("²".isdigit() is True but int("²") raises), and only they are pruned."""
    ring.agent("a", 'touch "$RING_STATE/logs/a/².log" "$RING_STATE/logs/a/01.log" '
                    '"$RING_STATE/logs/a/x.log" "$RING_STATE/logs/a/٣.log"')
    ring.write_config(ring={"keep_logs": 2})
    ring.roster(f"a {ring.agents_dir}/a.sh")
    for _ in range(4):
        proc = ring.start_driver("--once")
        err = proc.communicate(timeout=30)[1].decode(errors="replace")
        assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert [r["status"] for r in ring.runs()] == ["ok"] * 4
    left = sorted(os.listdir(ring.state / "logs" / "a"))
    assert left == sorted(["².log", "01.log", "x.log", "٣.log", "3.log", "4.log"]), left


# --- #11: a new journal beside old logs ----------------------------------------------------

def test_a_journal_moved_aside_never_makes_new_runs_collide_with_old_logs(ring):
    ring.agent("a", "echo run $RING_RUN_ID")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    for _ in range(3):
        assert ring.start_driver("--once").wait(timeout=30) == 0
    old_logs = {p.name: p.read_text() for p in (ring.state / "logs" / "a").iterdir()}
    for suffix in ("", "-wal", "-shm"):   # the reset ring itself recommends
        p = Path(f"{ring.journal_path}{suffix}")
        if p.exists():
            p.rename(f"{p}.old")
    assert ring.start_driver("--once").wait(timeout=30) == 0
    (row,) = ring.runs()
    assert row["status"] == "ok" and row["id"] > 3, dict(row)
    for name, text in old_logs.items():
        assert (ring.state / "logs" / "a" / name).read_text() == text, "an old log was overwritten"


def test_a_journal_restored_from_a_backup_under_the_driver_has_its_stale_running_row_reaped(ring):
    """A backup taken while a run was going holds that run's ``running`` row,
    written by this very driver. Restored over journal.db under the driver, it
    is taken up between runs; its row must be closed as the reaper would - else
    every later start meets the one-running-row index and the ring stops for
    good (status does not reap it either: its driver is alive)."""
    import sqlite3
    ring.agent("a", "sleep 0.3")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    driver = ring.start_driver()
    wait_until(lambda: any(r["status"] == "running" for r in ring.runs()), timeout=20, message="a run")
    backup = ring.base / "backup.db"
    src, dst = sqlite3.connect(str(ring.journal_path)), sqlite3.connect(str(backup))
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    con = sqlite3.connect(str(backup))
    (stale,) = con.execute("SELECT id FROM runs WHERE status = 'running'").fetchone()
    con.close()
    wait_until(lambda: all(r["id"] > stale for r in ring.runs() if r["status"] == "running"), timeout=20,
               message="the run backed up has ended")
    os.replace(backup, ring.journal_path)
    # (read only once the driver has let go of the old journal: till then its
    # -wal, at the same path, is read as the restored file's)
    wait_until(lambda: "was removed or replaced under the driver" in driver.err_path.read_text(), timeout=20,
               message="the restored journal taken up")
    wait_until(lambda: any(r["status"] == "ok" and r["id"] > stale for r in ring.runs()), timeout=20,
               message="runs recorded in the restored journal")
    row = ring.rows("SELECT * FROM runs WHERE id = ?", stale)[0]
    assert (row["status"], driver.poll()) == ("interrupted", None), dict(row)
    # its driver is this live one: the reason says so, and never that it died
    assert row["reason"].startswith(f"its driver (pid {driver.pid}, still running) no longer runs it"), row["reason"]
    assert "Traceback" not in driver.err_path.read_text()


# --- #12: signals from the first instruction of both daemons ----------------------------------

def _sig_mask(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def _bit(sig) -> int:
    return 1 << (int(sig) - 1)


def _children(pid: int):
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def test_a_sighup_right_after_ringwatch_starts_the_driver_never_kills_it(ring):
    """ringwatch starts the driver with the signals held, so a SIGHUP in the
    driver's first instant - even before its interpreter runs a line of ring -
    waits for its handler (a reload) instead of killing it."""
    ring.agent("a", "sleep 0.2")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    w = ring.start_watcher()
    kids = wait_until(lambda: _children(w.pid), 20, interval=0.001, message="ringwatch started a driver")
    driver = kids[0]
    os.kill(driver, signal.SIGHUP)   # at once: usually still inside the interpreter's start-up
    hb = wait_until(lambda: (ring.heartbeat() or {}).get("pid") == driver and ring.heartbeat(), 20,
                    message="the first driver beating")
    # the reload is done at the loop's first turn, after the first beat: stopping the
    # ring a fixed 0.6 s after that beat could come first on a loaded box (a SIGTERM
    # heard with the SIGHUP stops the driver before it reloads)
    log_path = ring.state / "logs" / "ringd.log"
    wait_until(lambda: log_path.exists() and "config reloaded" in log_path.read_text(), 20,
               message="the held SIGHUP honoured once the driver is ready")
    time.sleep(3 * ring.config["watch"]["poll_interval"])
    data = __import__("json").loads((ring.state / "ringwatch.json").read_text())
    assert not data.get("restarts"), f"the driver was replaced: {data}"
    assert ring.heartbeat()["pid"] == driver and hb
    w.send_signal(signal.SIGTERM)
    w.communicate(timeout=30)
    log = (ring.state / "logs" / "ringd.log").read_text()
    assert not __import__("re").search(r"signal 1\b", log) and "Traceback" not in log, log[-2000:]
    assert "config reloaded" in log, "the held SIGHUP is honoured once the driver is ready"


@pytest.mark.parametrize("daemon", ["ringd run", "ringwatch"])
def test_signals_while_a_daemon_starts_up_are_held_and_honoured_once_ready(ring, daemon):
    """From the daemon's first instruction SIGHUP/SIGTERM are blocked (seen in
    /proc/<pid>/status SigBlk) until the handlers exist: a SIGHUP storm during
    start-up kills nothing, and a SIGTERM sent then is a clean stop, exit 0."""
    ring.agent("a", "sleep 0.2")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    p = ring.start_driver() if daemon == "ringd run" else ring.start_watcher()
    want = _bit(signal.SIGHUP) | _bit(signal.SIGTERM)
    # held before any handler exists (later, CPython blocks every signal around
    # each vfork of an agent: that moment does not count)
    wait_until(lambda: p.poll() is not None or (_sig_mask(p.pid, "SigBlk") & want == want
                                                and not _sig_mask(p.pid, "SigCgt") & want), 20,
               interval=0.0005, message=f"{daemon} holding SIGHUP and SIGTERM during its start-up")
    assert p.poll() is None, "it died before holding the signals"
    for _ in range(20):
        os.kill(p.pid, signal.SIGHUP)
        time.sleep(0.005)
    os.kill(p.pid, signal.SIGTERM)
    err = p.communicate(timeout=30)[1].decode(errors="replace")
    assert p.returncode == 0, f"exit {p.returncode} (killed by a signal if negative): {err[-2000:]}"
    assert "Traceback" not in err, err[-2000:]


def test_a_process_that_only_imports_the_command_lines_keeps_its_signals():
    """The hold is the daemons' alone. ``ringwatch.cli`` held SIGTERM, SIGINT,
    SIGHUP and SIGUSR1 at its import in any process whose argv named no
    subcommand - a ``python -c`` tool, a pytest-xdist worker - and every program
    that process started inherited the blocked mask: a ``ringd status --watch``
    it started never heard its Ctrl-C."""
    import subprocess
    import sys
    code = ("import signal, ringwatch.cli, ringd.cli; "
            "print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))")
    for argv in ([], ["run"]):   # no subcommand (a bare ringwatch's), ringd's "run"
        out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "[]", (argv, out.stdout)


# --- a FIFO planted where a daemon reads or appends a state file --------------------------

def _fifo_at(path: Path) -> None:
    """Replace ``path`` (a file or nothing) with a FIFO, atomically for readers."""
    tmp = path.with_name(f".{path.name}.fifo")
    os.mkfifo(tmp, 0o600)
    os.replace(tmp, path)


def test_fifos_at_the_state_files_never_hang_the_driver_nor_let_its_agent_run_on(ring):
    """The driver reads ringwatch.json at every metrics write and appends to
    alerts.log after a run: a blocking open of a FIFO there waited forever, deaf
    to SIGTERM, while its agent ran on past the stall threshold. A FIFO journal
    hung the driver's start the same way."""
    ring.agent("a", "sleep 300")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.write_config(alerts={"command": ["true"], "failures_in_a_row": 1})
    (ring.state / "logs").mkdir(mode=0o700)
    _fifo_at(ring.state / "logs" / "alerts.log")
    d = ring.start_driver()
    wait_until(lambda: any(r["status"] == "running" and r["pid"] for r in ring.runs()), 20,
               message="the agent running")
    _fifo_at(ring.state / "ringwatch.json")
    _fifo_at(ring.state / "ringd.heartbeat")
    stall = ring.config["ring"]["stall_threshold"]
    rows = wait_until(lambda: [r for r in ring.runs() if r["status"] not in ("running",)], stall + 15,
                      message="the agent ended at its stall threshold though the state files are FIFOs")
    assert rows[0]["status"] in ("timeout", "stalled"), dict(rows[0])
    wait_until(lambda: len(ring.runs()) >= 2, 20, message="the ring turning on")
    d.send_signal(signal.SIGTERM)
    try:
        err = d.communicate(timeout=20)[1].decode(errors="replace")
    except subprocess.TimeoutExpired:
        raise AssertionError("the driver did not stop on SIGTERM")
    assert d.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert not (ring.state / "ringd.heartbeat").is_fifo(), "replaced by a beat"
    assert ring.heartbeat()["stopped"]

    os.unlink(ring.journal_path)
    _fifo_at(ring.journal_path)
    code, err = run(ring_cmd("run", "--once", *ring.common()), ring.env, timeout=20)
    assert code == 78 and "not a regular file" in one_line(err), (code, err)


def test_fifos_at_the_state_files_never_hang_the_watcher(ring):
    """ringwatch reads ringwatch.json and the heartbeat at every poll and appends
    the driver's output to logs/ringd.log: FIFOs there are refused (a lost
    history, a stale beat, a driver it cannot start) and the watcher stays
    responsive - it polls on, replaces the FIFO with its state, stops on SIGTERM."""
    ring.agent("a", "sleep 0.2")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    w = ring.start_watcher()
    driver = wait_until(lambda: (ring.heartbeat() or {}).get("pid"), 20, message="a driver beating")
    _fifo_at(ring.state / "ringwatch.json")   # (this test never opens them: it would hang)
    _fifo_at(ring.state / "ringd.heartbeat")

    def polled():
        data = read_json(ring.state / "ringwatch.json") or {}   # (non-blocking: never waits on the FIFO)
        return data.get("last_poll_at") and data
    assert (ring.state / "ringwatch.json").is_fifo()
    wait_until(lambda: not (ring.state / "ringwatch.json").is_fifo() and polled(), 20,
               message="the watcher polling on and writing its state over the FIFO")
    _fifo_at(ring.state / "logs" / "ringd.log")
    os.kill(driver, signal.SIGKILL)
    wait_until(lambda: "cannot start the driver" in (ring.base / "proc-0.stderr").read_text(), 20,
               message="the watcher refusing the FIFO driver log")
    w.send_signal(signal.SIGTERM)
    try:
        err = w.communicate(timeout=30)[1].decode(errors="replace")
    except subprocess.TimeoutExpired:
        raise AssertionError("the watcher did not stop on SIGTERM")
    assert "Traceback" not in err, err[-2000:]
    assert "not a regular file" in err, err[-2000:]


def test_a_directory_at_the_heartbeat_reads_as_a_stale_driver_not_a_stopped_one(ring):
    """``rm ringd.heartbeat; mkdir ringd.heartbeat`` under a running driver: it
    can no longer beat (it says why and runs on). ``ringd status`` said
    ``STOPPED ... never ran here`` [3] - a driver alive, reported as none. With
    no readable heartbeat, the driver's lock tells: a live holder is ``stale``
    [1], as for a state dir it cannot write; its pid is the lock holder's."""
    ring.agent("a", "sleep 0.2")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    d = ring.start_driver()
    wait_until(lambda: (ring.heartbeat() or {}).get("pid"), 20, message="the driver beating")
    hb = ring.state / "ringd.heartbeat"

    def replaced_by_a_directory():
        try:   # a beat may land between the unlink and the mkdir: then again
            os.unlink(hb)
            hb.mkdir(mode=0o700)
        except (FileExistsError, FileNotFoundError):
            return False
        return True
    wait_until(replaced_by_a_directory, 10, message="the heartbeat replaced by a directory")
    r = ring.cli("status", "--json")
    doc = json.loads(r.stdout)
    assert (doc["driver"]["health"], r.returncode) == ("stale", 1), (doc["driver"], r.stderr)
    assert doc["driver"]["pid"] == d.pid
    assert "heartbeat unreadable" in ring.cli("status").stdout
    d.send_signal(signal.SIGTERM)
    assert d.wait(timeout=20) == 0
    r = ring.cli("status", "--json")
    assert (json.loads(r.stdout)["driver"]["health"], r.returncode) == ("stopped", 3)   # no lock holder: none runs


def test_fifos_at_the_temp_names_of_atomic_writes_never_hang_the_daemons(ring):
    """Every state file is written to ``.<name>.<pid>.tmp`` and renamed into place.
    That temp file was opened O_WRONLY|O_CREAT without O_NONBLOCK: a FIFO there
    (the names are predictable: the heartbeat publishes the driver's pid) made
    the open wait for a reader forever - the driver stopped beating and was deaf
    to SIGTERM, the watcher stopped polling. An entry squatting a temp name is
    removed and the file created afresh (O_EXCL): nothing is ever opened through it."""
    ring.agent("a", "sleep 0.2")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    w = ring.start_watcher()
    hb = wait_until(lambda: (lambda h: h and h.get("seq", 0) >= 2 and h)(ring.heartbeat()), 20,
                    message="a driver beating")
    wait_until(lambda: (read_json(ring.state / "ringwatch.json") or {}).get("pid") == w.pid, 20,
               message="the watcher's state")
    for name in (f".ringd.heartbeat.{hb['pid']}.tmp", f".ringwatch.json.{w.pid}.tmp",
                 f".metrics.prom.{hb['pid']}.tmp"):
        _fifo_at(ring.state / name)   # (atomic: the daemon may be writing that very name)
    seq = hb["seq"]
    wait_until(lambda: (ring.heartbeat() or {}).get("seq", 0) >= seq + 5, 20,
               message="the driver beating on past the FIFO at its temp name")

    def polled_after(t):
        data = read_json(ring.state / "ringwatch.json") or {}
        return (data.get("last_poll_at") or "") > t
    t = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() + 1))
    wait_until(lambda: polled_after(t), 20, message="the watcher polling on past the FIFO at its temp name")
    w.send_signal(signal.SIGTERM)
    try:
        err = w.communicate(timeout=30)[1].decode(errors="replace")
    except subprocess.TimeoutExpired:
        raise AssertionError("the watcher did not stop on SIGTERM")
    assert w.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert not any(p.name.endswith(".tmp") for p in ring.state.iterdir())


_BURST = r"""
import fcntl, os, signal, termios
from ringd.host.wakeup import Wakeups
w = Wakeups()
size = fcntl.fcntl(w.fileno(), 1031, 4096)    # F_SETPIPE_SZ: a page, filled sooner
queued = lambda: int.from_bytes(fcntl.ioctl(w.fileno(), termios.FIONREAD, b"\0" * 4), "little")

def burst():   # SIGUSR1s the process is too busy to drain, until the pipe is full
    sent = 0
    while queued() < size and sent < 10 * size:
        os.kill(os.getpid(), signal.SIGUSR1)
        sent += 1
    print("full" if queued() >= size else "not full", flush=True)

burst()
os.kill(os.getpid(), signal.SIGTERM)
print(sorted(map(int, w.wait(0)[0])), flush=True)
burst()
w.put_back({signal.SIGTERM})   # heard by another reader (ringd.journal.pgcall), put back onto a full pipe
print(sorted(map(int, w.wait(0)[0])), flush=True)
"""


def test_a_signal_behind_a_burst_that_fills_the_wakeup_pipe_is_heard():
    """Signals reach a daemon's wait through a non-blocking self-pipe, one byte
    each. A burst (SIGUSR1s, SIGCHLDs) that fills the pipe while the daemon is
    busy must never block the handler nor lose what comes after it: the C
    handler's byte for a SIGTERM that found the pipe full was dropped, and the
    SIGTERM was never heard."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    r = subprocess.run([sys.executable, "-c", _BURST], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    full, heard, full_again, put_back = r.stdout.splitlines()
    assert full == full_again == "full"
    both = str(sorted({int(signal.SIGUSR1), int(signal.SIGTERM)}))
    assert heard == both, r.stdout          # the SIGTERM sent onto the full pipe
    assert put_back == both, r.stdout       # the SIGTERM put back onto it


def test_a_wait_on_a_closed_descriptor_raises_never_spins():
    """poll(2) reports a closed descriptor at once, at every wait (POLLNVAL): taken
    as ready, a loop waiting on it would spin. (epoll refused it at registration.)"""
    import errno
    from ringd.host.wakeup import Wakeups
    w = Wakeups(signals=())
    r, wr = os.pipe()
    os.close(r)
    os.close(wr)
    try:
        t0 = time.monotonic()
        with pytest.raises(OSError) as e:
            w.wait(5.0, [r])
        assert e.value.errno == errno.EBADF and time.monotonic() - t0 < 2.5
        assert w.wait(0, []) == (set(), set())   # unregistered again: later waits are clean
    finally:
        w.close()
