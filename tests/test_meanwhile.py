"""The driver's helper thread (ringd.meanwhile) and the run files it makes while
the turn's commit waits: a job's value and error reach the driver's thread, the
thread never takes a signal, and a run whose row is not committed leaves no
file and no cgroup even when its files were still being made."""
import contextlib
import os
import signal
import threading
import time

import pytest

from ringd import meanwhile, proctree
from ringd.config import Config, RingSettings
from ringd.driver import Driver
from ringd.env import RealEnv
from ringd.journal import Journal, JournalError
from ringd.notify import IDLE_SOCKET
from ringd.roster import RosterSource


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


class CommitFails(Journal):
    """A journal whose COMMIT fails (as on a full disk): the transaction is rolled back."""

    @contextlib.contextmanager
    def write(self):
        with super().write() as con:
            yield con
            con.execute("ROLLBACK")
            con.execute("BEGIN")   # for the real write()'s COMMIT, which then commits nothing
        raise JournalError("database or disk is full", transient=True)


def test_a_run_whose_row_is_not_committed_leaves_no_file_even_while_they_were_being_made(tmp_path):
    """The run's files are made on the helper thread during the commit. When the
    commit fails, the driver waits for them before it removes them: slowed here,
    they would otherwise be made after the removal and left behind."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    roster = state / "ring.txt"
    roster.write_text("a /bin/true\n")
    roster.chmod(0o600)
    src = RosterSource(roster)
    src.refresh(force=True)
    journal = CommitFails.open(state)
    logs = []
    env = RealEnv(state, logs.append)
    slow_log = env.open_run_log

    def open_run_log(*a, **k):
        time.sleep(0.3)   # on the helper thread, while the driver's thread sees the commit fail
        return slow_log(*a, **k)
    env.open_run_log = open_run_log
    driver = Driver(env, state, None, Config(ring=RingSettings(run_budget=10.0)), src, journal, once=True)
    cgroups_before = _run_cgroups(env)
    try:
        with pytest.raises(JournalError):
            driver.turn(None)
        env.meanwhile(lambda: None).result()   # the helper is idle: whatever it was making is made
        assert list((state / "logs" / "a").iterdir()) == []
        assert [p for p in os.listdir(state) if p.endswith(".sock") and p != IDLE_SOCKET] == []
        assert _run_cgroups(env) == cgroups_before
        assert journal.history(None, 10) == []
    finally:
        env.close()
        journal.close()


def _run_cgroups(env):
    parent = env.containment.parent
    if parent is None:
        return set()
    return {p for p in os.listdir(parent) if p.startswith(env.containment.prefix)}


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
