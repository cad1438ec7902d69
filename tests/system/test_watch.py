"""ringwatch end to end: a real watcher, a real driver, real agents, short durations.

Every wait is a bounded poll (``wait_until``); processes are addressed by pid
(and start time), never by name.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import fill_up, freezing_agent, line_written, mounted_tmpfs, processes_of, wait_until, watch_cmd

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process semantics")


# --- helpers -------------------------------------------------------------------------

def watch_state(ring) -> dict:
    try:
        return json.loads((ring.state / "ringwatch.json").read_text())
    except (OSError, ValueError):
        return {}


def alive(pid: int, start: int = None) -> bool:
    """Alive (not a zombie) and, given its start ticks, the same process."""
    from ringd.host.procid import same_process, start_ticks
    return start_ticks(pid) is not None if start is None else same_process(pid, start)


def wait_driver(ring, not_pid=None, timeout=10.0) -> dict:
    """The heartbeat of a live, beating driver (other than ``not_pid``)."""
    seen = {}

    def beating():
        hb = ring.heartbeat()
        if not hb or hb.get("stopped") or hb.get("pid") == not_pid:
            return None
        if not alive(hb["pid"], hb.get("pid_start")):
            return None
        first = seen.setdefault(hb["pid"], hb.get("seq"))
        return hb if hb.get("seq") != first else None   # it beat at least twice
    try:
        return wait_until(beating, timeout, message=f"a beating driver other than {not_pid}")
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- ringd.log (tail) ---\n{driver_log_tail(ring)}") from None


def driver_log_tail(ring, lines=15) -> str:
    try:
        return "\n".join((ring.state / "logs" / "ringd.log").read_text().splitlines()[-lines:])
    except OSError:
        return "(no ringd.log)"


def finish(proc: subprocess.Popen, timeout=15.0):
    """Wait (bounded) for a process we started; returns (rc, stderr)."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"pid {proc.pid} did not exit within {timeout}s")
    return proc.returncode, err.decode(errors="replace")


def sigterm_timed(watcher: subprocess.Popen, within: float):
    """SIGTERM the watcher and time its exit (bounded by ``within``); returns
    (seconds it took, rc, stderr)."""
    t0 = time.monotonic()
    watcher.send_signal(signal.SIGTERM)
    wait_until(lambda: watcher.poll() is not None, within, message="the watcher exited")
    took = time.monotonic() - t0
    print(f"the watcher exited {took:.1f}s after its SIGTERM")
    rc, err = finish(watcher, 10)
    return took, rc, err


def stop_watcher(ring, watcher, timeout=15.0):
    """SIGTERM the watcher: it exits 0 and leaves no process of the ring behind."""
    watcher.send_signal(signal.SIGTERM)
    rc, err = finish(watcher, timeout)
    assert rc == 0, err
    wait_until(lambda: not processes_of(ring.state), 5, message="no process of the ring left")
    return err


def simple_ring(ring, body="sleep 0.3"):
    ring.agent("a", body)
    ring.agent("b", body)
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")


# --- supervision ----------------------------------------------------------------------

def test_starts_driver_replaces_a_killed_one_and_stops_cleanly(ring):
    simple_ring(ring)
    watcher = ring.start_watcher()
    hb = wait_driver(ring)
    first = hb["pid"]
    assert psutil.Process(first).ppid() == watcher.pid       # the watcher's own child
    assert os.getsid(first) == first                          # in its own session
    env = psutil.Process(first).environ()
    assert "NOTIFY_SOCKET" not in env and not any(k.startswith("WATCHDOG_") for k in env)
    ws = wait_until(lambda: watch_state(ring).get("last_poll_at") and watch_state(ring))
    assert ws["pid"] == watcher.pid and ws["gave_up"] is False and ws["restarts"] == []
    assert ws["driver"]["pid"] == first

    os.kill(first, signal.SIGKILL)
    t0 = time.monotonic()
    hb = wait_driver(ring, not_pid=first)
    restart_sec = ring.config["watch"]["restart_sec"]
    # noticed at once (not at the next poll) + restart_sec + a python start-up + 2 beats
    assert time.monotonic() - t0 < restart_sec + 2.5
    assert hb["pid"] != first and not alive(first)
    assert len(watch_state(ring)["restarts"]) == 1

    log = (ring.state / "logs" / "ringd.log")
    assert log.stat().st_mode & 0o777 == 0o600 and "ringd[" in log.read_text()

    err = stop_watcher(ring, watcher)
    assert not alive(hb["pid"])
    assert "driver (pid %d) was killed by signal 9" % first in err
    assert all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ringwatch\[\d+\]: ", line)
               for line in err.splitlines()), err
    assert ring.heartbeat()["stopped"] is True                # the driver stopped cleanly
    assert watch_state(ring)["stopped"] is True


def test_sigusr1_makes_the_watcher_check_at_once_never_kills_it(ring):
    """SIGUSR1 (what wakes the driver; `systemctl kill -s USR1` sends it to every
    process of the unit) had its default action in the watcher: it died without
    a log line, exit 138, its driver left running unwatched. It is a "check now"."""
    ring.write_config(watch={"poll_interval": 60, "stale_after": 60})
    simple_ring(ring)
    watcher = ring.start_watcher()
    pid = wait_driver(ring)["pid"]
    first = wait_until(lambda: watch_state(ring).get("last_poll_at"), message="a first poll")
    for _ in range(3):
        watcher.send_signal(signal.SIGUSR1)
    wait_until(lambda: watch_state(ring).get("last_poll_at") != first, 10,
               message="a check at once (poll_interval is 60 s)")
    assert watcher.poll() is None, finish(watcher)
    assert wait_driver(ring)["pid"] == pid
    stop_watcher(ring, watcher)


def test_a_driver_log_that_cannot_be_rotated_never_stops_the_watcher_starting_the_driver(ring):
    """ringd.log past its rotation size with a directory at ringd.log.1: the
    rotation's rename failed, the driver was never started, and the watcher
    gave up. The driver starts; ringd.log says why it grows on."""
    from ringd.host.safefile import LOG_ROTATE_BYTES as ROTATE_BYTES
    simple_ring(ring)
    logs = ring.state / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    with open(logs / "ringd.log", "wb") as f:
        f.truncate(ROTATE_BYTES + 1)   # sparse: no 16 MiB written
    (logs / "ringd.log.1").mkdir()
    watcher = ring.start_watcher()
    wait_driver(ring)
    assert watcher.poll() is None, finish(watcher)
    stop_watcher(ring, watcher)
    with open(logs / "ringd.log", "rb") as f:
        f.seek(ROTATE_BYTES)
        tail = f.read().decode("utf-8", "replace")
    assert "cannot rotate ringd.log to ringd.log.1" in tail and "appending on" in tail
    assert (logs / "ringd.log.1").is_dir()


def test_the_driver_log_is_rotated_at_its_bound_while_the_driver_lives(ring):
    """logs/ringd.log was rotated only when a watcher started a driver: a fast
    ring's log grew without end under one long-lived driver. The driver rotates
    it as it writes: with a 20 kB bound (RING_LOG_ROTATE_BYTES) a chatty ring
    has a ringd.log.1 while the same driver runs on, and one old copy only."""
    bound = 20_000
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.env["RING_LOG_ROTATE_BYTES"] = str(bound)
    watcher = ring.start_watcher()
    pid = wait_driver(ring)["pid"]
    logs = ring.state / "logs"
    wait_until(lambda: (logs / "ringd.log.1").exists(), timeout=60, message="ringd.log.1 while the driver runs")
    first = (logs / "ringd.log.1").stat().st_ino
    wait_until(lambda: (logs / "ringd.log.1").exists() and (logs / "ringd.log.1").stat().st_ino != first,
               timeout=60, message="a second rotation")
    assert wait_driver(ring)["pid"] == pid, "rotated by a restart, not by the running driver"
    # the live file stays near its bound: at most one check's worth past it (Rotation.check_every)
    assert (logs / "ringd.log").stat().st_size < 2 * bound
    assert (logs / "ringd.log.1").stat().st_size < 2 * bound
    assert sorted(p.name for p in logs.iterdir() if p.name.startswith("ringd.log")) == ["ringd.log", "ringd.log.1"]
    assert re.search(r"ringd\[\d+\]: run \d+: a ", (logs / "ringd.log").read_text()), "the driver writes on"
    stop_watcher(ring, watcher)


