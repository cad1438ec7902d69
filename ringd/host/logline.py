"""The one log line format of ``ringd`` and ``ringwatch``:

    2026-12-01T12:00:00Z ringd[4242]: message

UTC with a ``Z``, the program and its pid. When stderr *is* the journal
(``$JOURNAL_STREAM`` names stderr's device and inode, as systemd sets it), each
line starts with an sd-daemon(3) priority, ``<3>`` error, ``<4>`` warning,
``<6>`` info, so ``journalctl -p warning`` finds the problems; every call states
its level (``ringd.core.levels``). A driver started by
a watcher inherits ``JOURNAL_STREAM`` but writes to ``ringd.log``: the device and
inode tell the two apart, so that file never gets the prefixes.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Optional, TextIO

from ringd.core.levels import ERR, INFO, WARNING  # noqa: F401 - the levels callers state
from ringd.host.notify import without_controls

def stream_is_journal(stream: TextIO, journal_stream: Optional[str]) -> bool:
    """Does ``stream`` go to the journal? (``JOURNAL_STREAM`` is ``DEV:INODE``.)"""
    if not journal_stream:
        return False
    try:
        dev, ino = (int(x) for x in journal_stream.split(":", 1))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def format_line(prog: str, message: str, *, at: float, pid: int, level: int, journald: bool = False) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    prefix = f"<{level}>" if journald else ""
    # One line, whatever the message quotes: a path from the config or the command
    # line may hold a newline or an escape sequence (ring.roster: "x\nFAKE: ok"
    # logged a configuration error as two lines, and ringwatch, which reports the
    # driver's last log line, then named only the forged half). Under journald
    # only the first line had the priority.
    return f"{prefix}{stamp} {prog}[{pid}]: {without_controls(message)}\n"


_journald: Optional[bool] = None
_my_pid: Optional[int] = None   # getpid(2) is a system call (glibc caches it no more): asked once


def _pid() -> int:
    global _my_pid
    if _my_pid is None:
        _my_pid = os.getpid()
    return _my_pid


def _forget_pid() -> None:
    global _my_pid
    _my_pid = None


os.register_at_fork(after_in_child=_forget_pid)


def _no_rotation() -> None:
    global _rotation
    _rotation = None   # a forked child never rotates its parent's log


os.register_at_fork(after_in_child=_no_rotation)


class Rotation:
    """stderr (and stdout, when it is the same file) is ``<state>/logs/ringd.log``:
    rotated from the writer at its size bound (safefile.log_rotate_bytes), one old
    copy kept as ``ringd.log.1``, for as long as the process writes - not only
    when a watcher starts a driver. Looked at once per CHECK_BYTES written here
    (an fstat), so a line costs nothing more."""
    CHECK_BYTES = 64 * 1024

    def __init__(self, state_dir, name: str, limit: int, fds: "tuple[int, ...]"):
        self.state_dir = state_dir
        self.name = name
        self.limit = limit
        self.fds = fds
        self.check_every = max(1, min(self.CHECK_BYTES, limit // 8))
        self.written = 0
        self.failed_said = False
        self._busy = threading.Lock()

    def wrote(self, n: int) -> None:
        self.written += n
        if self.written >= self.check_every:
            self.written = 0
            self.check()

    def check(self) -> None:
        if not self._busy.acquire(blocking=False):
            return   # another thread of the daemon is rotating it now
        try:
            self._check()
        finally:
            self._busy.release()

    def _check(self) -> None:
        from ringd.host import safefile
        try:
            st = os.fstat(self.fds[0])
            if st.st_size < self.limit:
                return
            dfd = safefile.open_dir(self.state_dir, ("logs",), create=False)
            try:
                at_path = os.stat(self.name, dir_fd=dfd, follow_symlinks=False)
                if (at_path.st_dev, at_path.st_ino) == (st.st_dev, st.st_ino):
                    os.replace(self.name, self.name + ".1", src_dir_fd=dfd, dst_dir_fd=dfd)
                # (else moved away already, by the operator's logrotate: the file at the path goes on)
                fd = safefile.open_in(dfd, self.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            finally:
                os.close(dfd)
        except OSError as e:
            if not self.failed_said:   # a directory at ringd.log.1, a read-only logs/: appended to all the same
                self.failed_said = True
                self._write(f"cannot rotate {self.name} to {self.name}.1 ({e.strerror}); appending on")
            return
        try:
            os.fchmod(fd, 0o600)
            for target in self.fds:
                os.dup2(fd, target)
        finally:
            os.close(fd)

    def _write(self, message: str) -> None:
        try:
            os.write(self.fds[0], format_line("ringd", message, at=time.time(), pid=_pid(),
                                              level=ERR, journald=False).encode())
        except OSError:
            pass


_echo_fd: Optional[int] = None   # a terminal that gets each line too (echo_to)


def echo_to(fd: int) -> None:
    """Write each line to ``fd`` as well, if it is a terminal (a driver started
    by a watcher in the foreground: its lines then show as they happen, while
    they still go to ``ringd.log``). A terminal that goes away (hung up) is
    dropped at the first line it cannot take."""
    global _echo_fd
    try:
        if os.isatty(fd):
            os.set_inheritable(fd, False)
            _echo_fd = fd
    except OSError:
        pass


def _echo(line: str) -> None:
    global _echo_fd
    if _echo_fd is None:
        return
    try:
        os.write(_echo_fd, line.encode("utf-8", "backslashreplace"))
    except OSError:
        fd, _echo_fd = _echo_fd, None
        try:
            os.close(fd)
        except OSError:
            pass


_rotation: Optional[Rotation] = None


def rotate_stderr(state_dir, name: str = "ringd.log") -> bool:
    """If stderr is ``<state_dir>/logs/<name>`` (a driver started by ringwatch, or
    ``2>>``), rotate it at its size bound as lines are written (:class:`Rotation`).
    True if it is."""
    global _rotation
    from ringd.host import safefile
    try:
        err = os.fstat(2)
        at_path = os.stat(os.path.join(state_dir, "logs", name), follow_symlinks=False)
    except OSError:
        return False
    if (err.st_dev, err.st_ino) != (at_path.st_dev, at_path.st_ino):
        return False
    fds = [2]
    try:
        out = os.fstat(1)
        if (out.st_dev, out.st_ino) == (err.st_dev, err.st_ino):
            fds.append(1)
    except OSError:
        pass
    _rotation = Rotation(state_dir, name, safefile.log_rotate_bytes(), tuple(fds))
    return True


def emit(prog: str, message: str, level: int = INFO, stream: Optional[TextIO] = None) -> None:
    """Write one line to stderr (or ``stream``) and flush it. A line that cannot
    be written (the log's disk is full: ENOSPC, EIO) is lost, never an error: a
    driver under ringwatch writes to ``logs/ringd.log``, and on a full disk it
    exited 1 at its first line, every driver the watcher started likewise, and
    the watcher gave up - though the journal and heartbeat could be written.
    Every call states its level (tests/unit/test_conventions.py checks it);
    the default only keeps one that does not from failing."""
    global _journald
    stream = stream or sys.stderr
    if _journald is None:   # stderr does not change under a running daemon: look once
        _journald = stream_is_journal(stream, os.environ.get("JOURNAL_STREAM"))
    at = time.time()
    line = format_line(prog, message, at=at, pid=_pid(), level=level, journald=_journald)
    _echo(format_line(prog, message, at=at, pid=_pid(), level=level))
    try:
        stream.write(line)
        stream.flush()
    except OSError:
        return
    if _rotation is not None and stream is sys.stderr:
        _rotation.wrote(len(line))
