"""Process identity (ringd.host.procid): pid + boot-relative start ticks, never the
wall clock.

A step of the wall clock reaches process identity through one channel only:
``/proc/stat``'s ``btime`` (wall clock at boot), which the kernel recomputes
after a step, and which psutil's ``create_time()`` adds to the start ticks.
Stepping the host's clock in a test would disturb every other process on the
box (other test runs' heartbeats, timers), so the clock-step tests below give
*one* process a ``/proc/stat`` whose ``btime`` is a day off - exactly what that
process would read after a step - by a bind mount in a private mount namespace
(root only; nothing outside the namespace changes). Everything else is real:
a real driver and agent, a real ``ringd status`` and a real ``ringwatch``.
Before procid, the status call reaped the live run and killed its agent, and
the watcher replaced the healthy driver.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import line_written, ring_cmd, wait_until, watch_cmd
from ringd.host import procid


def test_start_ticks_are_field_22_of_proc_stat():
    raw = open(f"/proc/{os.getpid()}/stat").read()
    assert procid.start_ticks(os.getpid()) == int(raw[raw.rfind(")") + 2:].split()[19])
    assert procid.same_process(os.getpid(), procid.start_ticks(os.getpid()))


def test_an_identity_of_another_boot_never_matches():
    """Ticks count from boot: a pid and start tick recorded before a reboot can
    be handed out again. One recorded with this boot's id, or with none (an
    older file), is judged by pid and ticks alone."""
    me, ticks = os.getpid(), procid.start_ticks(os.getpid())
    boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    here = procid.here()
    assert procid.boot_id() == boot == here["boot_id"]
    assert here["pid_ns"] == os.stat("/proc/self/ns/pid").st_ino and here["boot_view"] in ("kernel", "mounted")
    assert procid.same_process(me, ticks, here) and procid.same_process(me, ticks, None)
    assert procid.same_process(me, ticks, {"boot_id": boot})
    for other in ("00000000-0000-0000-0000-000000000000", "", 7):
        assert not procid.same_process(me, ticks, dict(here, boot_id=other))
    assert not procid.same_process(me, ticks, dict(here, pid_ns=here["pid_ns"] + 1)), "another pid namespace"
    assert procid.recorded_here({}) and not procid.recorded_here({"boot_id": boot.upper() + "x"})


def test_a_zombie_is_dead_and_a_malformed_identity_never_matches():
    pid = os.posix_spawnp("sleep", ["sleep", "0.3"], os.environ)
    ticks = procid.start_ticks(pid)
    assert ticks is not None and procid.same_process(pid, ticks)
    wait_until(lambda: procid.start_ticks(pid) is None, 10, message="child exited")
    assert os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None, "a zombie, not reaped"
    assert not procid.same_process(pid, ticks)
    os.waitpid(pid, 0)
    me = procid.start_ticks(os.getpid())
    assert procid.same_process(os.getpid(), float(me))          # through a REAL column or JSON
    for bad in (None, True, "1", me + 1, me + 0.5, 1.79e9):    # 1.79e9: an epoch start of an older ring
        assert not procid.same_process(os.getpid(), bad)
    for pid in (None, 0, -1, True, "1", 2 ** 22 + 1):
        assert procid.start_ticks(pid) is None


# --- clock steps -----------------------------------------------------------------

def _btime_shifted(tmp_path, seconds: int):
    """argv prefix running a command with /proc/stat's btime moved by ``seconds``."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare for a private mount namespace")
    lines = open("/proc/stat").read().splitlines()
    shifted = [f"btime {int(ln.split()[1]) + seconds}" if ln.startswith("btime ") else ln for ln in lines]
    fake = tmp_path / f"stat{seconds:+d}"
    fake.write_text("\n".join(shifted) + "\n")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            f"mount --bind {fake} /proc/stat && grep ^btime /proc/stat"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot bind-mount over /proc/stat here: {probe.stderr.strip()[:200]}")
    assert probe.stdout.split() == ["btime", str(int([x for x in lines if x.startswith('btime ')][0].split()[1])
                                                     + seconds)]
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            f'mount --bind {fake} /proc/stat && exec "$@"', "sh"]


