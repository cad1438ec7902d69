"""Per-run cgroups wired into the driver (SPEC "Process containment"): a run's
escapees die with it, its CPU time is kept, status says which containment is
in force, and a reaper kills a dead driver's run cgroup - escapees that cleared
their environment included."""
import json
import os
import signal

import pytest

from conftest import line_written, wait_until
from ringd.host import cgroup

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="per-run cgroups need root here")


def _cgroup_capable(tmp_path) -> bool:
    return cgroup.detect(tmp_path).kind == "cgroup"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_runs_get_a_cgroup_cpu_time_and_status_says_so(ring, tmp_path):
    if not _cgroup_capable(tmp_path):
        pytest.skip("no writable cgroup2 here")
    ring.agent("burn", """
        python3 -c 'import time; t = time.process_time()
while time.process_time() - t < 0.3: pass'
    """)
    ring.roster(f"burn {ring.agents_dir}/burn.sh")
    ring.start_driver()
    row = wait_until(lambda: [r for r in ring.rows("SELECT * FROM runs WHERE status = 'ok'")], timeout=30,
                     message="a finished run")[0]
    assert row["cpu_seconds"] is not None and row["cpu_seconds"] >= 0.25, dict(row)
    hist = json.loads(ring.cli("history", "--json").stdout)
    assert any(h["cpu_seconds"] and h["cpu_seconds"] >= 0.25 for h in hist)
    doc = json.loads(ring.cli("status", "--json").stdout)
    assert doc["driver"]["containment"] == "cgroup"


def test_a_dead_drivers_escapee_without_its_environment_is_reaped_via_its_cgroup(ring, tmp_path):
    if not _cgroup_capable(tmp_path):
        pytest.skip("no writable cgroup2 here")
    pidfile = ring.base / "escapee.pid"
    ring.agent("esc", f"""
        setsid env -i /bin/sh -c 'echo $$ > {pidfile}; exec sleep 300' &
        exec sleep 300
    """)
    ring.roster(f"esc {ring.agents_dir}/esc.sh")
    ring.write_config(ring={"run_budget": 60, "stall_threshold": 90})
    driver = ring.start_driver()
    escapee = int(line_written(pidfile, 20, message="escapee started"))
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=10)
    assert _alive(escapee)   # a SIGKILLed driver ends nothing by itself
    # A reader reaps the dead driver's run: the escapee (no RING_* left in its
    # environment, re-parented to init) dies with the run's cgroup.
    ring.cli("status", "--json")
    wait_until(lambda: not _alive(escapee), timeout=10, message="escapee killed by the reaper")
    assert ring.rows("SELECT status FROM runs")[0]["status"] == "interrupted"


