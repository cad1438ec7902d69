"""Log lines for the machine they land in: one format for ringd and ringwatch
(UTC ``Z`` stamp, program[pid]); sd-daemon priority prefixes exactly when stderr
is the journal (JOURNAL_STREAM names its device and inode). Real daemons."""
from __future__ import annotations

import os
import re

from conftest import wait_until
from ringd.host.logline import ERR, INFO, WARNING, format_line, stream_is_journal

LINE = re.compile(r"^(<[346]>)?\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ (ringd|ringwatch)\[\d+\]: \S")


def test_format_and_priorities(tmp_path):
    assert format_line("ringd", "driver started", at=0, pid=7, level=INFO) == \
        "1970-01-01T00:00:00Z ringd[7]: driver started\n"
    assert format_line("ringwatch", "GIVING UP: x", at=0, pid=7, level=ERR, journald=True).startswith("<3>1970")
    # the level is the caller's, whatever the words say
    assert format_line("ringd", "a stale error, cannot warn", at=0, pid=1, level=INFO, journald=True).startswith("<6>")
    assert format_line("ringd", "x", at=0, pid=1, level=WARNING, journald=True).startswith("<4>")
    f = tmp_path / "f"
    with open(f, "w") as stream:
        st = os.fstat(stream.fileno())
        assert stream_is_journal(stream, f"{st.st_dev}:{st.st_ino}")
        assert not stream_is_journal(stream, f"{st.st_dev}:{st.st_ino + 1}")
        assert not stream_is_journal(stream, None) and not stream_is_journal(stream, "garbage")


def _journal_lines(ring, start, name: str, wait_for: str):
    """Start a daemon whose stderr is "the journal" (JOURNAL_STREAM names the
    very file); stop it once ``wait_for`` is logged. Its lines, read back."""
    err = ring.base / f"journal-{name}"
    with open(err, "wb") as f:
        st = os.fstat(f.fileno())
        p = start(env=dict(ring.env, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}"), stderr=f)
    wait_until(lambda: wait_for in err.read_text(), timeout=30, message=wait_for)
    if p.poll() is None:
        p.terminate()
    p.wait(timeout=30)
    return err.read_text().splitlines()


def test_each_line_has_the_level_its_call_states_not_one_read_from_its_words(ring):
    """The watcher's start-up line says "stale after": it was logged <4>
    (warning) for that word, so `journalctl -p warning` was not only the
    trouble. Levels are the callers': that line is info, a config warning and
    a failed run are warnings, an ok run is info."""
    ring.agent("good", "exit 0")
    ring.agent("bad", "exit 3")
    ring.roster(f"good {ring.agents_dir}/good.sh", f"bad {ring.agents_dir}/bad.sh")
    ring.write_config(watch={"restart_sec": 2, "start_limit_burst": 5, "start_limit_interval": 3})
    lines = _journal_lines(ring, ring.start_watcher, "watcher", "started driver")
    watching = [x for x in lines if "watching" in x and "stale after" in x]
    assert watching and all(x.startswith("<6>") for x in watching), lines
    warned = [x for x in lines if "warning: watch.start_limit_interval" in x]
    assert warned and all(x.startswith("<4>") for x in warned), lines
    assert all(x.startswith("<6>") for x in lines if "started driver" in x), lines

    lines = _journal_lines(ring, lambda **kw: ring.start_driver("--once", **kw), "driver", "driver stopped")
    ended = {name: [x for x in lines if f"{name} " in x and " after " in x] for name in ("good", "bad")}
    assert ended["good"] and all(x.startswith("<6>") for x in ended["good"]), lines
    assert ended["bad"] and all(x.startswith("<4>") for x in ended["bad"]), lines
    assert all(x.startswith("<6>") for x in lines if "driver started" in x), lines


def test_driver_and_watcher_lines_with_and_without_journal(ring):
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    # stderr is a file: plain lines, even with a JOURNAL_STREAM that names something else
    env = dict(ring.env, JOURNAL_STREAM="1:1")
    done = ring.start_driver("--once", env=env)
    assert done.wait(timeout=20) == 0
    lines = done.err_path.read_text().splitlines()
    assert lines and all(LINE.match(x) and not x.startswith("<") for x in lines), lines

    # stderr is "the journal": JOURNAL_STREAM names the very file
    for argv, prog in ((["run", "--once"], "ringd"), (None, "ringwatch")):
        err = ring.base / f"journal-{prog}"
        with open(err, "wb") as f:
            st = os.fstat(f.fileno())
            env = dict(ring.env, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
            if argv:
                p = ring.start_driver("--once", env=env, stderr=f)
                assert p.wait(timeout=20) == 0
            else:
                ring.config_path.chmod(0o660)   # a refusal is an error line
                p = ring.start_watcher(env=env, stderr=f)
                assert p.wait(timeout=20) == 78
                ring.config_path.chmod(0o600)
        text = err.read_text()
        lines = text.splitlines()
        assert lines and all(LINE.match(x) and x.startswith("<") for x in lines), text
        assert any(x.startswith("<6>") for x in lines) or prog == "ringwatch"
        if prog == "ringwatch":
            assert any(x.startswith("<3>") and "writable by group or others" in x for x in lines), text

    # a watcher under the journal: its own lines prefixed, its driver's ringd.log not
    err = ring.base / "journal-watch"
    with open(err, "wb") as f:
        st = os.fstat(f.fileno())
        env = dict(ring.env, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
        w = ring.start_watcher(env=env, stderr=f)
        wait_until(lambda: "started driver" in err.read_text(), message="watcher started its driver")
        log = ring.state / "logs" / "ringd.log"
        wait_until(lambda: log.exists() and "driver started" in log.read_text(), message="driver log")
        w.terminate()
        w.wait(timeout=20)
    assert all(x.startswith("<") for x in err.read_text().splitlines())
    assert all(LINE.match(x) and not x.startswith("<") for x in log.read_text().splitlines() if x.strip())


def test_a_forked_child_logs_its_own_pid(tmp_path):
    """The pid in a line is asked of the kernel once per process, and again after a fork."""
    import io
    from ringd.host import logline
    logline.emit("ringd", "parent line", logline.INFO, stream=io.StringIO())   # the parent's pid, now remembered
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: one line to the pipe, then out without any cleanup of the parent's
        try:
            with os.fdopen(w, "w") as out:
                logline.emit("ringd", "child line", logline.INFO, stream=out)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as inp:
        line = inp.read()
    os.waitpid(pid, 0)
    assert f"ringd[{pid}]: child line" in line, line
    out = io.StringIO()
    logline.emit("ringd", "parent again", logline.INFO, stream=out)
    assert f"ringd[{os.getpid()}]: parent again" in out.getvalue()


def test_a_line_the_disk_cannot_take_is_lost_not_raised():
    """/dev/full answers every write with ENOSPC, as ringd.log on a full disk."""
    from ringd.host import logline
    if not os.path.exists("/dev/full"):
        import pytest
        pytest.skip("no /dev/full")
    full = open("/dev/full", "w")
    try:
        logline.emit("ringd", "a line", logline.INFO, stream=full)
        logline.emit("ringd", "x" * 20000, logline.INFO, stream=full)   # past the buffer too
    finally:
        try:
            full.close()   # (flushes what is still buffered: ENOSPC again)
        except OSError:
            pass
