"""The watcher's effects behind one object: the real ``ringd.host.seam.WatcherEnv``."""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Set, Tuple

from ringd.core.watchpolicy import Clock
from ringd.host import alerts
from ringd.host import driverproc
from ringd.host import logline
from ringd.host import proctree
from ringd.host import watchstate
from ringd.host.driverproc import DriverProc
from ringd.host.heartbeat import live_writer, read_heartbeat, whose
from ringd.host.procid import recorded_here, same_process, start_ticks
from ringd.host.servicemanager import Notifier, watchdog_interval
from ringd.host.wakeup import Wakeups

# SIGUSR1 (the driver's "look at the journal now") is handled too: earlysig
# releases it with the others, and its default action killed the watcher
# without a word, leaving its driver unwatched. Here it means "check now".
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGCHLD)


def stderr_log(message: str, level: int = logline.INFO) -> None:
    """One line per event on stderr, in ringd's format (``ringd.host.logline``).
    Every call states its level (as :func:`ringd.host.env.stderr_logger`)."""
    logline.emit("ringwatch", message, level)


@dataclass
class Command:
    """A restart command we started: its Popen, and a pidfd a wait wakes on at its exit."""
    popen: subprocess.Popen
    fd: Optional[int]

    @property
    def pid(self) -> int:
        return self.popen.pid