def test_a_starting_driver_removes_every_run_cgroup_a_dead_driver_left(ring, tmp_path):
    """Holding the lock with no other driver alive, every run cgroup of this ring
    is a dead driver's - also one whose row is no longer running (an operator
    closed it), which no reaper looks for: the driver kills what is in it and
    removes it at start-up."""
    c = cgroup.detect(ring.state)
    if c.kind != "cgroup":
        pytest.skip("no writable cgroup2 here")
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    left = c.create(987654)   # writes the record, as a driver's first run does
    import subprocess
    child, held_by = c.spawn_into(left, lambda: subprocess.Popen(["sleep", "300"], start_new_session=True))
    try:
        assert held_by is left and child.pid in left.pids()
        ring.start_driver()
        wait_until(lambda: not left.path.exists(), timeout=20, message="the stale run cgroup removed")
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.parametrize("ending", ["exit 0", "driver SIGKILLed, then reaped"])
def test_a_run_cgroup_the_agent_made_sub_cgroups_in_is_killed_and_removed_whole(ring, tmp_path, ending):
    """An agent running as root makes a sub-cgroup of its run's cgroup and moves
    a child into it: the child dies with the run (cgroup.kill takes the
    subtree), and the run's cgroup is removed all the same - rmdir never takes
    sub-cgroups along, so each is removed first, deepest first."""
    c = cgroup.detect(ring.state)
    if c.kind != "cgroup":
        pytest.skip("no writable cgroup2 here")
    pidfile = ring.base / "nested.pid"
    tail = "exit 0" if ending == "exit 0" else "exec sleep 300"
    ring.agent("nest", f"""
        cg={c.parent}/$(basename "$(sed -n 's/^0:://p' /proc/self/cgroup)")   # its run's cgroup
        mkdir -p "$cg/deep/deeper"
        sh -c 'echo 0 > "$1/deep/deeper/cgroup.procs" && echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile} \\
               && exec sleep 300' sh "$cg" &
        while [ ! -s {pidfile} ]; do sleep 0.01; done
        {tail}
    """)
    ring.roster(f"nest {ring.agents_dir}/nest.sh")
    ring.write_config(ring={"run_budget": 60, "stall_threshold": 90})
    run_cg = c.parent / f"{c.prefix}-run-1"
    nested = None
    try:
        driver = ring.start_driver(*(["--once"] if ending == "exit 0" else []))
        nested = int(wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=20,
                                message="the child in a sub-cgroup started"))
        assert (run_cg / "deep" / "deeper").is_dir()
        if ending == "exit 0":
            assert driver.wait(timeout=30) == 0
        else:
            os.kill(driver.pid, signal.SIGKILL)
            driver.wait(timeout=10)
            ring.cli("status", "--json")   # the reaper
        wait_until(lambda: not _alive(nested), timeout=10, message="the child in the sub-cgroup killed")
        wait_until(lambda: not run_cg.exists(), timeout=10, message="the run cgroup removed, sub-cgroups and all")
        assert ring.rows("SELECT status FROM runs")[0]["status"] == ("ok" if ending == "exit 0" else "interrupted")
    finally:
        if nested is not None and _alive(nested):
            os.kill(nested, signal.SIGKILL)
        if nested is not None:
            wait_until(lambda: not _alive(nested), timeout=10, message="the nested child gone")
        for sub in (run_cg / "deep" / "deeper", run_cg / "deep", run_cg):   # a failed test leaves no cgroup
            try:
                sub.rmdir()
            except OSError:
                pass


@pytest.mark.parametrize("escape", ["leaves the run's cgroup", "its own pid namespace"])
def test_an_escapee_out_of_the_cgroup_or_in_a_pid_namespace_dies_with_the_run(ring, tmp_path, escape):
    """cgroup.kill misses a process the agent (as root) moved out of its run's
    cgroup; the driver's own rule - every live descendant but its helpers -
    does not. A pid namespace (`unshare -fp`) is still a subtree of the driver's."""
    import shutil
    c = cgroup.detect(ring.state)
    if c.kind != "cgroup" or not shutil.which("unshare") or not shutil.which("pgrep"):
        pytest.skip("no writable cgroup2 (or no unshare, pgrep) here")
    pidfile = ring.base / "escapee.pid"
    if escape == "leaves the run's cgroup":
        body = (f"setsid env -i /bin/sh -c 'echo 0 > {c.parent}/cgroup.procs && echo $$ > {pidfile}.tmp"
                f" && mv {pidfile}.tmp {pidfile} && exec sleep 300' &")
    else:   # its host pid: the one child of unshare (setsid and env exec in place)
        body = (f"unshare -fp setsid env -i sleep 300 &\n"
                f"until pgrep -P $! > {pidfile}.tmp; do sleep 0.01; done; mv {pidfile}.tmp {pidfile}")
    ring.agent("esc", body + f"\nwhile [ ! -s {pidfile} ]; do sleep 0.01; done\nexit 0\n")
    ring.roster(f"esc {ring.agents_dir}/esc.sh")
    escapee = None
    try:
        drv = ring.start_driver("--once")
        escapee = int(wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), 20,
                                 message="the escapee started"))
        assert drv.wait(timeout=30) == 0
        wait_until(lambda: not _alive(escapee), timeout=10, message="the escapee killed with its run")
        assert ring.rows("SELECT status FROM runs")[0]["status"] == "ok"
    finally:
        if escapee is not None and _alive(escapee):
            os.kill(escapee, signal.SIGKILL)