def test_second_watcher_refuses_naming_the_first(ring):
    simple_ring(ring)
    first = ring.start_watcher()
    wait_until(lambda: watch_state(ring).get("pid") == first.pid)
    second = ring.start_watcher()
    rc, err = finish(second, 10)
    assert rc == 75
    assert f"pid {first.pid}" in err and "Traceback" not in err and len(err.splitlines()) == 1
    stop_watcher(ring, first)


@pytest.mark.parametrize("poll", ["long", "short"])
def test_a_deleted_watcher_lock_never_lets_a_second_watcher_run(ring, poll):
    """ringwatch.lock deleted under a running watcher (tmpfiles cleaners, ``git
    clean -X``): a flock on the unlinked inode still held, so a second watcher
    locked a fresh file and ran beside the first (both adopting, stopping and
    replacing the same driver). Like the driver with ringd.lock: a watcher that
    got the lock but finds a live watcher in ringwatch.json (pid and start ticks)
    exits 75 naming it; the running watcher takes its lock file again at its
    next check."""
    simple_ring(ring)
    if poll == "long":   # no check of the first watcher's between the deletion and the second's start
        ring.write_config(watch={"poll_interval": 60, "stale_after": 60})
    first = ring.start_watcher()
    pid = wait_driver(ring)["pid"]
    wait_until(lambda: watch_state(ring).get("pid") == first.pid)
    lock = ring.state / "ringwatch.lock"
    lock.unlink()
    if poll == "short":
        from ringd.host.lock import holder_pid
        wait_until(lambda: lock.exists() and holder_pid(lock) == first.pid, 10,
                   message="the first watcher to lock ringwatch.lock again")
    second = ring.start_watcher()
    rc, err = finish(second, 15)
    assert rc == 75, err
    assert f"pid {first.pid}" in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert first.poll() is None and alive(pid) and wait_driver(ring)["pid"] == pid
    assert watch_state(ring)["pid"] == first.pid
    stop_watcher(ring, first)


def test_sigstopped_driver_is_replaced_after_stale_after(ring):
    simple_ring(ring)
    watcher = ring.start_watcher()
    hb = wait_driver(ring)
    hung, hung_start = hb["pid"], hb["pid_start"]
    os.kill(hung, signal.SIGSTOP)
    t0 = time.monotonic()
    hb = wait_driver(ring, not_pid=hung)
    waited = time.monotonic() - t0
    stale_after = ring.config["watch"]["stale_after"]
    assert waited >= stale_after - 0.5, f"replaced after {waited:.2f}s, before stale_after"
    assert waited < stale_after + 4.0
    assert not alive(hung, hung_start), "the stopped driver must be gone"
    assert len(watch_state(ring)["restarts"]) == 1
    stop_watcher(ring, watcher)


def test_a_hung_drivers_run_is_closed_by_that_driver_once_the_watcher_stops_it(ring):
    """docs/failures.md: a hung (SIGSTOPped) driver is sent
    SIGTERM with SIGCONT after ``stale_after``, so it stops its agent itself: the
    run is ``interrupted`` with source ``driver`` (not the reaper), its agent is
    gone, and a new driver takes over."""
    ring.write_config(ring={"run_budget": 20, "stall_threshold": 30})
    ring.agent("long", "exec sleep 30")
    ring.roster(f"long {ring.agents_dir}/long.sh")
    watcher = ring.start_watcher()
    hb = wait_until(lambda: (h := ring.heartbeat()) and h.get("run_pid") and h, 10, message="long running")
    hung, hung_start, run_id, agent_pid = hb["pid"], hb["pid_start"], hb["run_id"], hb["run_pid"]
    os.kill(hung, signal.SIGSTOP)
    wait_driver(ring, not_pid=hung)
    assert not alive(hung, hung_start), "the stopped driver must be gone"
    row = ring.rows("SELECT * FROM runs WHERE id = ?", run_id)[0]
    assert row["status"] == "interrupted", dict(row)
    ev = ring.rows("SELECT source FROM events WHERE run_id = ? AND kind = 'interrupted'", run_id)
    assert [e["source"] for e in ev] == ["driver"]
    assert not alive(agent_pid), "the hung driver's agent is stopped"
    stop_watcher(ring, watcher)


def test_interrupted_run_is_reaped_and_the_ring_continues(ring):
    ring.write_config(ring={"run_budget": 20, "stall_threshold": 30})
    ring.agent("quick", "sleep 0.2")
    ring.agent("slow", "sleep 20")
    ring.agent("after", "sleep 0.2")
    ring.roster(f"quick {ring.agents_dir}/quick.sh", f"slow {ring.agents_dir}/slow.sh",
                f"after {ring.agents_dir}/after.sh")
    watcher = ring.start_watcher()
    hb = wait_until(lambda: (h := ring.heartbeat()) and h.get("agent") == "slow" and h.get("run_pid") and h,
                    10, message="slow running")
    driver, run_id, agent_pid = hb["pid"], hb["run_id"], hb["run_pid"]
    os.kill(driver, signal.SIGKILL)

    def reaped():
        rows = {r["id"]: r for r in ring.runs()}
        return rows.get(run_id) is not None and rows[run_id]["status"] == "interrupted" and rows
    wait_until(reaped, 10, message=f"run {run_id} interrupted")
    assert not alive(agent_pid), "the orphaned agent is killed"
    # the ring continues after the interrupted agent, with the new driver
    later = wait_until(lambda: [r for r in ring.runs() if r["id"] > run_id and r["status"] != "running"],
                       10, message="a run after the interrupted one")
    assert later[0]["agent"] == "after"
    assert ring.heartbeat()["pid"] != driver
    stop_watcher(ring, watcher)


def test_history_survives_watcher_restart_gives_up_and_reset(ring):
    ring.write_config(watch={"start_limit_burst": 2, "start_limit_interval": 60, "restart_sec": 0.1})
    simple_ring(ring)

    # watcher A: one restart, then a clean stop
    a = ring.start_watcher()
    pid = wait_driver(ring)["pid"]
    os.kill(pid, signal.SIGKILL)
    pid = wait_driver(ring, not_pid=pid)["pid"]
    stop_watcher(ring, a)
    assert len(watch_state(ring)["restarts"]) == 1

    # watcher B inherits the history: one more restart is allowed, the next is not
    b = ring.start_watcher()
    pid = wait_driver(ring, not_pid=pid)["pid"]
    os.kill(pid, signal.SIGKILL)
    pid = wait_driver(ring, not_pid=pid)["pid"]
    assert len(watch_state(ring)["restarts"]) == 2
    os.kill(pid, signal.SIGKILL)
    rc, err = finish(b, 15)
    assert rc == 70, err
    loud = [ln for ln in err.splitlines() if "GIVING UP" in ln]
    assert len(loud) == 1 and "ringwatch reset" in loud[0] and "start_limit_burst 2" in loud[0]
    ws = watch_state(ring)
    assert ws["gave_up"] is True and len(ws["restarts"]) == 2
    wait_until(lambda: not processes_of(ring.state), 5, message="nothing left after giving up")

    # a restarted watcher still refuses, without starting anything
    c = ring.start_watcher()
    rc, err = finish(c, 10)
    assert rc == 70 and "ringwatch reset" in err and "Traceback" not in err
    assert ring.heartbeat()["pid"] == pid

    reset = subprocess.run(watch_cmd("reset", "--state", str(ring.state)), env=ring.env,
                           capture_output=True, text=True, timeout=30)
    assert reset.returncode == 0, reset.stderr
    ws = watch_state(ring)
    assert ws["gave_up"] is False and ws["restarts"] == []

    d = ring.start_watcher()
    wait_driver(ring, not_pid=pid)
    stop_watcher(ring, d)