def _long_run(ring):
    pid_file = ring.base / "agent.pid"
    ring.agent("long", f"echo $$ > {pid_file}; exec sleep 120")
    ring.write_config(ring={"run_budget": 60, "stall_threshold": 90})
    ring.roster(f"long {ring.agents_dir}/long.sh")
    return pid_file


@pytest.mark.parametrize("step", [86400, -86400])
def test_a_clock_step_never_makes_a_live_driver_or_agent_look_dead(ring, tmp_path, step):
    shifted = _btime_shifted(tmp_path, step)
    pid_file = _long_run(ring)
    ring.start_driver()
    agent = int(line_written(pid_file, 20, message="agent running"))
    agent_ticks = procid.start_ticks(agent)
    r = subprocess.run(shifted + ring_cmd("status", "--json", *ring.common()), env=ring.env,
                       capture_output=True, text=True, timeout=60)
    doc = json.loads(r.stdout)
    assert doc["driver"]["health"] == "ok", (doc["driver"], r.stderr)
    assert doc["current"] and doc["current"]["agent"] == "long", doc["current"]
    assert [row["status"] for row in ring.runs()] == ["running"], "status reaped a live run"
    assert procid.same_process(agent, agent_ticks), "status killed the live agent"


@pytest.mark.parametrize("step", [86400, -86400])
def test_a_clock_step_never_makes_the_watcher_replace_a_live_driver(ring, tmp_path, step):
    shifted = _btime_shifted(tmp_path, step)
    pid_file = _long_run(ring)
    ring.start_driver()
    wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), 20, message="agent running")
    driver = ring.heartbeat()["pid"]
    w = ring.start(shifted + watch_cmd(*ring.common()))
    poll = ring.config["watch"]["poll_interval"]

    def watcher_polled_a_few_times():
        try:
            data = json.loads((ring.state / "ringwatch.json").read_text())
        except (OSError, ValueError):
            return None
        return data if data.get("last_poll_at") and data.get("driver", {}).get("pid") == driver else None
    wait_until(watcher_polled_a_few_times, 20, message="watcher adopted the driver")
    time.sleep(max(10 * poll, ring.config["watch"]["stale_after"] + 1))   # many polls, past stale_after
    data = json.loads((ring.state / "ringwatch.json").read_text())
    assert w.poll() is None, w.communicate()[1][-2000:]
    assert not data.get("restarts") and not data.get("gave_up"), data
    assert ring.heartbeat()["pid"] == driver
    assert [row["status"] for row in ring.runs()] == ["running"]
    w.send_signal(signal.SIGTERM)
    w.communicate(timeout=30)


