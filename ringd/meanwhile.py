"""One helper thread that makes the next run's files while the driver's own
thread waits on the journal's commit.

The commit's fsync is the longest wait of a hop (about half a millisecond
here), and Python lets other threads run while SQLite or PostgreSQL waits. The
next run's log, notify socket and cgroup need only its run id, so they are made
during that wait instead of after it. The rules that keep this simple:

- one job at a time, and the driver always collects it (:meth:`Job.result`)
  before it starts a process, discards the run or starts another job: the two
  threads never touch the same state at once, and the process-wide umask and
  cwd that a spawn sets for an instant are never seen by a job;
- a job only makes and opens files and directories (the run's log, notify
  socket, cgroup and its ``cgroup.procs``): it logs nothing and never touches
  the journal; whatever it raises is raised again by :meth:`Job.result`;
- the thread blocks every signal from its first instruction (it is created
  with them blocked), so signals reach the driver's own thread.
"""
from __future__ import annotations

import signal
import threading
from typing import Callable, Optional


class Job:
    """A function run once, on the helper thread or at once."""

    def __init__(self, fn: Callable[[], object]):
        self._fn = fn
        self._done = threading.Lock()
        self._done.acquire()   # released when the function has returned or raised
        self._collected = False
        self._value: object = None
        self._error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as e:   # noqa: BLE001 - handed to the collector
            self._error = e
        finally:
            self._done.release()

    def result(self) -> object:
        """Wait for the function to end; its value, or its exception raised here."""
        if not self._collected:
            self._done.acquire()
            self._collected = True
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._value


def done(fn: Callable[[], object]) -> Job:
    """``fn`` run now, on the caller's thread (tests, and a driver whose helper
    thread could not be started)."""
    job = Job(fn)
    job.run()
    return job


class Helper:
    """The helper thread, started with its first job."""

    def __init__(self) -> None:
        self._go = threading.Lock()
        self._go.acquire()   # released to hand the thread a job
        self._job: Optional[Job] = None
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def start(self, fn: Callable[[], object]) -> Job:
        """Run ``fn`` on the helper thread; the caller must collect the job before the next."""
        if self._closed:
            return done(fn)
        if self._thread is None:
            # a new thread inherits its creator's signal mask: blocked from birth, not
            # from some instant after it (held signals reach this thread once unblocked)
            held = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
            try:
                thread = threading.Thread(target=self._loop, name="ringd-meanwhile", daemon=True)
                thread.start()
            except RuntimeError:   # no thread to be had (a process or memory limit): do it now
                return done(fn)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
            self._thread = thread
        job = self._job = Job(fn)
        self._go.release()
        return job

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            job, self._job = self._job, None
            if job is None:   # closed
                return
            job.run()

    def close(self, timeout: float = 5.0) -> None:
        """End the thread (the last job was collected)."""
        self._closed = True
        thread, self._thread = self._thread, None
        if thread is not None:
            self._job = None
            self._go.release()
            thread.join(timeout)
