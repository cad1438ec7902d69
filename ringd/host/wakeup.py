"""Sleep until something happens: a signal, a watched file descriptor (a child's
pidfd), or a timeout. One ``poll(2)`` over a self-pipe fed by
``signal.set_wakeup_fd`` and the watched descriptors; nothing wakes the process
for no reason. (``poll``, not ``epoll``: the descriptors change at every run,
and an epoll set costs two system calls per descriptor per wait to change.)
"""
from __future__ import annotations

import errno
import math
import os
import select
import signal
from typing import Iterable, Optional, Set, Tuple

from ringd.core.policy import Requests
from ringd.host import earlysig

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGCHLD)
# epoll/select time-outs overflow past 2**31 ms (~24.8 days); a longer wait is cut
# to this and the caller, which loops until its deadline, simply waits again.
MAX_WAIT = 86400.0
WAKE_READ = 512   # bytes of the signal pipe read at once: one byte per signal delivered


class Wakeups:
    def __init__(self, signals: Iterable[int] = HANDLED):
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        os.set_inheritable(self._r, False)
        os.set_inheritable(self._w, False)
        self._poll = select.poll()
        self._poll.register(self._r, select.POLLIN)
        self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self._old = {}
        # The pipe wakes the wait; the signals are also kept here by the Python-level
        # handler: the C handler's write of a signal's number to a full pipe (64 KiB:
        # a burst of SIGUSR1s or SIGCHLDs while the process is busy) is dropped, and
        # a SIGTERM behind such a burst was never heard. A full pipe still wakes the
        # wait, and drain() hands out both.
        self._heard: Set[int] = set()
        for sig in signals:
            self._old[sig] = signal.signal(sig, self._hear)
        self.signals = tuple(signals)
        # Set once the owner has started (RealEnv.ready): from then on a SIGHUP
        # or SIGUSR1 ends a journal call in flight as a stop does (pgcall.ends_call);
        # before, only a stop does, and the others wait for the loop.
        self.ready = False
        earlysig.release()  # handlers exist: signals held since start-up are delivered now

    def wait(self, timeout: Optional[float], fds: Iterable[int] = ()) -> Tuple[Set[int], Set[int]]:
        """Block until a signal arrives, one of ``fds`` is readable, or ``timeout``
        seconds pass (None: forever). Returns (signals, ready fds)."""
        extra = {fd for fd in fds if fd is not None}
        for fd in extra:
            self._poll.register(fd, select.POLLIN)
        try:
            ms = None if timeout is None else math.ceil(min(max(0.0, timeout), MAX_WAIT) * 1000)
            if self._heard:
                ms = 0   # heard already (put back, or a full pipe's)
            events = self._poll.poll(ms)
        finally:
            for fd in extra:
                self._poll.unregister(fd)
        got: Set[int] = set()
        ready: Set[int] = set()
        for fd, ev in events:
            if ev & select.POLLNVAL:   # a closed descriptor would be "ready" at every wait: a spin
                raise OSError(errno.EBADF, f"waiting on descriptor {fd}: {os.strerror(errno.EBADF)}")
            if fd == self._r:
                got |= self.drain()
            else:
                ready.add(fd)
        return got, ready

    def _hear(self, sig: int, _frame: object) -> None:
        self._heard.add(sig)

    def drain(self) -> Set[int]:
        got: Set[int] = set()
        while True:
            try:
                data = os.read(self._r, WAKE_READ)
            except BlockingIOError:
                break
            got.update(data)
            if len(data) < WAKE_READ:
                break   # the pipe is empty now: no second read to hear EAGAIN (a hop reads it twice)
        heard, self._heard = self._heard, set()   # (a handler run meanwhile adds to one of them)
        return got | heard   # (a signal heard twice is one request: callers take a set)

    def fileno(self) -> int:
        """The pipe's read end (a PostgreSQL call polls it too: ``ringd.journal.pgcall``)."""
        return self._r

    def put_back(self, sigs: Set[int]) -> None:
        """Signals read from the pipe by someone else, for the next wait or drain."""
        self._heard |= sigs
        try:
            os.write(self._w, bytes(sorted(sigs)))   # wakes the next wait
        except BlockingIOError:   # a full pipe wakes it anyway
            pass

    def close(self) -> None:
        signal.set_wakeup_fd(self._old_fd)
        for sig, old in self._old.items():
            signal.signal(sig, old)
        os.close(self._r)
        os.close(self._w)


def requests_from(sigs: "set[int]") -> Requests:
    """What the signals a wait returned ask of the driver."""
    return Requests(stop=bool(sigs & {signal.SIGTERM, signal.SIGINT}), reload=signal.SIGHUP in sigs,
                    wake=signal.SIGUSR1 in sigs, children=signal.SIGCHLD in sigs)
