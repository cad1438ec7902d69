"""Process containment (issue 9 #5): nothing a run started outlives it, whatever
its session, process group or environment.

- Subreaper rule (every driver): at the end of a run, every live descendant of
  the driver except its own helpers is killed - `setsid env -i sleep 300 &`
  included, which carries no key at all.
- Per-run cgroup v2 (ringd.host.cgroup, root here): the agent joins its cgroup
  before it can fork, the run ends with cgroup.kill, cpu.stat gives its CPU
  time, the cgroup is removed; a reaper kills a dead driver's run cgroup.
Real processes throughout.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import freezing_agent, line_written, wait_until
from ringd.host import cgroup
from ringd.host import procid
from ringd.host import proctree
from ringd.core import runstate
from ringd.host.env import RealEnv

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process semantics")


def _gone(pid: int) -> bool:
    return procid.start_ticks(pid) is None


def _kill_if_alive(pid: int, ticks) -> None:
    if ticks is not None and procid.same_process(pid, ticks):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("ending", ["exit 0", "past its budget"])
def test_a_grandchild_that_leaves_the_session_and_clears_its_environment_dies_with_the_run(ring, ending):
    pid_file = ring.base / "escaped.pid"
    # (the short sleep: the escapee has exec'd `env -i sleep` - shed its key - before the run ends)
    tail = "sleep 0.3; exit 0" if ending == "exit 0" else "exec sleep 60"
    ring.agent("a", f"""
        setsid env -i sleep 300 &
        echo $! > {pid_file}
        {tail}
        """)
    ring.write_config(ring={"run_budget": 0.5, "stall_threshold": 1.5})
    ring.roster(f"a {ring.agents_dir}/a.sh")
    drv = ring.start_driver()
    escaped = int(line_written(pid_file, 20, message="escapee started"))
    ticks = procid.start_ticks(escaped)
    try:

        def keyless():   # it has exec'd `sleep` with an empty environment (or is gone already)
            try:
                return psutil.Process(escaped).environ() == {} or not procid.same_process(escaped, ticks)
            except psutil.Error:
                return True
        wait_until(keyless, 10, message="no key to find it by")
        wait_until(lambda: [r for r in ring.runs() if r["status"] != "running"], 20, message="first run closed")
        assert _gone(escaped) or not procid.same_process(escaped, ticks), \
            "the escaped grandchild outlived its run"
    finally:
        _kill_if_alive(escaped, ticks)
        drv.send_signal(signal.SIGTERM)
        drv.communicate(timeout=30)


# --- cgroup v2 ------------------------------------------------------------------------

@pytest.fixture
def containment(tmp_path):
    c = cgroup.detect(tmp_path)
    if c.kind != "cgroup":
        pytest.skip(f"no usable cgroup v2 here: {c.reason}")
    yield c
    for leftover in c.parent.glob(f"{c.prefix}-*"):   # a failed test must not leave cgroups behind
        cg = cgroup.RunCgroup(leftover)
        cg.kill()
        cg.remove()


def _spawn_in(containment, cg: cgroup.RunCgroup, script: str, tmp_path: Path) -> proctree.Child:
    log = os.open(tmp_path / "out.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        child, held_by = containment.spawn_into(cg, lambda: proctree.spawn(
            ["sh", "-c", script], cwd=str(tmp_path), env={"PATH": os.environ["PATH"]}, stdout_fd=log))
    finally:
        os.close(log)
    assert held_by is cg and os.getpid() not in cg.pids(), "we stepped back out"
    return child


def _collect(child: proctree.Child) -> None:
    """Bounded wait for our killed child's exit, then reap it (unless already reaped)."""
    assert proctree.wait_exit(child.pidfd, 10), f"pid {child.pid} did not exit"
    try:
        os.waitpid(child.pid, 0)
    except ChildProcessError:
        pass


def test_a_run_cgroup_holds_everything_the_agent_forks_and_cgroup_kill_ends_it(containment, tmp_path):
    cg = containment.create(41)
    assert cg is not None and cg.path.is_dir()
    assert (tmp_path / cgroup.RECORD).exists(), "the record a reaper reads"
    pids = tmp_path / "pids"
    child = _spawn_in(containment, cg, f"""
        setsid env -i sleep 300 & echo $! >> {pids}
        ( sleep 300 & echo $! >> {pids} ) &
        {sys.executable} -c "import time; t = time.process_time(); any(iter(lambda: time.process_time() - t > 0.3, True))"
        echo done >> {pids}
        exec sleep 300
        """, tmp_path)
    wait_until(lambda: pids.exists() and "done" in pids.read_text(), 20, message="agent forked and burned CPU")
    escaped = [int(x) for x in pids.read_text().split() if x.isascii() and x.isdigit()]
    assert len(escaped) == 2
    assert set(escaped) | {child.pid} <= set(cg.pids()), "everything it forked is in its cgroup"
    cpu = containment.finish(cg, reap=lambda: proctree.reap_zombie_children())
    _collect(child)
    child.close()
    for pid in escaped + [child.pid]:
        wait_until(lambda: _gone(pid), 10, message=f"pid {pid} killed")
    assert cpu is not None and cpu >= 0.3, cpu   # the busy loop burned 0.3 s of CPU, whatever the load
    assert not cg.path.exists(), "the run's cgroup is removed"


