"""proctree.spawn: one posix_spawn that gives the child exactly what Popen
did (its own session, stdin /dev/null, stdout and stderr to the log, its cwd
and umask, every signal at its default, no descriptor of ours) and leaves the
spawning process's own cwd and umask as they were. Real processes."""
from __future__ import annotations

import os
import signal
import stat
import sys

import pytest

from ringd.host import proctree

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux semantics")

PROBE = r"""
import json, os, signal, sys
print(json.dumps({"cwd": os.getcwd(), "umask": os.umask(0), "sid": os.getsid(0), "pid": os.getpid(),
                  "fds": sorted(int(n) for n in os.listdir("/proc/self/fd")),
                  "stdin": os.readlink("/proc/self/fd/0"), "env": os.environ.get("ONLY"),
                  "wd": os.environ.get("WATCHDOG_PID")}), flush=True)
print("to stderr", file=sys.stderr)
"""


def _mask(status: str, field: str) -> set:
    """Signal numbers set in a /proc/<pid>/status mask (SigIgn, SigBlk)."""
    bits = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith(field + ":")), 16)
    return {n for n in range(1, 65) if bits >> (n - 1) & 1}


def _run(tmp_path, argv, **kw):
    log = tmp_path / "out.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        child = proctree.spawn(argv, stdout_fd=fd, **kw)
    finally:
        os.close(fd)
    try:
        assert proctree.wait_exit(child.pidfd, 20), "child did not exit"
        _, status = os.waitpid(child.pid, 0)
    finally:
        child.close()
    return child, os.waitstatus_to_exitcode(status), log.read_text()


# the second way in: by hand (fork, exec), for a child that is given its own pid (WATCHDOG_PID)
BOTH_WAYS = pytest.mark.parametrize("pid_var", [None, "WATCHDOG_PID"], ids=["posix_spawn", "fork+exec"])


@BOTH_WAYS
def test_the_child_gets_its_session_cwd_umask_signals_and_nothing_of_ours(tmp_path, pid_var):
    import json
    proctree.close_on_exec_all()   # as a daemon does at start-up (this test process inherited some)
    work = tmp_path / "work"
    work.mkdir()
    mine = os.open(tmp_path / "held", os.O_WRONLY | os.O_CREAT, 0o600)   # ours, close-on-exec
    before_cwd, before_umask = os.getcwd(), os.umask(0o022)
    os.umask(before_umask)
    try:
        child, code, out = _run(tmp_path, [sys.executable, "-c", PROBE], cwd=str(work),
                                env={"ONLY": "this", "PATH": os.environ["PATH"]}, umask=0o027, pid_var=pid_var)
    finally:
        os.close(mine)
    assert code == 0, out
    doc = json.loads(out.splitlines()[0])
    assert out.splitlines()[1] == "to stderr"                       # stderr to the same log
    assert doc["cwd"] == str(work) and doc["umask"] == 0o027
    assert doc["sid"] == doc["pid"] == child.pid                    # leads its own session
    assert doc["stdin"] == "/dev/null" and doc["env"] == "this"
    assert doc["wd"] == (None if pid_var is None else str(child.pid))   # its own pid, known only after the fork
    assert [fd for fd in doc["fds"] if fd > 2] in ([], [3]), doc["fds"]   # 3: the probe's own listdir
    assert (os.getcwd(), os.umask(before_umask)) == (before_cwd, before_umask)   # ours, unchanged
    # Python (this process) ignores SIGPIPE and SIGXFSZ, and a driver started by
    # nohup or as a shell's background job inherits SIGHUP, SIGINT or SIGQUIT
    # ignored: a program it starts gets every signal at its default
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
    inherited = (signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2)
    before = [signal.signal(s, signal.SIG_IGN) for s in inherited]
    try:
        _, code, status = _run(tmp_path, ["cat", "/proc/self/status"], cwd=None, env={"PATH": os.environ["PATH"]},
                               pid_var=pid_var)
    finally:
        for s, old in zip(inherited, before):
            signal.signal(s, old)
    # (glibc's spawn leaves its own two internal signals, 32 and 33, ignored: not ours to set)
    assert code == 0 and not _mask(status, "SigIgn") & set(signal.valid_signals()), status
    assert not _mask(status, "SigBlk"), "nothing blocked"