def test_the_give_up_alert_is_sent_before_the_watcher_exits(ring, tmp_path):
    """The give-up alert is the one that must reach a human, yet the watcher
    exited 70 the instant it had started the alert command: under systemd
    (KillMode=control-group, RestartPreventExitStatus=70) the unit then stops
    and its cgroup - the alert helper with it - is killed, so a mail or a
    webhook taking a moment never went out. The watcher now waits for the
    alert (bounded by alerts.timeout) before it exits."""
    sent = tmp_path / "alerts"
    sent.mkdir()
    ring.write_config(watch={"start_limit_burst": 1, "start_limit_interval": 60, "restart_sec": 0.1},
                      alerts={"command": ["sh", "-c", f'sleep 1; cat > "{sent}/$RING_EVENT.tmp" && '
                                                      f'mv "{sent}/$RING_EVENT.tmp" "{sent}/$RING_EVENT.json"'],
                              "timeout": 20})
    simple_ring(ring)
    watcher = ring.start_watcher()
    _kill_the_driver_twice(ring)
    rc, err = finish(watcher, 30)
    assert rc == 70, err
    # at the moment the watcher is gone (systemd kills what is left), the alert is out
    delivered = sent / "watcher-gave-up.json"
    assert delivered.exists(), err
    assert json.loads(delivered.read_text())["event"] == "watcher-gave-up"


def test_driver_config_error_makes_the_watcher_exit_78(ring):
    ring.roster("bad/name sleep 1")              # a roster the driver rejects at start-up
    watcher = ring.start_watcher()
    rc, err = finish(watcher, 15)
    assert rc == 78, err
    assert "exited 78" in err and "ring.txt" in err     # the driver's own reason is quoted
    assert watch_state(ring)["restarts"] == []           # no restart loop


def test_watcher_config_error_is_one_line_78(ring):
    ring.write_config(watch={"stale_after": -1})
    rc, err = finish(ring.start_watcher(), 10)
    assert rc == 78 and "watch.stale_after" in err and len(err.strip().splitlines()) == 1


def test_new_watcher_adopts_a_running_driver(ring):
    simple_ring(ring)
    a = ring.start_watcher()
    pid = wait_driver(ring)["pid"]
    a.send_signal(signal.SIGKILL)
    finish(a)
    b = ring.start_watcher()
    wait_until(lambda: watch_state(ring).get("pid") == b.pid and watch_state(ring).get("last_poll_at"))
    hb = wait_driver(ring)                        # still beating: the same driver
    assert hb["pid"] == pid
    assert watch_state(ring)["driver"]["pid"] == pid and watch_state(ring)["restarts"] == []
    err = stop_watcher(ring, b)                   # an adopted driver is stopped too
    assert "already running (pid %d)" % pid in err


# --- restart_command mode ----------------------------------------------------------------

def restart_script(ring) -> Path:
    """A stand-in for `systemctl restart ringd`: starts a detached driver."""
    marker = ring.base / "restarted"
    script = ring.base / "restart.sh"
    driver_argv = " ".join([sys.executable, "-m", "ringd", "run", *ring.common()])
    script.write_text(f"#!/bin/sh\necho x >> {marker}\n"
                      f"setsid {driver_argv} >> {ring.base}/driver.log 2>&1 < /dev/null &\n")
    script.chmod(0o700)
    ring.write_config(watch={"restart_command": [str(script)]})
    return marker