def test_the_agent_is_in_its_cgroup_before_it_can_fork(containment, tmp_path):
    cg = containment.create(42)
    child = _spawn_in(containment, cg, "cat /proc/self/cgroup > cg.txt; exec sleep 300", tmp_path)
    wait_until(lambda: (tmp_path / "cg.txt").exists() and (tmp_path / "cg.txt").read_text(), 10,
               message="agent wrote its cgroup")
    line = [x for x in (tmp_path / "cg.txt").read_text().splitlines() if x.startswith("0::")][0]
    assert line.endswith(f"/{containment.prefix}-run-42"), line   # its first command already ran inside
    containment.finish(cg, reap=lambda: proctree.reap_zombie_children())
    _collect(child)
    child.close()


def test_a_reaper_kills_the_run_cgroup_of_a_dead_driver(containment, tmp_path):
    cg = containment.create(43)
    pids = tmp_path / "pids"
    child = _spawn_in(containment, cg, f"setsid env -i sleep 300 & echo $! >> {pids}; exec sleep 300", tmp_path)
    escaped = int(line_written(pids, 10, message="escapee started"))
    # another process (a reaper: `ringd status`, the next driver) knows only the state dir and run id
    assert cgroup.kill_recorded(tmp_path, 99) == 0, "another run's record is not this run's"
    assert cgroup.kill_recorded(tmp_path, 43) == 2
    _collect(child)
    child.close()
    wait_until(lambda: _gone(escaped), 10, message="escapee killed")
    assert not cg.path.exists()
    assert cgroup.kill_recorded(tmp_path, 43) == 0, "an ended run's cgroup is gone"


