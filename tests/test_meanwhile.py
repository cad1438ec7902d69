"""The driver's helper thread (ringd.meanwhile): a job's value and error reach
the driver's thread and the thread never takes a signal; and the run cgroup's
end: emptied at once, removed at the driver's next wait. (A run whose row is
not committed while its files are still being made: test_driver_unit.)"""
import os
import signal
import threading

import pytest

from ringd import meanwhile, proctree
from ringd.env import RealEnv


def test_a_job_runs_on_the_helper_thread_and_hands_back_its_value():
    helper = meanwhile.Helper()
    try:
        job = helper.start(lambda: threading.get_ident())
        assert job.result() != threading.get_ident()
        assert job.result() == job.result()   # collected once, read again
        second = helper.start(lambda: 42)
        assert second.result() == 42
    finally:
        helper.close()


def test_a_jobs_error_is_raised_by_its_collector_once():
    helper = meanwhile.Helper()
    try:
        job = helper.start(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            job.result()
        assert helper.start(lambda: "next").result() == "next"   # the thread lives on
    finally:
        helper.close()


def test_the_helper_thread_blocks_every_signal():
    """A signal must reach the driver's thread, whose wait is woken by it."""
    helper = meanwhile.Helper()
    try:
        blocked = helper.start(lambda: signal.pthread_sigmask(signal.SIG_BLOCK, [])).result()
        assert {signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGINT} <= set(blocked)
        assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        helper.close()


def test_a_closed_helper_runs_jobs_at_once_and_leaves_no_thread():
    helper = meanwhile.Helper()
    helper.start(lambda: None).result()
    before = threading.active_count()
    helper.close()
    assert threading.active_count() == before - 1
    assert helper.start(lambda: threading.get_ident()).result() == threading.get_ident()


def test_an_ended_runs_cgroup_is_emptied_at_once_and_removed_at_the_next_wait(tmp_path):
    """The run's end reads its CPU time from an emptied cgroup; the rmdir waits
    for the driver's next wait (on a turning ring: while the next agent execs)."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    env = RealEnv(state, lambda m: None)
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


def test_without_a_thread_to_be_had_the_job_runs_at_once(monkeypatch):
    """A process or memory limit that refuses a thread costs the overlap, never the run."""
    def refuse(self):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(threading.Thread, "start", refuse)
    helper = meanwhile.Helper()
    job = helper.start(lambda: threading.get_ident())
    assert job.result() == threading.get_ident()
    helper.close()


def test_a_cgroup_that_cannot_be_removed_yet_never_holds_up_a_wait(tmp_path):
    """The rmdir of an ended run's cgroup is tried once per wait: while the kernel
    still holds it (here: a process in it), the wait goes on at once - it may be
    the wait that supervises the next agent - and the rmdir is tried again later."""
    import subprocess
    import time
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    env = RealEnv(state, lambda m: None)
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