@BOTH_WAYS
def test_a_missing_cwd_or_program_is_an_oserror_and_changes_nothing_of_ours(tmp_path, pid_var):
    before = os.getcwd()
    with pytest.raises(FileNotFoundError):
        _run(tmp_path, ["/bin/true"], cwd=str(tmp_path / "gone"), env={}, pid_var=pid_var)
    with pytest.raises(FileNotFoundError):
        _run(tmp_path, [str(tmp_path / "nope")], cwd=str(tmp_path), env={}, pid_var=pid_var)
    with pytest.raises(FileNotFoundError):
        _run(tmp_path, ["no-such-program-anywhere"], cwd=str(tmp_path), env={"PATH": "/bin:/usr/bin"},
             pid_var=pid_var)
    assert os.getcwd() == before


@BOTH_WAYS
def test_a_file_exec_refuses_is_an_oserror_and_its_child_is_reaped(tmp_path, pid_var):
    """A text file without ``#!`` (ENOEXEC), or one that is not executable
    (EACCES): an OSError from the spawn, as from exec itself, and no child of
    ours is left behind unreaped."""
    plain = tmp_path / "plain"
    plain.write_text("echo ran\n")
    plain.chmod(0o755)
    with pytest.raises(OSError) as refused:
        _run(tmp_path, [str(plain)], cwd=str(tmp_path), env={}, pid_var=pid_var)
    assert refused.value.errno == 8    # ENOEXEC
    plain.chmod(0o644)
    with pytest.raises(PermissionError):
        _run(tmp_path, [str(plain)], cwd=str(tmp_path), env={}, pid_var=pid_var)
    try:
        assert os.waitpid(-1, os.WNOHANG)[0] == 0, "a child of ours was left to be reaped"
    except ChildProcessError:
        pass                           # no child of ours at all


def test_a_bare_name_is_found_on_the_childs_path_as_execvp_would(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "tool").write_text("#!/bin/sh\necho from a\n")          # not executable: skipped
    (b / "tool").write_text("#!/bin/sh\necho from b\n")
    os.chmod(b / "tool", 0o700)
    env = {"PATH": f"{a}:{b}"}
    assert proctree.executable("tool", env) == str(b / "tool")
    _, code, out = _run(tmp_path, ["tool"], cwd=str(tmp_path), env=env)
    assert (code, out) == (0, "from b\n")
    os.chmod(b / "tool", 0o600)   # now no match is executable: exec's own EACCES
    with pytest.raises(PermissionError):
        _run(tmp_path, ["tool"], cwd=str(tmp_path), env=env)
    assert proctree.executable("./tool", env) == "./tool"          # a path is taken as given
    # a relative PATH entry is the child's, not ours: found from its cwd
    os.chmod(b / "tool", 0o700)
    _, code, out = _run(tmp_path, ["tool"], cwd=str(tmp_path), env={"PATH": "b"})
    assert (code, out) == (0, "from b\n")


def test_close_on_exec_all_marks_every_inherited_descriptor(tmp_path):
    r, w = os.pipe()
    os.set_inheritable(w, True)
    try:
        proctree.close_on_exec_all()
        assert not os.get_inheritable(w)
        assert all(os.get_inheritable(fd) for fd in (0, 1, 2) if _open(fd))   # ours to hand on
    finally:
        os.close(r)
        os.close(w)


def _open(fd: int) -> bool:
    try:
        return stat.S_IFMT(os.fstat(fd).st_mode) >= 0
    except OSError:
        return False


def test_signals_held_starts_the_child_with_them_blocked(tmp_path):
    _, code, status = _run(tmp_path, ["cat", "/proc/self/status"], cwd=None, env={"PATH": os.environ["PATH"]},
                           signals_held=True)
    assert code == 0, status
    blocked = _mask(status, "SigBlk")
    assert {int(signal.SIGTERM), int(signal.SIGHUP), int(signal.SIGINT), int(signal.SIGUSR1)} <= blocked
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & {signal.SIGTERM}   # ours unblocked again