def _container_shell(tmp_path):
    """argv prefix running a command as a root shell in a systemd-nspawn machine
    does: with another boot id mounted over the kernel's (nspawn gives each
    container boot its own), while the driver, like a unit under
    ``ProtectProc=invisible`` (a private procfs), reads the kernel's."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare for a private mount namespace")
    fake = tmp_path / "container-boot-id"
    fake.write_text("6048d050-2a1b-4e2b-b5d7-159f44ac4d83\n")
    prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c",
              f'mount --bind {fake} /proc/sys/kernel/random/boot_id && exec "$@"', "sh"]
    probe = subprocess.run(prefix + ["cat", "/proc/sys/kernel/random/boot_id"], capture_output=True, text=True,
                           timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot bind-mount over the boot id here: {probe.stderr.strip()[:200]}")
    assert probe.stdout == fake.read_text()
    return prefix


def test_a_shell_that_reads_another_boot_id_sees_the_live_driver_and_skips_its_run(ring, tmp_path):
    """Inside a container, a root shell's ``ringd status`` said ``driver DEAD`` for
    a live driver, and ``skip`` said no driver was running: the driver recorded
    the kernel's boot id, the shell read the container's. Both see the same pid
    namespace: that, the pid and the start ticks identify the driver."""
    shell = _container_shell(tmp_path)
    pid_file = _long_run(ring)
    ring.start_driver()
    agent = int(line_written(pid_file, 20, message="agent running"))
    hb = ring.heartbeat()
    assert hb["boot_view"] == "kernel" and hb["pid_ns"] == os.stat("/proc/self/ns/pid").st_ino
    r = subprocess.run(shell + ring_cmd("status", "--json", *ring.common()), env=ring.env,
                       capture_output=True, text=True, timeout=60)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["driver"]["health"] == "ok", (doc["driver"], r.stderr)
    assert doc["watcher"]["alive"] is False and doc["current"]["agent"] == "long"
    assert [row["status"] for row in ring.runs()] == ["running"], "status reaped a live run"
    r = subprocess.run(shell + ring_cmd("skip", *ring.common()), env=ring.env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, (r.stdout, r.stderr)
    wait_until(lambda: ring.runs() and ring.runs()[0]["status"] == "skipped", 10, message="the run skipped")
    wait_until(lambda: procid.start_ticks(agent) is None, 10, message="the agent ended")


def test_a_run_of_an_earlier_boot_is_reaped_without_killing_whoever_has_its_pid_now(ring):
    """After a reboot a ``running`` row names its dead driver and agent by pid and
    start tick, and a deterministic boot can hand both to other processes. The
    reaper (here ``ringd status``) killed such a stranger's whole group as the
    run's leftover. Its last driver's heartbeat says which boot the journal's
    processes ran in: those of another boot name nobody now."""
    import sqlite3
    import time
    ring.roster("a true")
    assert ring.start_driver("--once").wait(timeout=30) == 0
    stranger = ring.start(["sleep", "120"])
    ticks = wait_until(lambda: procid.start_ticks(stranger.pid), 5, message="the stranger started")
    con = sqlite3.connect(str(ring.journal_path))
    with con:
        con.execute("INSERT INTO runs(agent, position, status, started_at, driver_pid, driver_start, pid, pid_start)"
                    " VALUES ('a', 0, 'running', ?, ?, ?, ?, ?)",
                    (time.time(), stranger.pid, ticks + 1, stranger.pid, ticks))   # its driver: gone
    con.close()
    hb_path = ring.state / "ringd.heartbeat"
    hb = json.loads(hb_path.read_text())
    hb.update(pid=stranger.pid, pid_start=ticks, stopped=False, boot_id="00000000-0000-0000-0000-000000000000")
    hb_path.write_text(json.dumps(hb))
    r = subprocess.run(ring_cmd("status", "--json", *ring.common()), env=ring.env,
                       capture_output=True, text=True, timeout=60)
    doc = json.loads(r.stdout)
    assert doc["driver"]["health"] == "dead", (doc["driver"], r.stderr)
    assert [row["status"] for row in ring.runs()][-1] == "interrupted", "the earlier boot's run was not reaped"
    assert procid.same_process(stranger.pid, ticks), "the reaper killed a process that only has the run's pid now"


def test_the_journals_boot_is_this_one_while_another_process_holds_the_drivers_lock(tmp_path):
    """journal_boot: the boot a ``running`` row's processes ran in is its last
    driver's, as the heartbeat says - unless another live process holds the
    driver's lock: that driver is of this boot, and so is any running row (it
    reaped the older ones at its start), though it could not write its
    heartbeat yet. The caller's own lock (a driver reaping at its start) is no
    such proof."""
    from ringd.host.heartbeat import journal_boot
    from ringd.host.lock import KernelLock
    (tmp_path / "ringd.heartbeat").write_text(json.dumps({"pid": 1, "pid_start": 1, "boot_id": "an-earlier-boot"}))
    (tmp_path / "ringd.lock").touch()
    assert journal_boot(tmp_path)["boot_id"] == "an-earlier-boot"
    mine = KernelLock(tmp_path / "ringd.lock").acquire()
    try:
        assert journal_boot(tmp_path)["boot_id"] == "an-earlier-boot"   # our own lock proves nothing
    finally:
        mine.release()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; "
                               "fcntl.flock(os.open(sys.argv[1], os.O_RDWR), fcntl.LOCK_EX); time.sleep(60)",
                               str(tmp_path / "ringd.lock")])
    try:
        wait_until(lambda: journal_boot(tmp_path) is None, 10, message="another process holds the lock")
    finally:
        holder.kill()
        holder.wait()
    assert journal_boot(tmp_path)["boot_id"] == "an-earlier-boot"