class RealWatcherEnv:
    """What :class:`ringd.loops.watcher.Watcher` does to the world. Making one has
    no effect: signals are heard from :meth:`listen` on, the lock taken by :meth:`lock`."""

    def __init__(self, state_dir: Path, config_path: Optional[Path], log: Callable[[str, int], None] = stderr_log):
        self.state_dir = state_dir
        self.config_path = config_path
        self.log = log
        self.notifier = Notifier()
        self.watchdog_every = watchdog_interval()
        self.pid = os.getpid()
        self.pid_start = start_ticks(self.pid)
        self._wake: Optional[Wakeups] = None
        self._lock = watchstate.WatchLock(state_dir)

    # --- clocks and the one wait ---------------------------------------------------
    monotonic = staticmethod(time.monotonic)
    wall = staticmethod(time.time)

    @staticmethod
    def clock() -> Clock:
        return watchstate.clock_now()   # (looked up at each call: a test may wrap it)

    def listen(self) -> None:
        """Hear the watcher's signals from now on (earlysig releases those held since start-up)."""
        self._wake = Wakeups(SIGNALS)

    def wait(self, timeout: Optional[float], fds: Iterable[Optional[int]] = ()) -> Tuple[Set[int], Set[int]]:
        if self._wake is None:   # not listening: a timed sleep on the descriptors alone
            ready = select.select([fd for fd in fds if fd is not None], [], [],
                                  None if timeout is None else max(0.0, timeout))[0]
            return set(), set(ready)
        return self._wake.wait(timeout, [fd for fd in fds if fd is not None])

    def signals(self) -> Set[int]:
        """Signals heard since the last wait, without sleeping (none before :meth:`listen`)."""
        return self._wake.drain() if self._wake is not None else set()

    def put_back(self, sigs: Set[int]) -> None:
        if self._wake is not None and sigs:
            self._wake.put_back(sigs)

    def close(self) -> None:
        if self._wake is not None:
            self._wake.close()
            self._wake = None

    def notify(self, message: str) -> None:
        self.notifier.notify(message)

    @property
    def notifying(self) -> bool:
        return self.notifier.active

    @staticmethod
    def errno_reason(e: OSError) -> str:
        return proctree.errno_reason(e)

    # --- the state dir -------------------------------------------------------------
    def prepare(self) -> None:
        proctree.close_on_exec_all()   # nothing we inherited reaches the driver we start
        watchstate.prepare_state_dir(self.state_dir)

    def lock(self) -> None:
        self._lock.acquire()

    def verify_lock(self) -> str:
        return self._lock.verify()

    def unlock(self) -> None:
        self._lock.release()

    def whose(self) -> Dict[str, Any]:
        return whose(self.state_dir)

    def heartbeat(self) -> Optional[Dict[str, Any]]:
        """The heartbeat, unless a driver of an earlier boot (or another pid
        namespace) wrote it: its pid and start tick name nobody now (or a process
        that got both again, which the watcher would follow, then stop as a hung driver)."""
        hb = read_heartbeat(self.state_dir)
        return hb if isinstance(hb, dict) and recorded_here(hb) else None

    def load_state(self) -> Dict[str, Any]:
        return watchstate.load(self.state_dir)

    def save_state(self, data: Dict[str, Any]) -> None:
        watchstate.save(self.state_dir, data)

    def state_lock(self, wait: float, give_up: Callable[[], bool]) -> contextlib.AbstractContextManager:
        return watchstate.write_lock(self.state_dir, wait, give_up=give_up)

    def gave_up(self, data: Dict[str, Any]) -> bool:
        return watchstate.gave_up(self.state_dir, data)

    def mark_gave_up(self) -> None:
        watchstate.mark_gave_up(self.state_dir)

    # --- the driver ------------------------------------------------------------------
    def start_driver(self) -> DriverProc:
        return driverproc.start_driver(self.state_dir, self.config_path)

    @staticmethod
    def adopt(pid: int, start_time: Optional[float]) -> Optional[DriverProc]:
        return driverproc.adopt(pid, start_time)

    @staticmethod
    def live_driver(hb: Any) -> Optional[Tuple[int, Any]]:
        """(pid, start time) of the live driver the heartbeat names, else None."""
        return live_writer(hb)

    @staticmethod
    def same_process(pid: Any, start_time: Any) -> bool:
        return same_process(pid, start_time)

    @staticmethod
    def driver_alive(proc: DriverProc) -> bool:
        return proc.alive()

    @staticmethod
    def driver_exit(proc: DriverProc) -> Optional[int]:
        """Our driver's exit code (a negative signal number if killed) once it has
        exited, reaping it; None while it runs, or for an adopted one."""
        proc.poll_exit()
        return proc.exit_code()

    @staticmethod
    def signal_driver(proc: DriverProc, sig: int) -> None:
        driverproc.send(proc, sig)

    @staticmethod
    def close_driver(proc: DriverProc) -> None:
        proc.close()

    def driver_log_tail(self) -> str:
        return driverproc.last_log_line(self.state_dir)

    # --- the restart command and the alert helper ------------------------------------
    @staticmethod
    def run_command(argv: Sequence[str]) -> Command:
        """Start the restart command in its own session, its output on our stderr."""
        p = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                             stderr=sys.stderr.fileno(), start_new_session=True, close_fds=True,
                             env=proctree.clean_env(os.environ, {}))
        return Command(popen=p, fd=_pidfd(p.pid))

    @staticmethod
    def command_exit(cmd: Command) -> Optional[int]:
        return cmd.popen.poll()

    @staticmethod
    def kill_command(cmd: Command, wait: float) -> bool:
        """SIGKILL the command's group and wait for it ``wait`` s at most: one in
        uninterruptible sleep (a hung mount, a frozen cgroup) was waited for
        without end, the watcher deaf to everything. True if it ended."""
        p = cmd.popen
        proctree.signal_group(p.pid, signal.SIGKILL)
        end = time.monotonic() + wait
        while p.poll() is None and time.monotonic() < end:
            if cmd.fd is not None:
                select.select([cmd.fd], [], [], max(0.0, end - time.monotonic()))
            else:
                time.sleep(0.02)
        return p.poll() is not None

    @staticmethod
    def close_command(cmd: Command) -> None:
        if cmd.fd is not None:
            os.close(cmd.fd)
            cmd.fd = None

    def fire_alert(self, command: Optional[Sequence[str]], kind: str, detail: str, timeout: float) -> Optional[int]:
        """Run the operator's alert command, detached and time-limited: its helper's pid, or None."""
        return alerts.fire(command, kind, None, detail, self.state_dir, timeout=timeout, log=self.log,
                           reaped_by_caller=False)

    @staticmethod
    def pidfd(pid: int) -> Optional[int]:
        return _pidfd(pid)

    @staticmethod
    def helper_ended(pid: int) -> bool:
        """Has our child ``pid`` exited (reaping it)?"""
        try:
            return os.waitpid(pid, os.WNOHANG)[0] != 0
        except ChildProcessError:
            return True

    @staticmethod
    def close_fd(fd: int) -> None:
        os.close(fd)


def _pidfd(pid: int) -> Optional[int]:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