def test_reaping_zombie_children_collects_the_exited_and_keeps_the_kept_and_the_living(tmp_path):
    """Without ``keep`` every exited child is collected by one wait each (no walk
    of /proc); with it, the kept zombie stays (its pid and group stay ours)."""
    def start(argv):
        return proctree.spawn(argv, cwd="/", env={"PATH": os.environ["PATH"]}, stdout_fd=2, umask=0o077)
    quick, kept, alive = start(["/bin/true"]), start(["/bin/true"]), start(["sleep", "300"])
    try:
        for c in (quick, kept):
            assert proctree.wait_exit(c.pidfd, 20)
        reaped = proctree.reap_zombie_children(keep=[kept.pid])   # (another test's zombie may go too)
        assert quick.pid in reaped and kept.pid not in reaped and alive.pid not in reaped
        assert proctree.peek_exit(kept.pid) == 0   # still there to be read
        reaped = proctree.reap_zombie_children()
        assert kept.pid in reaped and alive.pid not in reaped
        assert proctree.peek_exit(alive.pid) is None   # a living child is never waited for
    finally:
        os.kill(alive.pid, signal.SIGKILL)
        os.waitpid(alive.pid, 0)
        for c in (quick, kept, alive):
            c.close()


def test_a_child_of_another_thread_of_ours_is_found_too(tmp_path):
    """While the process is one thread, its children are read off that thread
    alone (the driver's case, one read a run); with more threads, each thread's
    children are read: a child hangs off the thread that started it."""
    import threading
    spawned = []
    ready, done = threading.Event(), threading.Event()

    def other_thread():
        spawned.append(proctree.spawn(["sleep", "300"], cwd="/", env={"PATH": os.environ["PATH"]},
                                      stdout_fd=2, umask=0o077))
        ready.set()
        done.wait(30)   # alive while the walk looks, as the thread that started the child
    t = threading.Thread(target=other_thread)
    t.start()
    try:
        assert ready.wait(30)
        (child,) = spawned
        assert child.pid in proctree.child_pids()
        assert child.pid in [pid for pid, _ in proctree.run_descendants()]
    finally:
        done.set()
        t.join(30)
        for c in spawned:
            os.kill(c.pid, signal.SIGKILL)
            os.waitpid(c.pid, 0)
            c.close()


def test_a_child_of_ours_is_found_by_the_one_thread_read(tmp_path):
    import threading
    child = proctree.spawn(["sleep", "300"], cwd="/", env={"PATH": os.environ["PATH"]}, stdout_fd=2, umask=0o077)
    try:
        if threading.active_count() == 1:
            assert proctree._own_children() == [int(x) for x in open(
                f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()]
        assert child.pid in proctree.child_pids()
    finally:
        os.kill(child.pid, signal.SIGKILL)
        os.waitpid(child.pid, 0)
        child.close()


def test_every_child_is_listed_past_the_first_page_of_the_kernels_list():
    """/proc/<pid>/task/<tid>/children is handed out a page (4 KiB, ~800 pids)
    per read: one read of it missed the rest of 1200 children (orphans a run
    left re-parent to the driver), on the one-thread read and the per-thread one."""
    import threading
    sleep = next(f"{d}/sleep" for d in os.environ["PATH"].split(":") if os.access(f"{d}/sleep", os.X_OK))
    pids = []
    try:
        for _ in range(1200):
            pids.append(os.posix_spawn(sleep, ["sleep", "300"], {}))
        assert set(pids) <= set(proctree.child_pids())   # (a test worker may have other children)
        done = threading.Event()
        t = threading.Thread(target=done.wait, args=(30,))
        t.start()
        try:
            assert set(pids) <= set(proctree._children_of(os.getpid()))
        finally:
            done.set()
            t.join(30)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            os.waitpid(pid, 0)