def test_restart_command_mode_never_starts_the_driver_itself(ring):
    simple_ring(ring)
    marker = restart_script(ring)

    driver = ring.start_driver(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = wait_driver(ring)["pid"]
    assert first == driver.pid
    watcher = ring.start_watcher()
    wait_until(lambda: watch_state(ring).get("pid") == watcher.pid and watch_state(ring).get("last_poll_at"))
    assert not marker.exists()

    os.kill(first, signal.SIGKILL)
    hb = wait_driver(ring, not_pid=first)
    assert marker.read_text() == "x\n"                   # the command ran, once
    assert psutil.Process(hb["pid"]).ppid() != watcher.pid
    assert len(watch_state(ring)["restarts"]) == 1

    watcher.send_signal(signal.SIGTERM)
    rc, err = finish(watcher)
    assert rc == 0, err
    assert alive(hb["pid"]), "in restart_command mode the driver belongs to the service manager"
    os.kill(hb["pid"], signal.SIGTERM)
    wait_until(lambda: not alive(hb["pid"]), 10)


def test_restart_command_mode_without_a_driver_waits_grace_then_runs_the_command(ring):
    simple_ring(ring)
    marker = restart_script(ring)
    watcher = ring.start_watcher()
    t0 = time.monotonic()
    hb = wait_driver(ring)
    assert time.monotonic() - t0 >= ring.config["watch"]["stale_after"] - 0.5   # the grace came first
    assert marker.read_text() == "x\n"
    watcher.send_signal(signal.SIGTERM)
    rc, err = finish(watcher)
    assert rc == 0 and "no live driver yet" in err
    os.kill(hb["pid"], signal.SIGTERM)
    wait_until(lambda: not alive(hb["pid"]), 10)


# --- systemd notification -------------------------------------------------------------

def test_sd_notify_from_the_watcher_only(ring, tmp_path):
    simple_ring(ring)
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.settimeout(0.2)
    env = dict(ring.env, NOTIFY_SOCKET=path, WATCHDOG_USEC="400000")
    watcher = ring.start_watcher(env=env)
    got = []

    def collect():
        try:
            data, anc, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except socket.timeout:
            return None
        pid = None
        for level, kind, blob in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = struct.unpack("iII", blob[:12])[0]
        got.append((pid, data.decode()))
        msgs = [m for _, m in got]
        return ("READY=1" in msgs and msgs.count("WATCHDOG=1") >= 2
                and any(m.startswith("STATUS=") for m in msgs))
    try:
        wait_until(collect, 10, interval=0, message="READY=1, WATCHDOG=1 and STATUS= from ringwatch")
        hb = wait_driver(ring)
        env_driver = psutil.Process(hb["pid"]).environ()
        assert "NOTIFY_SOCKET" not in env_driver and "WATCHDOG_USEC" not in env_driver
        assert {pid for pid, _ in got} == {watcher.pid}, got
        stop_watcher(ring, watcher)
    finally:
        sock.close()


# --- the command line -------------------------------------------------------------------

def run_cli(ring, *args):
    return subprocess.run(watch_cmd(*args), env=ring.env, capture_output=True, text=True, timeout=30)


def test_cli_reset_and_errors_are_one_line(ring):
    res = run_cli(ring, "reset", "--state", str(ring.state))
    assert res.returncode == 0 and "nothing to reset" in res.stdout
    (ring.state / "ringwatch.json").write_text("{not json")
    res = run_cli(ring, "reset", "--state", str(ring.state))
    assert res.returncode == 0 and json.loads((ring.state / "ringwatch.json").read_text())["gave_up"] is False
    res = run_cli(ring, "reset", "--state", str(ring.base / "nowhere"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    res = run_cli(ring, "--state", str(ring.state), "--config", str(ring.base / "missing.yaml"))
    assert res.returncode == 78 and "missing.yaml" in res.stderr and "Traceback" not in res.stderr
    os.chmod(ring.state, 0o770)
    try:
        res = run_cli(ring, *ring.common())
    finally:
        os.chmod(ring.state, 0o700)
    assert res.returncode == 78 and "writable by group" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = run_cli(ring, "--help")
    assert res.returncode == 0 and "reset" in res.stdout


def test_symlinked_logs_are_never_followed(ring, tmp_path):
    simple_ring(ring)
    victim = tmp_path / "victim"
    victim.mkdir()
    os.symlink(victim, ring.state / "logs")
    rc, err = finish(ring.start_watcher(), 10)
    assert rc == 78 and "symbolic link" in err and len(err.strip().splitlines()) == 1
    assert os.listdir(victim) == []
    os.unlink(ring.state / "logs")
    (ring.state / "logs").mkdir(mode=0o700)
    precious = victim / "precious"
    precious.write_text("precious\n")
    os.symlink(precious, ring.state / "logs" / "ringd.log")
    rc, err = finish(ring.start_watcher(), 10)
    assert rc == 78 and "ringd.log" in err and len(err.strip().splitlines()) == 1
    assert precious.read_text() == "precious\n"


# --- a heartbeat that is not this ring's ------------------------------------------------

@pytest.mark.parametrize("how", ["symlink", "copy"])
def test_a_heartbeat_of_another_state_dir_is_never_taken_for_this_rings_driver(ring, tmp_path, how):
    """A heartbeat that another ring's driver wrote (a state dir copied with
    ``cp -a`` while its ring ran, or a symlink to another ring's heartbeat) names
    a live process with the right pid and start ticks - but not this ring's
    driver. The watcher adopted it: with the symlink it saw it beat and never
    started this ring's driver; with the copy it found it stale and SIGTERMed
    the *other* ring's driver (and this ring's own driver exited 75, "another
    driver holds the lock", naming it)."""
    from conftest import Ring
    (tmp_path / "other").mkdir()
    other = Ring(tmp_path / "other")
    try:
        simple_ring(other)
        other_driver = other.start_driver()
        theirs = wait_driver(other)
        assert theirs["pid"] == other_driver.pid
        if how == "symlink":
            os.symlink(other.state / "ringd.heartbeat", ring.state / "ringd.heartbeat")
        else:
            (ring.state / "ringd.heartbeat").write_bytes((other.state / "ringd.heartbeat").read_bytes())
        simple_ring(ring)
        watcher = ring.start_watcher()
        ours = wait_driver(ring, not_pid=theirs["pid"], timeout=15)
        assert psutil.Process(ours["pid"]).ppid() == watcher.pid
        # and the other ring's driver is never touched: beyond stale_after it still beats
        deadline = time.monotonic() + ring.config["watch"]["stale_after"] + 1.0
        wait_until(lambda: time.monotonic() > deadline, 10, message="stale_after to pass")
        assert alive(theirs["pid"], theirs["pid_start"])
        assert wait_driver(other)["pid"] == theirs["pid"]
        err = stop_watcher(ring, watcher)
        assert "already running (pid %d)" % theirs["pid"] not in err
        assert f"pid {theirs['pid']}" not in err, err
    finally:
        other.cleanup()


def test_a_watcher_state_copied_from_another_running_ring_is_not_this_rings(ring, tmp_path):
    """ringwatch.json names its watcher (pid and start ticks), and a watcher that
    finds a live one there refuses to run beside it. A copy of another running
    ring's state dir carries that ring's ringwatch.json: this ring's watcher must
    neither yield to the other ring's watcher (exit 75 forever) nor count its
    restarts, and `ringd status` must not show it as this ring's watcher."""
    from conftest import Ring
    (tmp_path / "other").mkdir()
    other = Ring(tmp_path / "other")
    try:
        simple_ring(other)
        theirs = other.start_watcher()
        wait_driver(other)
        wait_until(lambda: watch_state(other).get("pid") == theirs.pid)
        data = watch_state(other)
        data["restarts"] = [data["started_at"]] * 3
        (ring.state / "ringwatch.json").write_text(json.dumps(data))
        simple_ring(ring)
        st = json.loads(ring.cli("status", "--json").stdout)
        assert st["watcher"]["alive"] is False and st["watcher"]["pid"] is None, st["watcher"]
        ours = ring.start_watcher()
        wait_driver(ring)
        wait_until(lambda: watch_state(ring).get("pid") == ours.pid and watch_state(ring).get("last_poll_at"))
        assert ours.poll() is None and watch_state(ring)["restarts"] == []
        st = json.loads(ring.cli("status", "--json").stdout)
        assert st["watcher"]["pid"] == ours.pid and st["watcher"]["alive"] is True
        stop_watcher(ring, ours)
        assert theirs.poll() is None
    finally:
        other.cleanup()


def test_state_files_nested_too_deep_for_the_json_parser_read_as_unreadable(ring):
    """``json.loads`` raises RecursionError (not a ValueError) on a document nested
    some thousand levels deep: a heartbeat or ringwatch.json of 64 KiB of '['
    crashed the watcher at start-up (exit 70, "internal error") and `ringd status`.
    They read as unreadable: the watcher starts and replaces the heartbeat."""
    simple_ring(ring)
    (ring.state / "ringd.heartbeat").write_bytes(b"[" * 70000)
    (ring.state / "ringwatch.json").write_bytes(b'{"a":' * 30000)
    res = ring.cli("status", "--json")
    assert res.returncode == 3 and "Traceback" not in res.stderr, res.stderr
    assert json.loads(res.stdout)["driver"]["health"] == "stopped"
    watcher = ring.start_watcher()
    hb = wait_driver(ring)
    assert psutil.Process(hb["pid"]).ppid() == watcher.pid
    wait_until(lambda: watch_state(ring).get("pid") == watcher.pid, message="ringwatch.json rewritten")
    stop_watcher(ring, watcher)


def test_metrics_never_report_another_rings_watcher_state(ring, tmp_path):
    """metrics.prom's ring_watcher_restarts / ring_watcher_gave_up came from any
    ringwatch.json, a copy of another ring's included."""
    simple_ring(ring)
    other = tmp_path / "other-state"
    other.mkdir(mode=0o700)
    from ringd.host.heartbeat import whose
    (ring.state / "ringwatch.json").write_text(json.dumps(
        {**whose(other), "pid": 1, "restarts": ["2026-01-01T00:00:00+00:00"] * 3, "gave_up": True}))
    done = ring.cli("run", "--once")
    assert done.returncode == 0, done.stderr
    text = (ring.state / "metrics.prom").read_text()
    assert "ring_watcher_gave_up 1" not in text and "ring_watcher_restarts 3" not in text, text


def test_a_wall_clock_set_back_never_turns_old_restarts_into_a_burst(ring):
    """The restart window was kept in wall-clock times: after the clock was set
    back an hour, restarts spread over the last minutes were all "in the future",
    clamped to now, and counted as one burst - the next failure made the watcher
    give up (exit 70) though the driver never failed faster than the limit. The
    window is kept on the boot clock (ringwatch.json's restart_clock)."""
    from ringd.core.timefmt import iso
    ring.write_config(watch={"start_limit_burst": 2, "start_limit_interval": 30})
    simple_ring(ring)
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    boot, wall = time.clock_gettime(time.CLOCK_BOOTTIME), time.time()
    # two restarts 100 and 90 s ago by the boot clock, recorded while the wall clock was an hour ahead
    since_boot = {iso(wall + 3600 - ago): boot - ago for ago in (100, 90)}
    (ring.state / "ringwatch.json").write_text(json.dumps(
        {"restarts": list(since_boot), "restart_clock": {"boot_id": boot_id, "since_boot": since_boot}}))
    watcher = ring.start_watcher()
    pid = wait_driver(ring)["pid"]
    os.kill(pid, signal.SIGKILL)
    try:
        wait_driver(ring, not_pid=pid, timeout=15)
    except AssertionError:
        rc = watcher.poll()
        raise AssertionError(f"no new driver (watcher exit {rc}): {(ring.base / 'proc-0.stderr').read_text()[-600:]}")
    assert len(watch_state(ring)["restarts"]) == 1
    stop_watcher(ring, watcher)


def test_numbers_too_big_for_a_float_in_the_heartbeat_or_ringwatch_json_are_no_numbers(ring):
    """JSON reads a 400-digit number as an int that float() cannot take: such a
    pid_start in the heartbeat killed the watcher just after it had started the
    driver (internal error, exit 70 - the give-up code - its driver left running
    unwatched), such a restart time in ringwatch.json killed it at start-up, and
    `ringwatch reset`, the operator's way out, failed on it the same way."""
    simple_ring(ring)
    huge = "1" + "0" * 400
    (ring.state / "ringd.heartbeat").write_text(f'{{"pid": 1, "pid_start": {huge}, "seq": 1}}')
    (ring.state / "ringwatch.json").write_text(f'{{"restarts": [{huge}, -{huge}], "gave_up": false}}')
    watcher = ring.start_watcher()
    hb = wait_driver(ring)
    assert psutil.Process(hb["pid"]).ppid() == watcher.pid, watcher.poll()
    stop_watcher(ring, watcher)
    (ring.state / "ringwatch.json").write_text(
        f'{{"restarts": [{huge}], "gave_up": true, "restart_clock": {{"boot_id": "x", "since_boot": {{"a": {huge}}}}}}}')
    res = run_cli(ring, "reset", "--state", str(ring.state))
    assert res.returncode == 0, res.stderr
    assert json.loads((ring.state / "ringwatch.json").read_text())["gave_up"] is False


@pytest.fixture
def full_logs(ring):
    """ring.state/logs on its own tiny tmpfs, filled up (unmounted afterwards)."""
    import shutil
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a tiny tmpfs")
    logs = ring.state / "logs"
    logs.mkdir(mode=0o700)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(logs)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        (logs / "ringd.log").touch(mode=0o600)
        fill_up(logs)
        yield ring
    finally:
        ring.cleanup()
        if subprocess.run(["umount", str(logs)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(logs)], capture_output=True)


def test_a_full_driver_log_never_kills_the_driver(full_logs):
    """The driver writes its log lines to its stderr, logs/ringd.log under the
    watcher. On a full disk the first line raised ENOSPC and the driver exited 1
    before it had beaten once; every driver the watcher started died the same
    way, and the watcher gave up (exit 70) - though a driver whose journal and
    heartbeat are writable runs the ring as well without its log."""
    ring = full_logs
    ring.write_config(watch={"start_limit_burst": 2})
    simple_ring(ring, "true")
    watcher = ring.start_watcher()
    try:
        hb = wait_driver(ring)
    except AssertionError as e:
        raise AssertionError(f"{e}\nwatcher (exit {watcher.poll()}):\n{watcher.err_path.read_text()[-1500:]}") from None
    # a few polls and beats later: the same driver, never replaced
    seq = hb["seq"]
    wait_until(lambda: (ring.heartbeat() or {}).get("seq", 0) > seq + 10, 10, message="the driver beats on")
    assert ring.heartbeat()["pid"] == hb["pid"] and watch_state(ring)["restarts"] == []
    stop_watcher(ring, watcher)


def test_a_heartbeat_from_an_earlier_boot_names_no_driver(ring):
    """After a reboot the heartbeat still names the last boot's driver by pid and
    start tick, and a deterministic boot can hand both to another process. The
    watcher took such a process (here a `sleep`, named with its real pid and
    start tick but another boot's id) for its driver and, as it never beat,
    stopped it as a hung one after stale_after. A heartbeat of another boot names
    nobody: the watcher starts its own driver and leaves the stranger alone."""
    from ringd.host.procid import start_ticks
    simple_ring(ring)
    stranger = ring.start(["sleep", "120"])
    ticks = wait_until(lambda: start_ticks(stranger.pid), 5, message="the stranger started")
    (ring.state / "ringd.heartbeat").write_text(json.dumps({
        "pid": stranger.pid, "pid_start": ticks, "seq": 7, "at_epoch": time.time(),
        "boot_id": "00000000-0000-0000-0000-000000000000"}))
    watcher = ring.start_watcher()
    hb = wait_driver(ring, not_pid=stranger.pid)
    assert psutil.Process(hb["pid"]).ppid() == watcher.pid
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert hb["boot_id"] == watch_state(ring)["boot_id"] == boot   # both files say which boot they are of
    stale_after = ring.config["watch"]["stale_after"]
    deadline = time.monotonic() + 2 * stale_after + 1
    while time.monotonic() < deadline:   # well past stale_after: never taken for a hung driver
        assert stranger.poll() is None, "the watcher killed a process another boot's heartbeat named"
        time.sleep(0.1)
    stop_watcher(ring, watcher)
    assert stranger.poll() is None


def test_an_internal_error_of_the_watcher_is_not_its_give_up_code(monkeypatch, capsys):
    """An unexpected exception exited 70, the code that says the watcher gave up
    (start limit hit), which the shipped units tell systemd never to restart: a
    bug stopped the ring for good. It is one line and exit 1, which systemd
    restarts (``Restart=on-failure``)."""
    import ringwatch.cli as wcli

    def boom(*args, **kwargs):
        raise RuntimeError("boom")
    monkeypatch.setattr(wcli, "cli", boom)
    with pytest.raises(SystemExit) as exit_:
        wcli.main()
    assert exit_.value.code == 1
    assert "internal error: RuntimeError: boom" in capsys.readouterr().err
    for unit in ("ringwatch.service", "ringwatch-systemd.service"):
        text = (Path(__file__).resolve().parents[2] / "systemd" / unit).read_text()
        prevent = next(ln for ln in text.splitlines() if ln.startswith("RestartPreventExitStatus="))
        assert "1" not in prevent.split("=", 1)[1].split(), prevent


# --- ringwatch reset of a running watcher ------------------------------------------------

def in_process_watcher(ring, restarts=2):
    """A Watcher object (no loop, no driver) whose ringwatch.json holds ``restarts``
    restarts inside the window."""
    from ringd.inputs.config import load_config
    from ringd.host.heartbeat import whose
    from ringd.host import watchstate
    from ringd.loops.watcher import Watcher
    ring.write_config(watch={"start_limit_burst": 5, "start_limit_interval": 600})
    watchstate.prepare_state_dir(ring.state)
    w = Watcher(ring.state, ring.config_path, load_config(ring.config_path))
    clock = watchstate.clock_now()
    w._save(**whose(ring.state), pid=os.getpid(), gave_up=False,
            **watchstate.encode_restarts([clock.boot - 2 - i for i in range(restarts)][::-1], clock))
    assert len(watch_state(ring)["restarts"]) == restarts
    return w


def holds_open(pid: int, directory: Path) -> bool:
    """Has process ``pid`` a descriptor open on ``directory``?"""
    target = os.path.realpath(directory)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:   # gone (or a zombie's, unreadable)
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
        except OSError:   # closed meanwhile
            pass
    return False


def test_a_reset_landing_inside_the_watchers_read_and_write_is_not_undone(ring, monkeypatch):
    """The watcher read ringwatch.json, a `ringwatch reset` cleared it, and the
    watcher wrote back what it had read: the reset said "cleared 2 restart(s)"
    yet the history was back, and the next failures gave up early. Both now hold
    one write lock for their read-modify-write: the reset waits for the watcher."""
    from ringd.host import watchstate
    w = in_process_watcher(ring)
    real_clock_now = watchstate.clock_now
    resets, seen = [], []

    def reset_in_the_middle():   # called by _save between its read and its write
        if not resets:
            p = subprocess.Popen(watch_cmd("reset", "--state", str(ring.state)), env=ring.env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            resets.append(p)
            # Go on only once the reset got as far as it can: done (it did not
            # wait for us: the bug), or inside watchstate.write_lock, which opens the
            # state dir (nothing else in reset does) just before its first try
            # at the flock we hold. A timeout, however long, was no such sign:
            # an interpreter slow to start on a loaded box had not reached the
            # reset yet, and the test passed with no lock at all. (Not wchan or
            # /proc/locks: write_lock tries LOCK_NB and sleeps, never blocked
            # in flock.) Bounded generously: a cold start of python + click.
            seen.append(wait_until(lambda: "done" if p.poll() is not None
                                   else "waiting" if holds_open(p.pid, ring.state) else None,
                                   timeout=60, message="the reset done or waiting for the write lock"))
        return real_clock_now()
    monkeypatch.setattr(watchstate, "clock_now", reset_in_the_middle)
    try:
        w._save(last_poll_at="now")
        rc, err = finish(resets[0], 60)
    finally:
        for p in resets:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert rc == 0, err
    assert seen == ["waiting"], "the reset did not wait for the watcher's write lock"
    assert watch_state(ring)["restarts"] == [], "the reset was undone by the watcher's write"


def test_a_reset_clears_the_history_a_watcher_keeps_in_memory_on_a_full_disk(ring, monkeypatch):
    """On a full disk the watcher keeps its state in memory. The operator frees
    space and runs `ringwatch reset`: the watcher's next write put its in-memory
    history back over the reset (and counted it for the next give-up). A reset
    now moves ``reset_gen``, which the watcher checks before it uses its state."""
    import errno
    from ringd.host import watchstate
    w = in_process_watcher(ring)
    real_save, full = watchstate.save, [True]

    def save(state_dir, data):
        if full[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(state_dir, data)
    monkeypatch.setattr(watchstate, "save", save)
    w._save(last_poll_at="full")                 # the state is now in memory only
    assert w._unsaved is not None
    full[0] = False                              # space freed; the operator resets
    assert "cleared 2 restart(s)" in watchstate.reset(ring.state)
    assert w._load()["restarts"] == []           # what the next restart decision reads
    w._save(last_poll_at="free")
    ws = watch_state(ring)
    assert ws["restarts"] == [] and ws["last_poll_at"] == "free" and w._unsaved is None


def test_a_give_up_on_a_full_disk_is_recorded_and_refused_until_reset(ring, monkeypatch, capsys):
    """A give-up that ringwatch.json could not take (a full disk) was kept in
    memory only, and the watcher exited 70: the next ringwatch (launchd
    relaunches it; or one started by hand) found no give-up and started the
    driver again. The give-up is now recorded in an empty file, which needs no
    data block, and refused until `ringwatch reset`."""
    import errno
    from ringd.core.errors import RingError
    from ringd.host import watchstate
    from ringd.loops.watcher import Watcher
    w = in_process_watcher(ring)

    def full(state_dir, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(watchstate, "save", full)
    w._save(gave_up=True, gave_up_at="now", gave_up_reason="test", stopped=True)
    assert w._give_up("test") == 70
    monkeypatch.undo()
    assert watch_state(ring)["gave_up"] is False          # ringwatch.json never got it
    again = Watcher(ring.state, ring.config_path, w.config)
    with pytest.raises(RingError) as refused:
        again._refuse_if_given_up()
    assert refused.value.code == 70 and "ringwatch reset" in str(refused.value)
    assert "and the give-up" in watchstate.reset(ring.state)
    again._refuse_if_given_up()                            # cleared: it may start the driver


@pytest.mark.parametrize("stale", [False, True], ids=["no-ringwatch.json", "stale-ringwatch.json"])
def test_a_reset_on_a_disk_still_full_keeps_the_give_up_and_works_once_space_is_freed(ring, stale):
    """`ringwatch reset` removed the give-up marker before it saved the cleared
    ringwatch.json: on a disk still full the save failed, the marker was gone,
    and the next watcher started the driver on the stale history. Nor did a
    reset of a marker-only give-up (no ringwatch.json) record itself. The marker
    now goes only once the cleared state is saved."""
    from ringd.host import watchstate
    with mounted_tmpfs(ring.state):
        if stale:   # what the watcher wrote before the disk filled: no give-up, restarts in window
            (ring.state / "ringwatch.json").write_text(json.dumps(
                {"restarts": [watchstate.iso(time.time() - 5)] * 2, "gave_up": False}))
        filler = fill_up(ring.state)
        watchstate.mark_gave_up(ring.state)   # the give-up the full disk left: an empty file needs no free block
        assert (ring.state / watchstate.GAVE_UP_FILE).stat().st_size == 0
        before = (ring.state / "ringwatch.json").read_bytes() if stale else None
        res = run_cli(ring, "reset", "--state", str(ring.state))
        assert res.returncode == 1 and res.stdout == "", res
        assert (ring.state / watchstate.GAVE_UP_FILE).exists(), "a failed reset lost the give-up"
        # nothing changed (docs/service.md): ringwatch.json as it was, or still none
        if stale:
            assert (ring.state / "ringwatch.json").read_bytes() == before
        else:
            assert not (ring.state / "ringwatch.json").exists()
        assert watchstate.gave_up(ring.state, watchstate.load(ring.state))
        assert "cannot reset: No space left on device" in res.stderr and "run it again" in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
        filler.unlink()                                       # space freed: the same command works
        res = run_cli(ring, "reset", "--state", str(ring.state))
        assert res.returncode == 0 and f"cleared {2 if stale else 0} restart(s) and the give-up" in res.stdout, res
        assert not (ring.state / watchstate.GAVE_UP_FILE).exists()
        data = watch_state(ring)
        assert data["reset_gen"] == 1 and data["gave_up"] is False and data["restarts"] == [], data


def test_a_reset_whose_output_cannot_be_written_is_no_failed_reset(ring):
    """A reset's line on a full disk (stdout to /dev/full) was reported as
    "cannot reset" (1) though the reset was done."""
    (ring.state / "ringwatch.json").write_text(json.dumps({"restarts": [], "gave_up": True}))
    with open("/dev/full", "w") as full:
        res = subprocess.run(watch_cmd("reset", "--state", str(ring.state)), env=ring.env,
                             stdout=full, stderr=subprocess.PIPE, text=True, timeout=30)
    assert res.returncode == 74 and "reset done, but cannot write to standard output" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and watch_state(ring)["gave_up"] is False


@pytest.mark.parametrize("json_says", [None, False], ids=["no-ringwatch.json", "ringwatch.json-without-it"])
def test_a_give_up_only_the_marker_file_records_shows_in_status_and_metrics(ring, json_says):
    """`ringd status --json` and metrics.prom read "gave_up" from ringwatch.json
    only: a give-up a full disk recorded in the marker file instead (the watcher
    refuses on it) showed as no give-up, and metrics had no watcher at all."""
    from ringd.host import watchstate
    simple_ring(ring)
    if json_says is not None:   # the watcher's last write before the disk filled
        (ring.state / "ringwatch.json").write_text(json.dumps({"restarts": [], "gave_up": json_says}))
    (ring.state / watchstate.GAVE_UP_FILE).touch(mode=0o600)
    st = json.loads(ring.cli("status", "--json").stdout)
    assert st["watcher"] == {"pid": None, "alive": False, "last_poll_at": None, "restarts": 0, "gave_up": True}
    done = ring.cli("run", "--once")   # the driver writes metrics.prom
    assert done.returncode == 0, done.stderr
    text = (ring.state / "metrics.prom").read_text()
    assert "\nring_watcher_gave_up 1\n" in text and "\nring_watcher_restarts 0\n" in text, text
    assert "GAVE UP" in ring.cli("status").stdout


def test_a_give_up_marker_already_there_counts_as_recorded_and_is_kept(ring, monkeypatch, capsys):
    """mark_gave_up made the marker with safefile.create_new, which removes what
    is at the path and makes it again: a marker already there was gone for a
    moment (`ringd status` saw no give-up) and lost if it could not be made
    again; and one that could not be removed (a directory) was logged as "THE
    GIVE-UP IS NOT RECORDED" though the next watcher refuses on it. Anything
    already there records the give-up (watchstate.gave_up): FileExistsError is success."""
    import errno
    from ringd.host import watchstate
    w = in_process_watcher(ring)
    marker = ring.state / watchstate.GAVE_UP_FILE
    marker.touch(mode=0o600)
    os.link(marker, ring.base / "same-marker")   # tells the same file from one made again
    watchstate.mark_gave_up(ring.state)
    assert os.path.samefile(marker, ring.base / "same-marker"), "the marker was removed and made again"
    marker.unlink()
    marker.mkdir(mode=0o700)                     # there, and not to be removed

    def full(state_dir, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(watchstate, "save", full)
    w._save(gave_up=True, gave_up_at="now", gave_up_reason="test", stopped=True)
    capsys.readouterr()
    assert w._give_up("test") == 70
    err = capsys.readouterr().err
    assert "NOT RECORDED" not in err and f"recorded in {marker}" in err, err
    assert watchstate.gave_up(ring.state, watchstate.load(ring.state))


def test_a_reset_locked_out_says_so_and_exits_75(ring, monkeypatch, capsys):
    """A reset that could not take the write lock (another process held it past
    watchstate.WRITE_LOCK_WAIT) raised a RingError (75) that the command did not
    catch: "internal error: RingError: ..." and exit 1."""
    import fcntl
    import functools
    from ringwatch import cli as wcli
    from ringd.host import watchstate
    assert watchstate.WRITE_LOCK_WAIT == 10.0   # docs/operating.md: "held ... write lock for 10 s"
    # the lock's wait cut short (reset looks write_lock up at each call)
    monkeypatch.setattr(watchstate, "write_lock", functools.partial(watchstate.write_lock, wait=0.2))
    monkeypatch.setattr(sys, "argv", ["ringwatch", "reset", "--state", str(ring.state)])
    fd = os.open(ring.state, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)   # a holder that does not let go
        with pytest.raises(SystemExit) as exit_:
            wcli.main()
    finally:
        os.close(fd)
    err = capsys.readouterr().err
    assert exit_.value.code == 75 and "still being written by another process after 0.2s" in err, err
    assert "internal error" not in err and len(err.strip().splitlines()) == 1


def test_a_give_up_marker_no_unlink_can_take_is_named_and_nothing_is_reset(ring):
    """A directory where the give-up marker goes: the reset saved the cleared
    history, then failed to remove it - half a reset, exit 1 naming
    ringwatch.json. Now it is refused first, naming the marker."""
    (ring.state / "ringwatch.gave-up").mkdir(mode=0o700)
    res = run_cli(ring, "reset", "--state", str(ring.state))
    assert res.returncode == 1, res
    assert "ringwatch.gave-up: cannot reset: a directory" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (ring.state / "ringwatch.json").exists(), "nothing was to be saved"
    (ring.state / "ringwatch.gave-up").rmdir()
    assert run_cli(ring, "reset", "--state", str(ring.state)).returncode == 0


def test_a_driver_that_cannot_be_started_is_retried_after_restart_sec_and_the_watcher_gives_up(ring):
    """A failed start (fork/exec failing: EAGAIN, ENOMEM, the interpreter gone; here
    a FIFO at logs/ringd.log) is a driver that died at once, as systemd takes an exec
    failure: retried ``restart_sec`` later, under the start limit. It waited for the
    next poll instead (``poll_interval``, 300 s by default), so the restarts were
    never ``start_limit_burst`` within the window and the watcher never gave up."""
    ring.write_config(watch={"poll_interval": 60, "stale_after": 60, "restart_sec": 0.2,
                             "start_limit_burst": 2, "start_limit_interval": 120})
    simple_ring(ring)
    (ring.state / "logs").mkdir(mode=0o700)
    os.mkfifo(ring.state / "logs" / "ringd.log", 0o600)
    watcher = ring.start_watcher()
    rc, err = finish(watcher, 30)
    assert rc == 70, err
    assert err.count("cannot start the driver") == 3, err
    assert "GIVING UP" in err and "Traceback" not in err, err
    assert watch_state(ring)["gave_up"] is True


def test_a_heartbeat_naming_a_recycled_pid_never_gets_that_process_signalled(ring):
    """restart_command mode follows whoever writes the heartbeat. A beat naming a
    pid the kernel has since handed to another process (its start tick differs)
    is a dead driver's: the watcher runs the restart command and, finally, gives up
    - never signalling the process that has the pid now."""
    from ringd.host.heartbeat import whose
    from ringd.host.procid import start_ticks
    ring.write_config(watch={"restart_command": ["true"], "start_limit_burst": 1})
    simple_ring(ring)
    stranger = ring.start(["sleep", "120"])
    ticks = wait_until(lambda: start_ticks(stranger.pid), 5, message="the stranger started")
    watcher = ring.start_watcher()
    wait_until(lambda: watch_state(ring).get("last_poll_at"), 10, message="the watcher polling")
    beat = {**whose(ring.state), "pid": stranger.pid, "pid_start": ticks + 1, "seq": 1,
            "at_epoch": time.time()}
    tmp = ring.state / ".hb.tmp"
    tmp.write_text(json.dumps(beat))
    os.replace(tmp, ring.state / "ringd.heartbeat")   # a beat, then the driver died and its pid was reused
    rc, err = finish(watcher, 30)
    assert rc == 70 and "GIVING UP" in err, err
    assert f"driver (pid {stranger.pid}) is gone" in err, err
    assert stranger.poll() is None and start_ticks(stranger.pid) == ticks


def test_a_sigterm_while_the_driver_starts_up_stops_it_cleanly(ring):
    """SIGTERM to the watcher in the instant after it started the driver (whose
    interpreter is still starting, its signals held): the driver takes the SIGTERM
    once ready and exits by itself - no SIGKILL after the grace - and the
    watcher exits 0 leaving nothing behind."""
    simple_ring(ring)
    watcher = ring.start_watcher()

    def driver():
        try:
            kids = psutil.Process(watcher.pid).children()
        except psutil.Error:
            return None
        return kids[0] if kids else None
    d = wait_until(driver, 20, interval=0.001, message="ringwatch started a driver")
    watcher.send_signal(signal.SIGTERM)
    rc, err = finish(watcher, 30)
    assert rc == 0, err
    assert f"driver (pid {d.pid}) terminated" in err and "killed" not in err, err
    assert "Traceback" not in err, err
    wait_until(lambda: not processes_of(ring.state), 5, message="no process of the ring left")


def test_a_sigterm_during_the_give_up_alert_ends_the_wait_and_keeps_the_give_up(ring, tmp_path):
    """SIGTERM while the watcher waits for its give-up alert: it stops waiting at
    once and still exits 70 - the give-up is recorded before the alert starts."""
    ring.write_config(watch={"start_limit_burst": 1, "start_limit_interval": 60, "restart_sec": 0.1},
                      alerts={"command": ["sh", "-c", f'touch "{tmp_path}/$RING_EVENT"; exec sleep 60'],
                              "timeout": 60})
    simple_ring(ring)
    watcher = ring.start_watcher()
    _kill_the_driver_twice(ring)
    wait_until(lambda: (tmp_path / "watcher-gave-up").exists(), 20, message="the give-up alert running")
    assert watcher.poll() is None, "the watcher waits for its alert"
    watcher.send_signal(signal.SIGTERM)
    rc, err = finish(watcher, 10)
    assert rc == 70, err
    assert "exiting before the alert helper" in err and "Traceback" not in err, err
    assert watch_state(ring)["gave_up"] is True


def _kill_the_driver_twice(ring):
    """The driver SIGKILLed, then its replacement: a start limit of one gives up."""
    pid = wait_driver(ring)["pid"]
    os.kill(pid, signal.SIGKILL)
    os.kill(wait_driver(ring, not_pid=pid)["pid"], signal.SIGKILL)


# --- the watcher's own stop: one bound in all (processes SIGKILL cannot end) ---------------

_FREEZER_V1 = Path("/sys/fs/cgroup/freezer")


def _needs_freezer():
    if os.geteuid() != 0 or not (_FREEZER_V1 / "cgroup.procs").exists():
        pytest.skip("needs root and a cgroup v1 freezer hierarchy")


def _ice(name: str) -> Path:
    ice = _FREEZER_V1 / f"ring-test-{name}-{os.getpid()}"
    ice.mkdir()
    return ice


def _freeze(ice: Path, pid: int) -> None:
    (ice / "cgroup.procs").write_text(str(pid))
    (ice / "freezer.state").write_text("FROZEN")
    wait_until(lambda: (ice / "freezer.state").read_text().strip() == "FROZEN", 10, message=f"{ice} frozen")


def _thaw(ice: Path) -> None:
    """Thaw a test's freezer cgroup until it is empty and remove it: what it held
    dies of the SIGKILL it holds, or runs on to its exit."""
    if not ice.exists():
        return
    def thawed_and_empty():
        (ice / "freezer.state").write_text("THAWED")
        return not (ice / "cgroup.procs").read_text().split()
    wait_until(thawed_and_empty, 10, message="the freezer cgroup thawed and empty")
    ice.rmdir()


def _sigkill_pending(pid: int) -> bool:
    """SIGKILL sent to ``pid`` and not yet acted on (it is frozen)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(m & (1 << (signal.SIGKILL - 1)) for m in masks)


def _exit_thawing_on_sigkill(watcher, drv_ice: Path, driver: int, timeout: float):
    """Wait (bounded) for the watcher to exit; the frozen driver is thawed the
    moment its SIGKILL is pending, so it is deaf to SIGTERM and dies of SIGKILL.
    Returns (seconds until the watcher exited, seconds until the SIGKILL)."""
    t0 = time.monotonic()
    killed_at = []

    def done():
        if not killed_at and _sigkill_pending(driver):
            killed_at.append(time.monotonic() - t0)
            _thaw(drv_ice)
        return watcher.poll() is not None
    wait_until(done, timeout, interval=0.01, message="the watcher exited")
    return time.monotonic() - t0, (killed_at[0] if killed_at else None)


def _deaf_driver_with_unkillable_agent(ring):
    """A watcher whose driver runs an agent SIGKILL cannot end (frozen in a v1
    freezer), the driver then frozen too (deaf to SIGTERM; the test thaws it
    once its SIGKILL is pending). Returns (watcher, driver pid, agent pid,
    the agent's freezer, the driver's freezer)."""
    ice = _ice("agent")
    drv_ice = _ice("driver")
    freezing_agent(ring, "ice", ice)
    ring.write_config(ring={"run_budget": 60, "stall_threshold": 120})
    ring.roster(f"ice {ring.agents_dir}/ice.sh")
    watcher = ring.start_watcher()
    hb = wait_driver(ring, timeout=20)
    leader = int(wait_until(lambda: (ice / "cgroup.procs").read_text().split(), 20,
                            message="the agent froze itself")[0])
    wait_until(lambda: [r for r in ring.runs() if r["pid"] == leader], 20, message="the agent's pid recorded")
    _freeze(drv_ice, hb["pid"])
    return watcher, hb["pid"], leader, ice, drv_ice


def test_the_watchers_whole_stop_ends_well_within_the_units_stop_timeout(ring):
    """SIGTERM to ringwatch with everything in its stop at its worst: a driver
    deaf to SIGTERM (it dies of the SIGKILL after the grace), its agent a
    process SIGKILL cannot end (the orphan's kill waits cgroup.KILL_WAIT), the
    journal's write lock held (an operator's `sqlite3` shell: BEGIN EXCLUSIVE)
    and ringwatch.json's write lock held (a stopped `ringwatch reset`). Each
    wait had its own bound, deaf to signals: grace 10 s + the orphan's kill 5 s
    + the journal's busy timeout 10 s + the write lock 10 s = 35 s, past the
    unit's TimeoutStopSec (30 s), so systemd's SIGKILL landed mid-reap. Now the
    whole stop shares one deadline (watch.STOP_BUDGET) well below it."""
    import fcntl
    import sqlite3
    from ringd.cli.service import STOP_GRACE_WATCHER
    _needs_freezer()
    ice = drv_ice = None
    con = None
    dir_fd = None
    leader = None
    try:
        watcher, driver, leader, ice, drv_ice = _deaf_driver_with_unkillable_agent(ring)
        con = sqlite3.connect(str(ring.journal_path), timeout=5, isolation_level=None)
        con.execute("BEGIN EXCLUSIVE")
        watcher.send_signal(signal.SIGTERM)
        line_written(watcher.err_path, 10, "the watcher's first line")
        wait_until(lambda: "stopping driver" in watcher.err_path.read_text(), 10,
                   message="the watcher stopping its driver")
        dir_fd = os.open(ring.state, os.O_RDONLY | os.O_DIRECTORY)
        def take():   # the watcher itself holds it a moment at each poll
            try:
                fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # as a stopped `ringwatch reset`
                return True
            except BlockingIOError:
                return False
        wait_until(take, 10, message="the state files' lock taken between two polls")
        took, killed = _exit_thawing_on_sigkill(watcher, drv_ice, driver, 60)
        print(f"the stop took {took:.1f}s, SIGKILL after {killed}s")
        rc, err = finish(watcher, 10)
        assert rc == 0, err
        assert killed is not None and killed > 8.0, f"the driver had its grace: SIGKILL after {killed}"
        assert "Traceback" not in err, err
        # 20 s (the budget) measured from the test's SIGTERM; the unit allows 30 s
        assert took < STOP_GRACE_WATCHER - 5.0, f"the watcher's stop took {took:.1f}s\n{err}"
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
        if con is not None:
            con.close()
        for c in (drv_ice, ice):
            if c is not None:
                _thaw(c)
        if leader is not None:
            wait_until(lambda: not alive(leader), 10, message="the thawed agent gone")


def test_a_second_sigterm_during_the_watchers_stop_kills_the_driver_at_once(ring):
    """A second SIGTERM (or Ctrl-C) while ringwatch waits out its driver's grace
    hurries the stop: SIGKILL at once. It was not even heard: the wait was on
    the driver's pidfd alone, the whole 10 s grace."""
    _needs_freezer()
    drv_ice = _ice("driver")
    try:
        simple_ring(ring, "exec sleep 30")
        ring.write_config(ring={"run_budget": 60, "stall_threshold": 120})
        watcher = ring.start_watcher()
        driver = wait_driver(ring, timeout=20)["pid"]
        _freeze(drv_ice, driver)   # deaf to SIGTERM
        watcher.send_signal(signal.SIGTERM)
        wait_until(lambda: "stopping driver" in watcher.err_path.read_text(), 10,
                   message="the watcher stopping its driver")
        watcher.send_signal(signal.SIGINT)   # Ctrl-C again
        took, killed = _exit_thawing_on_sigkill(watcher, drv_ice, driver, 30)
        print(f"exit {took:.1f}s, SIGKILL {killed}s after the second signal")
        rc, err = finish(watcher, 10)
        assert rc == 0, err
        assert killed is not None and killed < 3.0, f"SIGKILL {killed}s after the second signal\n{err}"
        assert took < 5.0, f"the watcher exited {took:.1f}s after the second signal\n{err}"
        assert f"driver (pid {driver}) killed" in err, err
    finally:
        _thaw(drv_ice)


def test_a_restart_command_sigkill_cannot_end_never_holds_the_watchers_stop(ring):
    """restart_command mode: SIGTERM while the restart command runs kills the
    command's group, then waited for it unbounded (``Popen.wait()``): a command
    SIGKILL cannot end (hung in the kernel; here a frozen v1 freezer) kept
    the watcher from exiting for good, until systemd's SIGKILL."""
    _needs_freezer()
    ice = _ice("command")
    try:
        script = ring.base / "restart.sh"
        started = ring.base / "command-started"
        script.write_text(f"#!/bin/sh\necho $$ > {ice}/cgroup.procs\necho $$ > {started}\n"
                          f"echo FROZEN > {ice}/freezer.state\nexit 0\n")
        script.chmod(0o700)
        ring.write_config(watch={"restart_command": [str(script)]})
        simple_ring(ring)
        watcher = ring.start_watcher()
        command = int(line_written(started, 20, "the restart command started"))
        wait_until(lambda: (ice / "freezer.state").read_text().strip() == "FROZEN", 10, message="frozen")
        took, rc, err = sigterm_timed(watcher, 15)
        assert rc == 0, err
        assert took < 8.0, f"the watcher exited {took:.1f}s after its SIGTERM\n{err}"
        assert str(command) in err, err   # it names the command it leaves behind
    finally:
        _thaw(ice)


def test_a_sigterm_while_the_watcher_waits_for_its_state_files_lock_is_heard_at_once(ring):
    """ringwatch.json's write lock held (a stopped `ringwatch reset`): each poll
    waits for it, up to 10 s, then writes without it. That wait was deaf: a
    SIGTERM during it was heard only once the 10 s were out, on top of the stop."""
    import fcntl
    simple_ring(ring)
    watcher = ring.start_watcher()
    wait_driver(ring, timeout=20)
    dir_fd = os.open(ring.state, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # as a stopped `ringwatch reset`
        # the watcher's next poll (every 0.2 s) is waiting for the lock
        wait_until(lambda: holds_open(watcher.pid, ring.state), 10, message="the watcher waiting for the lock")
        took, rc, err = sigterm_timed(watcher, 20)
        assert rc == 0, err
        # the driver's clean stop and a 1 s wait for the lock at the end; it was 10 s more
        assert took < 6.0, f"the watcher exited {took:.1f}s after its SIGTERM\n{err}"
    finally:
        os.close(dir_fd)


def test_a_state_dir_full_at_start_up_is_an_outage_the_watcher_waits_out(ring):
    """The state dir is full for a few seconds as the watcher starts: each
    driver exits 69 (EX_UNAVAILABLE) before it can make its journal. Three of
    those counted against the start limit: GIVING UP, exit 70, and a new
    watcher refused to start. An outage is retried with a back-off instead,
    outside the start limit; once space is freed the ring turns."""
    ring.write_config(watch={"start_limit_burst": 2, "start_limit_interval": 60, "restart_sec": 0.2})
    with mounted_tmpfs(ring.state, "1m"):
        simple_ring(ring, "sleep 0.1")
        filler = fill_up(ring.state)
        watcher = ring.start_watcher()
        try:
            err = watcher.err_path
            wait_until(lambda: err.read_text().count("exited 69, an outage") >= 3 or watcher.poll() is not None,
                       timeout=30, message="three exits 69 of the driver")
            assert watcher.poll() is None, err.read_text()
            filler.unlink()
            wait_until(lambda: len(ring.runs()) >= 2 or watcher.poll() is not None, timeout=30,
                       message="the ring turning once space is freed")
            assert watcher.poll() is None, err.read_text()
            state = watch_state(ring)
            assert state.get("gave_up") is False and state.get("restarts") == [], state
            assert "GIVING UP" not in err.read_text()
            stop_watcher(ring, watcher)
        finally:
            ring.cleanup()   # (before the tmpfs goes: nothing of the ring may hold it)