def test_two_rings_never_share_a_cgroup(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert cgroup.ring_prefix(a) != cgroup.ring_prefix(b)
    assert cgroup.ring_prefix(a) == cgroup.ring_prefix(Path(str(a)))


STRANDED = r"""
import json, os, sys
from pathlib import Path
from ringd.host import cgroup
from ringd.host import proctree
c = cgroup.detect(Path(sys.argv[1]))
cg = c.create(44)
home = c.parent
c.parent = Path("/nonexistent")   # stepping back home will fail
null = os.open(os.devnull, os.O_WRONLY)   # not our stdout: the test reads it to its end
child, held_by = c.spawn_into(cg, lambda: proctree.spawn(["sleep", "300"], cwd="/", env={"PATH": os.environ["PATH"]},
                                                         stdout_fd=null))
print(json.dumps({"held_by": held_by is not None, "kind": c.kind, "stranded": c.stranded,
                  "me_inside": os.getpid() in cg.pids(), "child": child.pid, "ticks": child.start_time,
                  "cg": str(cg.path)}))
"""


def test_a_driver_that_cannot_step_back_out_never_kills_the_cgroup_it_is_in(containment, tmp_path):
    """Should the driver be stranded in a run's cgroup, killing that cgroup would
    kill the driver: the run is left to the subreaper rule, and so is every
    later run. (In a child process: the test's own process never strands.)"""
    import json
    proc = subprocess.run([sys.executable, "-c", STRANDED, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, cwd=str(Path(__file__).resolve().parents[2]),
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    try:
        assert out["me_inside"] and not out["held_by"] and out["kind"] == "subreaper"
        assert "cannot leave" in out["stranded"]
    finally:
        _kill_if_alive(out["child"], out["ticks"])
        cg = cgroup.RunCgroup(Path(out["cg"]))
        cg.kill()
        cg.remove()


STRANDED_PROBE = r"""
import errno, json, os, sys
from pathlib import Path
from ringd.host import cgroup
real = cgroup._write_pid0

def home_refuses(procs):
    if not os.path.basename(os.path.dirname(procs)).startswith("ring-"):   # our own cgroup, not a ring's
        raise OSError(errno.EBUSY, "Device or resource busy")
    real(procs)
cgroup._write_pid0 = home_refuses
c = cgroup.detect(Path(sys.argv[1]))
print(json.dumps({"kind": c.kind, "reason": c.reason}))
"""


def test_start_up_never_kills_the_probe_cgroup_it_could_not_leave(containment, tmp_path):
    """detect() steps into a probe cgroup and back out; should it fail to get
    out, the probe is left alone (killing it would kill the driver) and the
    driver runs with the subreaper rule."""
    import json
    proc = subprocess.run([sys.executable, "-c", STRANDED_PROBE, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, f"the driver killed itself: exit {proc.returncode} {proc.stderr[-500:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["kind"] == "subreaper" and "busy" in out["reason"].lower(), out


def _open_in(folder: str) -> int:
    """How many of our descriptors point into ``folder``."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(folder + "/")
        except OSError:
            pass
    return n


def test_no_cgroup_procs_file_reaches_an_agent_and_only_our_own_is_kept_open(containment, tmp_path):
    others = _open_in(str(containment.parent))   # (other tests' containments in this process)
    cg = containment.create(43)
    assert _open_in(cg.dir) == 0
    child = _spawn_in(containment, cg, "ls -l /proc/self/fd > fds.txt; exec sleep 300", tmp_path)
    assert _open_in(cg.dir) == 0, "the join's write closed it"
    assert _open_in(str(containment.parent)) == others + 1, "our own cgroup.procs, kept for the next step out"
    wait_until(lambda: (tmp_path / "fds.txt").exists() and "fds.txt" in (tmp_path / "fds.txt").read_text(), 10,
               message="agent listed its descriptors")
    assert "cgroup.procs" not in (tmp_path / "fds.txt").read_text(), "the agent inherits neither"
    containment.finish(cg, reap=lambda: proctree.reap_zombie_children())
    _collect(child)
    child.close()
    containment.close()
    assert _open_in(str(containment.parent)) == others



STANDIN_DRIVER = r"""
import sys, time
with open(sys.stdin.readline().strip(), "w") as f:   # the run's cgroup.procs; "0": ourselves, as a
    f.write("0")                                      # driver steps in for a spawn
print("inside", flush=True)
time.sleep(300)
"""


def test_force_fail_never_kills_a_live_driver_that_is_inside_its_runs_cgroup(containment, tmp_path):
    """A driver is in its run's cgroup for the instant of each spawn (the agent is
    born there), and for good if it could not step back out. An operator's
    force-fail of that run kills everything else in the cgroup, one by one,
    never the driver (a cgroup.kill would kill it too); the driver removes the
    cgroup at the run's end. Real `ringd force-fail`, real processes; the
    driver is a stand-in that holds the run's row."""
    from ringd.journal.sqlite import Journal
    standin = subprocess.Popen([sys.executable, "-c", STANDIN_DRIVER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        journal = Journal.open(tmp_path)
        with journal.transaction() as tx:
            run_id = tx.start_run("a", 0, now=1.0, run_budget=60, stall_threshold=90, driver_pid=standin.pid,
                                  driver_start=procid.start_ticks(standin.pid))
        journal.close()
        cg = containment.create(run_id)
        pids = tmp_path / "pids"
        child = _spawn_in(containment, cg, f"setsid env -i sleep 300 & echo $! >> {pids}; exec sleep 300", tmp_path)
        escaped = int(line_written(pids, 10, message="escapee started"))
        standin.stdin.write(f"{cg.dir}/cgroup.procs\n")
        standin.stdin.flush()
        assert standin.stdout.readline() == "inside\n"
        res = subprocess.run([sys.executable, "-m", "ringd", "force-fail", "a", "--state", str(tmp_path)],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        assert res.returncode == 0, res.stderr
        _collect(child)
        child.close()
        wait_until(lambda: _gone(escaped), 10, message="escapee killed")
        assert standin.poll() is None, "force-fail killed the driver"
        assert cg.pids() == [standin.pid] and cg.path.is_dir(), "left for the driver to remove"
    finally:
        if standin.poll() is None:
            standin.kill()   # by pid: our own child
        standin.wait(timeout=10)


def test_start_up_sweeps_a_dead_drivers_run_and_probe_cgroups_and_no_other_rings(containment, tmp_path):
    """A driver killed while it proved containment leaves its probe cgroup; the
    next driver (holding the lock: no other driver of this ring lives) removes
    it with the run cgroups, and never touches another ring's."""
    other = cgroup.detect(tmp_path / "other-ring")
    theirs = other.parent / f"{other.prefix}-probe-1"
    mine = [containment.parent / f"{containment.prefix}-{kind}" for kind in ("probe-1", "run-7")]
    for d in mine + [theirs]:
        d.mkdir()
    try:
        assert cgroup.sweep(tmp_path, also=containment.parent) == 2
        assert not any(d.exists() for d in mine) and theirs.is_dir()
    finally:
        for d in mine + [theirs]:
            if d.exists():
                d.rmdir()


def test_the_start_up_sweep_waits_one_bound_in_all_on_cgroups_sigkill_cannot_empty(containment, tmp_path):
    """A dead driver's run cgroups that hold processes SIGKILL cannot end (a hung
    mount; here a frozen cgroup v1 freezer) cannot be removed. The sweep waited
    cgroup.KILL_WAIT for each to empty and as long again for its rmdir: 10 s a
    cgroup before the next driver started (16 of them: over 2.5 min, past a
    watcher's patience). It now waits one bound in all and leaves them."""
    if os.geteuid() != 0 or not (_FREEZER_V1 / "cgroup.procs").exists():
        pytest.skip("needs root and a cgroup v1 freezer hierarchy")
    ice = _FREEZER_V1 / f"ring-test-ice-sweep-{os.getpid()}"
    ice.mkdir()
    mine = [containment.parent / f"{containment.prefix}-run-{i}" for i in (1, 2)]
    sleepers = []
    try:
        for d in mine:
            d.mkdir()
            sleeper = subprocess.Popen(["sleep", "300"])
            sleepers.append(sleeper)
            (d / "cgroup.procs").write_text(str(sleeper.pid))
            (ice / "cgroup.procs").write_text(str(sleeper.pid))
        (ice / "freezer.state").write_text("FROZEN")
        t0 = time.monotonic()
        assert cgroup.sweep(tmp_path, also=containment.parent) == 0
        took = time.monotonic() - t0
        assert took < cgroup.KILL_WAIT + 3.0, f"the sweep took {took:.1f}s"
        assert all(d.is_dir() for d in mine)
    finally:
        _thaw(ice)   # they die of the SIGKILL they hold
        for sleeper in sleepers:
            sleeper.kill()   # by pid: our own children
            sleeper.wait(timeout=10)


@pytest.mark.parametrize("pidfd", ["pidfd_open", "no pidfd_open (Linux before 5.3)"])
def test_killing_all_but_the_driver_kills_the_rest_of_the_cgroup(containment, tmp_path, monkeypatch, pidfd):
    cg = containment.create(46)
    pids = tmp_path / "pids"
    child = _spawn_in(containment, cg, f"setsid env -i sleep 300 & echo $! >> {pids}; exec sleep 300", tmp_path)
    escaped = int(line_written(pids, 10, message="escapee started"))
    if pidfd != "pidfd_open":
        def enosys(pid, flags=0):
            raise OSError(38, "Function not implemented")
        monkeypatch.setattr(os, "pidfd_open", enosys)
    me = (os.getpid(), procid.start_ticks(os.getpid()))
    assert cg.kill(spare=me, reap=lambda: proctree.reap_zombie_children()), "emptied"
    monkeypatch.undo()
    _collect(child)
    child.close()
    wait_until(lambda: _gone(escaped), 10, message="escapee killed")
    containment.finish(cg)
    assert not cg.path.exists()


# --- the reaper and a recycled group id -------------------------------------------------

_RECYCLE = r'''
"""pid 1 of a fresh pid namespace: a dead driver's run whose leader, reaped at
once by a subreaper not ours, leaves its pid - its group id - to a new session."""
import ctypes, json, os, subprocess, sys, tempfile, time
from pathlib import Path
from ringd.host import procid
from ringd.loops import reaper
from ringd.core.records import RunRow

r, w = os.pipe()
if os.fork() == 0:   # the run's old parent: reaps the leader the moment it dies
    os.close(r)
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER
    leader = subprocess.Popen(["sleep", "300"], start_new_session=True)
    # Start ticks count 10 ms: a stranger started in the leader's own tick would be
    # the leader by every identity there is (pid and start time), as no real pid
    # can be, reused within 10 ms of its first use. It was, once in a loaded run.
    time.sleep(0.05)
    os.write(w, b"%d\n" % leader.pid)
    leader.wait()
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:   # the next pid is the leader's
        f.write(str(leader.pid - 1))
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    os.write(w, b"%d\n" % stranger.pid)
    stranger.wait()
    os._exit(0)
os.close(w)
f = os.fdopen(r)
leader = int(f.readline())
row = RunRow(id=7, agent="a", position=0, status="running", started_at=time.time(), ended_at=None,
             duration=None, exit_code=None, signal=None, reason=None, pid=leader,
             pid_start=procid.start_ticks(leader), run_budget=1, stall_threshold=2, log_path=None,
             driver_pid=2 ** 23, driver_start=1)
reaper.kill_orphan(Path(tempfile.mkdtemp()), row)
stranger = int(f.readline())
ticks = procid.start_ticks(stranger)
deadline = time.monotonic() + 1.0   # any kill was sent before kill_orphan returned: headroom to land
while procid.same_process(stranger, ticks) and time.monotonic() < deadline:
    time.sleep(0.02)
print(json.dumps({"leader": leader, "stranger": stranger, "alive": procid.same_process(stranger, ticks)}))
'''


def test_the_reaper_never_kills_a_new_session_that_got_a_dead_leaders_pid_as_its_group_id(tmp_path):
    """The reaper signalled the run's group id again after it killed the leader
    (and went on matching processes by it), but the leader of a dead driver's
    run is no child of the reaper's: reaped at once elsewhere, its pid may be
    the next new session's group id. Forced here in a private pid namespace
    (ns_last_pid): the stranger lives, the leader does not."""
    out = _in_a_private_pid_namespace(tmp_path / "recycle.py", _RECYCLE)
    assert out["stranger"] == out["leader"], f"the pid was not recycled: {out}"
    assert out["alive"], "the reaper killed a new session that merely reused the dead leader's group id"


# --- a leader that SIGKILL cannot end ---------------------------------------------------

_FREEZER_V1 = Path("/sys/fs/cgroup/freezer")


def _thaw(ice: Path) -> None:
    """Thaw a test's freezer cgroup until it is empty and remove it: what it
    held dies of the SIGKILL it holds, or runs on to its exit. Thawed again at
    each look: an agent between its two echos freezes it after a thaw."""
    def thawed_and_empty():
        (ice / "freezer.state").write_text("THAWED")
        return not (ice / "cgroup.procs").read_text().split()
    wait_until(thawed_and_empty, 10, message="the freezer cgroup thawed and empty")
    ice.rmdir()


def test_a_leader_that_sigkill_cannot_end_costs_one_slot_never_the_ring(ring):
    """A process in uninterruptible sleep (a hung mount; here: a frozen cgroup v1
    freezer, which holds even SIGKILL) does not die of the stall's SIGKILL. The
    run waited for its exit forever and the ring stood still. Now the run is
    closed `stalled` a bounded while after the kill, saying so, the next agent
    runs, and the driver still stops cleanly; the leader, once thawed, dies of
    the SIGKILL it holds and is collected."""
    if os.geteuid() != 0 or not (_FREEZER_V1 / "cgroup.procs").exists():
        pytest.skip("needs root and a cgroup v1 freezer hierarchy")
    ice = _FREEZER_V1 / f"ring-test-ice-{os.getpid()}"
    ice.mkdir()
    leader = drv = None
    try:
        freezing_agent(ring, "ice", ice)
        ring.agent("next", "exit 0")
        ring.write_config(ring={"run_budget": 0.3, "stall_threshold": 0.6})
        ring.roster(f"ice {ring.agents_dir}/ice.sh", f"next {ring.agents_dir}/next.sh")
        drv = ring.start_driver()
        leader = int(wait_until(lambda: (ice / "cgroup.procs").read_text().split(), 20,
                                message="the agent froze itself")[0])
        # the stall (0.6 s), the kill's bounds, runstate.UNKILLABLE_WAIT (5 s): headroom for a loaded box
        wait_until(lambda: [r for r in ring.runs() if r["agent"] == "next" and r["status"] == "ok"], 60,
                   message="the next agent ran")
        first = ring.runs()[0]
        assert first["status"] == "stalled" and "did not die of SIGKILL" in first["reason"], dict(first)
        assert procid.start_ticks(leader) is not None, "the frozen leader still lives (the test's premise)"
        # the slot it costs: the stall, the leader's SIGKILL wait (2 s) overlapping UNKILLABLE_WAIT
        # (5 s), and nothing more - its cgroup, which the frozen leader keeps populated, was
        # waited on for cgroup.KILL_WAIT (5 s) on top: 10.6 s a slot
        assert first["duration"] < runstate.UNKILLABLE_WAIT + 3.0, dict(first)
        # a stop: the run in flight (ice's next turn, frozen too) ends within its bounds, and
        # the driver's exit waits on neither frozen cgroup (5 s each, 20 s in all, before)
        t0 = time.monotonic()
        drv.send_signal(signal.SIGTERM)
        assert drv.wait(timeout=30) == 0
        took = time.monotonic() - t0
        assert took < runstate.STOP_GRACE + runstate.UNKILLABLE_WAIT + 4.0, f"the stop took {took:.1f}s"
    finally:
        if drv is not None and drv.poll() is None:   # (a failed assert): no further turn freezes itself
            drv.kill()
            drv.wait(timeout=10)
        _thaw(ice)
        if leader is not None:
            wait_until(lambda: procid.start_ticks(leader) is None, 10, message="the thawed leader gone")



def test_a_descendant_that_sigkill_cannot_end_costs_its_own_run_only(ring):
    """A run's background process in uninterruptible sleep (here: a frozen
    cgroup v1 freezer) outlives its SIGKILL. It is the driver's descendant
    still, so every later run's tree kill listed it again, spent its whole
    bound (3 s) signalling it and said it 'left ~300 process(es) behind': each
    /bin/true hop of the ring cost 3 s from then on. Now it is spared by later
    runs' kills once it has outlived one, and said once."""
    if os.geteuid() != 0 or not (_FREEZER_V1 / "cgroup.procs").exists():
        pytest.skip("needs root and a cgroup v1 freezer hierarchy")
    ice = _FREEZER_V1 / f"ring-test-ice-bg-{os.getpid()}"
    ice.mkdir()
    pidfile = ring.base / "frozen.pid"
    frozen = None
    try:
        ring.agent("ice", f"""
            sleep 300 &
            echo $! > {ice}/cgroup.procs
            echo FROZEN > {ice}/freezer.state
            echo $! > {pidfile}
            exit 0
            """)
        ring.roster(f"ice {ring.agents_dir}/ice.sh", "t1 /bin/true", "t2 /bin/true", "t3 /bin/true")
        drv = ring.start_driver("--once")
        frozen = int(wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), 20,
                                message="a background process frozen"))
        assert drv.wait(timeout=60) == 0
        rows = {r["agent"]: r for r in ring.runs()}
        assert [rows[a]["status"] for a in ("ice", "t1", "t2", "t3")] == ["ok"] * 4, [dict(r) for r in rows.values()]
        # its own run pays the tree kill's bound (3 s) for the process SIGKILL cannot end, and no
        # more: its cgroup, kept populated by that process, was waited on for cgroup.KILL_WAIT (5 s) too
        assert rows["ice"]["duration"] < 3.0 + 3.0, dict(rows["ice"])
        slow = {a: rows[a]["duration"] for a in ("t1", "t2", "t3") if rows[a]["duration"] > 1.5}
        assert not slow, f"later runs paid for the unkillable process: {slow}"
        err = drv.communicate(timeout=10)[1].decode()
        assert err.count("did not die of SIGKILL") == 1, err
        assert "left 1 process(es) behind" in err and "t1 left" not in err, err
    finally:
        _thaw(ice)
        if frozen is not None:
            wait_until(lambda: procid.start_ticks(frozen) is None, 10, message="the thawed process gone")

# the run cgroup's end in the driver's effects (ringd.host.env): emptied at once, removed at the next wait

def test_an_ended_runs_cgroup_is_emptied_at_once_and_removed_at_the_next_wait(tmp_path):
    """The run's end reads its CPU time from an emptied cgroup; the rmdir waits
    for the driver's next wait (on a turning ring: while the next agent execs)."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    env = RealEnv(state, lambda m, level: None)
    cg = None
    try:
        cg = env.make_cgroup(7)
        if cg is None:
            pytest.skip(f"no run cgroups here ({env.containment.reason})")
        child = env.spawn(["/bin/sh", "-c", "sleep 300 & exit 0"], cwd="/", env={"PATH": os.environ["PATH"]},
                          stdout_fd=2, umask=0o077, run_cgroup=cg)
        assert proctree.wait_exit(child.pidfd, 20)
        assert env.exit_status(child) == (0, None)
        env.reap(child)
        assert child.cpu_seconds is not None and child.cgroup is None
        assert os.path.isdir(cg.dir) and not cg.populated()   # the orphaned sleep was killed with it
        env.wait(0)
        assert not os.path.exists(cg.dir)
    finally:
        if cg is not None and os.path.isdir(cg.dir):   # a failed test leaves no sleep behind
            cg.kill()
            cg.remove()
        env.close()


def test_a_cgroup_that_cannot_be_removed_yet_never_holds_up_a_wait(tmp_path):
    """The rmdir of an ended run's cgroup is tried once per wait: while the kernel
    still holds it (here: a process in it), the wait goes on at once - it may be
    the wait that supervises the next agent - and the rmdir is tried again later."""
    import time
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    env = RealEnv(state, lambda m, level: None)
    cg, sleeper = None, None
    try:
        cg = env.make_cgroup(8)
        if cg is None:
            pytest.skip(f"no run cgroups here ({env.containment.reason})")
        sleeper = subprocess.Popen(["sleep", "300"])
        with open(f"{cg.dir}/cgroup.procs", "w") as f:
            f.write(str(sleeper.pid))
        env._spent_cgroups.append(cg)   # as RealEnv.reap leaves it, but still busy
        t0 = time.monotonic()
        env.wait(0)
        assert time.monotonic() - t0 < 2.5   # a patient rmdir would retry for KILL_WAIT (5 s)
        assert os.path.isdir(cg.dir)
        sleeper.kill()
        sleeper.wait(10)
        deadline = time.monotonic() + 10
        while os.path.isdir(cg.dir) and time.monotonic() < deadline:   # bounded: released by the kernel soon
            env.wait(0.05)
        assert not os.path.exists(cg.dir)
    finally:
        if sleeper is not None and sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait(10)
        if cg is not None and os.path.isdir(cg.dir):
            cg.kill()
            cg.remove()
        env.close()


def _run_cgroup_env(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    env = RealEnv(state, lambda m, level: None)
    if env.make_cgroup(7) is None:
        env.close()
        pytest.skip(f"no run cgroups here ({env.containment.reason})")
    return env


def _run_to_its_end(env, cg, script: str = "exit 0"):
    child = env.spawn(["/bin/sh", "-c", script], cwd="/", env={"PATH": os.environ["PATH"]},
                      stdout_fd=2, umask=0o077, run_cgroup=cg)
    env.wait(0)   # the hop's first wait, while its agent runs
    assert proctree.wait_exit(child.pidfd, 20)
    env.reap(child)
    return child


def test_the_next_runs_cgroup_is_made_while_this_runs_agent_runs_and_the_next_run_takes_it(tmp_path):
    """The mkdir (and the opens of the files a run's start and end touch) of the
    likely next run's cgroup (this run's id + 1) happen at a wait, while an agent
    runs, not between two runs; the next run takes that very directory."""
    env = _run_cgroup_env(tmp_path)
    try:
        cg7 = env.containment.create(7)   # (made above: the same directory)
        _run_to_its_end(env, cg7)
        ahead = f"{env.containment.parent}/{env.containment.prefix}-run-8"
        assert os.path.isdir(ahead), "made at the wait while run 7's agent ran"
        ino = os.stat(ahead).st_ino
        cg8 = env.make_cgroup(8)
        assert cg8 is not None and cg8.dir == ahead and os.stat(ahead).st_ino == ino, "taken, not made again"
        out = tmp_path / "cg.txt"
        child = _run_to_its_end(env, cg8, f"cat /proc/self/cgroup > {out}")
        assert any(line.endswith("-run-8") for line in out.read_text().splitlines() if line.startswith("0::"))
        assert child.cpu_seconds is not None   # read through cpu.stat opened ahead
        env.wait(0)
        assert not os.path.exists(ahead), "removed once its run ended"
        assert os.path.isdir(f"{env.containment.parent}/{env.containment.prefix}-run-9")
    finally:
        env.close()
    assert not list(env.containment.parent.glob(f"{env.containment.prefix}-run-*")), \
        "the driver's close removes the one made ahead"


def test_a_cgroup_made_ahead_for_an_id_no_run_takes_is_removed(tmp_path):
    """A turn skipped in between (a ``skipped`` row takes an id) or another
    driver's run: the next run's id is not the one guessed. Its cgroup is made
    then, and the one made ahead is removed at the next wait."""
    env = _run_cgroup_env(tmp_path)
    try:
        _run_to_its_end(env, env.containment.create(7))
        guessed = f"{env.containment.parent}/{env.containment.prefix}-run-8"
        assert os.path.isdir(guessed)
        cg = env.make_cgroup(10)
        assert cg is not None and cg.dir.endswith("-run-10") and os.path.isdir(cg.dir)
        env.wait(0)
        assert not os.path.exists(guessed)
        env.remove_cgroup(cg)
    finally:
        env.close()
    assert not list(env.containment.parent.glob(f"{env.containment.prefix}-run-*"))


def test_cgroup_files_opened_ahead_read_afresh_at_each_read(containment, tmp_path):
    """``cgroup.events`` and ``cpu.stat`` read through descriptors opened before the
    run started say what is true now, not what was true when they were opened."""
    cg = containment.create(43)
    cg.open_ahead()
    assert not cg.populated()
    child = _spawn_in(containment, cg, f"""
        {sys.executable} -c "import time; t = time.process_time(); any(iter(lambda: time.process_time() - t > 0.2, True))"
        exec sleep 300""", tmp_path)
    try:
        wait_until(lambda: (cg.cpu_seconds() or 0) >= 0.2, 20, message="cpu.stat read afresh")
        assert cg.populated()
    finally:
        cg.kill(reap=lambda: proctree.reap_zombie_children())
        _collect(child)
        child.close()
    assert not cg.populated(), "cgroup.events read afresh"
    cg.remove()
    assert not cg.path.exists()


# --- a pid recycled between the walk that lists it and the kill ---------------------------

_RECYCLE_IN_WALK = r'''
"""pid 1 of a fresh pid namespace: the driver lists a run's grandchild, which
dies and is reaped by its parent (a run process) before the kill; a helper's
new child takes its pid (ns_last_pid)."""
import json, os, signal, subprocess, time
from ringd.host import procid
from ringd.host import proctree

hr, hw = os.pipe()
sr, sw = os.pipe()
helper = os.fork()
if helper == 0:   # an alert helper of the driver's: forks the stranger when told which pid to take
    os.close(hw)
    os.close(sr)
    want = int(os.read(hr, 64))
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(want - 1))
    stranger = subprocess.Popen(["sleep", "300"])
    os.write(sw, b"%d" % stranger.pid)
    stranger.wait()
    os._exit(0)
proctree.register_helper(helper)
# the run: a shell that reaps its sleep, then blocks in a builtin (forks nothing more)
run = subprocess.Popen(["sh", "-c", "sleep 300; read x"], stdin=subprocess.PIPE, start_new_session=True)
deadline = time.monotonic() + 10
while not proctree._children_of(run.pid) and time.monotonic() < deadline:
    time.sleep(0.01)
grandchild = proctree._children_of(run.pid)[0]
out = {"grandchild": grandchild}
walk = proctree._children_of

def recycling_walk(pid):
    kids = walk(pid)
    if pid == run.pid and "stranger" not in out:
        os.kill(grandchild, signal.SIGKILL)   # dies, and its parent reaps it at once
        end = time.monotonic() + 10
        while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < end:
            time.sleep(0.005)
        os.write(hw, b"%d" % grandchild)
        out["stranger"] = int(os.read(sr, 64))
        out["ticks"] = procid.start_ticks(out["stranger"])
    return kids

proctree._children_of = recycling_walk
proctree.kill_run("", 0, None, scope="descendants")
time.sleep(0.2)   # a kill sent lands at once; headroom for a loaded box
out["alive"] = procid.same_process(out["stranger"], out["ticks"])
print(json.dumps(out))
'''


def test_a_pid_recycled_between_the_walk_and_the_kill_is_never_hit(tmp_path):
    """kill_run read each listed process's start ticks again just before its
    kill, so the identity check compared a recycled pid with itself: a run's
    process that died and was reaped by its parent after the walk listed it
    left its pid to a stranger (here a helper's child), which was killed.
    Forced in a private pid namespace (ns_last_pid)."""
    out = _in_a_private_pid_namespace(tmp_path / "recycle_walk.py", _RECYCLE_IN_WALK)
    assert out["stranger"] == out["grandchild"], f"the pid was not recycled: {out}"
    assert out["alive"], "the tree kill hit a stranger that got a listed run process's pid"


def _in_a_private_pid_namespace(script, text: str) -> dict:
    """Run the Python ``text`` as ``script`` as pid 1 of a private pid namespace
    (so it can force a pid's reuse with ns_last_pid); its JSON output."""
    import json
    import shutil
    from conftest import REPO
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare for a private pid namespace")
    script.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # the namespace's pid 1 takes every process in it along when it ends (or unshare dies: --kill-child)
    r = subprocess.run(["unshare", "-fp", "--mount-proc", "--kill-child", sys.executable, str(script)],
                       env=env, capture_output=True, text=True, timeout=60)
    if r.returncode != 0 and "unshare" in r.stderr:
        pytest.skip(f"no private pid namespace here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("reaper", ["the next driver", "ringd status"])
def test_a_dead_drivers_run_that_sigkill_cannot_end_is_reaped_within_one_bound(ring, reaper):
    """A driver SIGKILLed while its agent is in uninterruptible sleep (here: a
    frozen cgroup v1 freezer) leaves a run cgroup SIGKILL cannot empty. Its
    reaper waited for that cgroup to empty (cgroup.KILL_WAIT), for its rmdir
    (KILL_WAIT again) and for the agent's key walk (3 s): `ringd status` took
    13 s; the next driver, whose start-up sweep had waited KILL_WAIT for the same
    cgroup already, beat 18 s after its start, deaf to a stop meanwhile (a
    watcher's SIGTERM, 10 s, then SIGKILL). Now the orphan's kill waits one
    bound in all, and shares it with the sweep."""
    if os.geteuid() != 0 or not (_FREEZER_V1 / "cgroup.procs").exists():
        pytest.skip("needs root and a cgroup v1 freezer hierarchy")
    ice = _FREEZER_V1 / f"ring-test-ice-reap-{os.getpid()}"
    ice.mkdir()
    leader = None
    drivers = []
    try:
        freezing_agent(ring, "ice", ice)
        ring.write_config(ring={"run_budget": 60, "stall_threshold": 120})
        ring.roster(f"ice {ring.agents_dir}/ice.sh")
        first = ring.start_driver()
        drivers.append(first)
        leader = int(wait_until(lambda: (ice / "cgroup.procs").read_text().split(), 20,
                                message="the agent froze itself")[0])
        wait_until(lambda: [r for r in ring.runs() if r["pid"] == leader], 20, message="the agent's pid recorded")
        first.kill()   # by pid: the test's own child
        first.wait(timeout=10)
        t0 = time.monotonic()
        if reaper == "ringd status":
            ring.cli("status", "--json", timeout=60)
        else:
            second = ring.start_driver()
            drivers.append(second)
            wait_until(lambda: (ring.heartbeat() or {}).get("pid") == second.pid, 60,
                       message="the next driver's first beat")
        took = time.monotonic() - t0
        row = ring.runs()[0]
        assert row["status"] == "interrupted", dict(row)
        assert procid.start_ticks(leader) is not None, "the frozen leader still lives (the test's premise)"
        # one cgroup.KILL_WAIT for what SIGKILL cannot end, an interpreter's start and headroom
        assert took < cgroup.KILL_WAIT + 4.0, f"{reaper} took {took:.1f}s to reap it"
        if reaper == "the next driver":
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=30) == 0
    finally:
        for drv in drivers:
            if drv.poll() is None:
                drv.kill()   # by pid: the test's own child
                drv.wait(timeout=10)
        _thaw(ice)
        if leader is not None:
            wait_until(lambda: procid.start_ticks(leader) is None, 10, message="the thawed leader gone")
