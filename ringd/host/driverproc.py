"""The driver as a process, seen from the watcher: start ``ringd run`` in its own
session with its output appended to ``<state>/logs/ringd.log``, hold a pidfd on
it (ours or adopted), and signal it - always addressed by pid *and* start time
through a pidfd, so a recycled pid is never signalled. (The stop's steps are the
watcher's: ``ringd.loops.watcher``.)
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from ringd.host import proctree
from ringd.host import safefile
from ringd.host.procid import same_process

DRIVER_LOG = "ringd.log"
KILL_WAIT = 5.0   # s; a driver SIGKILL has not ended by then is left (uninterruptible sleep)


def driver_argv(state_dir: Path, config_path: Optional[Path]) -> List[str]:
    """``ringd run`` with the watcher's own state dir and config, run by the same
    interpreter (so it works whether or not the console script is on PATH)."""
    argv = [sys.executable, "-m", "ringd", "run", "--state", str(state_dir)]
    if config_path is not None:
        argv += ["--config", str(config_path)]
    return argv


def open_log(state_dir: Path) -> int:
    """Open ``<state>/logs/ringd.log`` for appending: 0600, never through a symlink -
    neither a symlinked ``logs/`` nor a symlinked ``ringd.log`` is followed - and
    rotated past its size bound (safefile.open_log); the driver rotates it
    again as it writes (logline.rotate_stderr)."""
    fd, unrotated = safefile.open_log(state_dir, ("logs",), DRIVER_LOG)
    os.fchmod(fd, 0o600)
    if unrotated is not None:   # a directory at ringd.log.1, a read-only logs/: the driver starts anyway
        os.write(fd, f"ringwatch: cannot rotate {DRIVER_LOG} to {DRIVER_LOG}.1 "
                     f"({unrotated.strerror}); appending on\n".encode())
    return fd


def last_log_line(state_dir: Path, limit: int = 300) -> str:
    """The last non-empty line of ringd.log (for reporting why the driver quit)."""
    try:
        with os.fdopen(safefile.open_regular(state_dir / "logs" / DRIVER_LOG), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    line = lines[-1].strip() if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


@dataclass
class DriverProc:
    """A driver process we watch: our child (``child`` set) or an adopted one."""
    pid: int
    start_time: Optional[float]
    pidfd: Optional[int] = None
    child: Optional[proctree.Child] = None
    status: Optional[int] = field(default=None)  # wait status once reaped (children only)

    @property
    def ours(self) -> bool:
        return self.child is not None

    @property
    def fd(self) -> Optional[int]:
        """What a wait wakes on at its exit: its pidfd, until it is reaped or closed."""
        return self.pidfd if self.status is None else None

    def alive(self) -> bool:
        if self.status is not None:
            return False
        return same_process(self.pid, self.start_time)

    def poll_exit(self) -> Optional[int]:
        """Our child's wait status if it has exited (reaping it), else None."""
        if self.child is None:
            return None
        if self.status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid == 0:
                return None
            self.status = status
            self.close()
        return self.status

    def exit_code(self) -> Optional[int]:
        """Exit code (negative signal number if killed) once exited, else None."""
        return None if self.status is None else _returncode(self.status)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.child is not None:
            self.child.pidfd = None


def _returncode(status: int) -> int:
    code, sig = proctree.decode_status(status)
    return -sig if sig is not None else (code if code is not None else 0)


ECHO_FD = 3   # the driver's number for the watcher's terminal (ringd.loops.driver.echo_to_terminal)


def terminal_fd() -> Optional[int]:
    """A copy of the watcher's stderr if it is a terminal (ringwatch started by
    hand), else None: numbered above the child's 0-3, so the spawn's own
    redirections of 1 and 2 never overwrite it first."""
    import fcntl
    try:
        return fcntl.fcntl(2, fcntl.F_DUPFD_CLOEXEC, 10) if os.isatty(2) else None
    except OSError:
        return None


def start_driver(state_dir: Path, config_path: Optional[Path]) -> DriverProc:
    """Start ``ringd run`` in a new session, output appended to ringd.log, with
    NOTIFY_SOCKET and WATCHDOG_* removed (systemd's main process is the watcher).
    A watcher on a terminal hands it the terminal too: its lines (each run's
    start and end) then show there as they happen."""
    fd = open_log(state_dir)
    tty = terminal_fd()
    extra = {"RING_ECHO_FD": str(ECHO_FD)} if tty is not None else {}
    try:
        child = proctree.spawn(driver_argv(state_dir, config_path), cwd=None,
                               env={**proctree.clean_env(os.environ, {}), **extra}, stdout_fd=fd,
                               signals_held=True,  # a signal before its handlers waits (earlysig)
                               pass_fd=(tty, ECHO_FD) if tty is not None else None)
    finally:
        os.close(fd)
        if tty is not None:
            os.close(tty)
    return DriverProc(pid=child.pid, start_time=child.start_time, pidfd=child.pidfd, child=child)


def adopt(pid: int, start_time: Optional[float]) -> Optional[DriverProc]:
    """Watch a running driver we did not start (it outlived a previous watcher).
    None if it is not the process that started at ``start_time``."""
    fd = None
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return None
    if not same_process(pid, start_time):  # checked after opening: the fd pins the process
        if fd is not None:
            os.close(fd)
        return None
    return DriverProc(pid=pid, start_time=start_time, pidfd=fd)


def send(proc: DriverProc, sig: int) -> None:
    """Signal the driver through its pidfd (a recycled pid is never hit), else by
    pid and start time."""
    if proc.pidfd is not None:
        try:
            signal.pidfd_send_signal(proc.pidfd, sig)
        except OSError:
            pass
        return
    proctree.signal_process(proc.pid, proc.start_time, sig)
