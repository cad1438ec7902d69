"""Sleep until something happens: a signal, a watched file descriptor (a child's
pidfd), or a timeout. One ``selectors`` call over a self-pipe fed by
``signal.set_wakeup_fd``; nothing wakes the process for no reason.
"""
from __future__ import annotations

import os
import selectors
import signal
from typing import Iterable, Optional, Set, Tuple

from . import earlysig

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGCHLD)
# epoll/select time-outs overflow past 2**31 ms (~24.8 days); a longer wait is cut
# to this and the caller, which loops until its deadline, simply waits again.
MAX_WAIT = 86400.0


class Wakeups:
    def __init__(self, signals: Iterable[int] = HANDLED):
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        os.set_inheritable(self._r, False)
        os.set_inheritable(self._w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._r, selectors.EVENT_READ, "signals")
        self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self._old = {}
        for sig in signals:
            # The Python-level handler only exists so the C handler writes the
            # signal number to the pipe; the number itself is what we read.
            self._old[sig] = signal.signal(sig, lambda *_: None)
        self.signals = tuple(signals)
        earlysig.release()  # handlers exist: signals held since start-up are delivered now

    def wait(self, timeout: Optional[float], fds: Iterable[int] = ()) -> Tuple[Set[int], Set[int]]:
        """Block until a signal arrives, one of ``fds`` is readable, or ``timeout``
        seconds pass (None: forever). Returns (signals, ready fds)."""
        extra = [fd for fd in fds if fd is not None]
        for fd in extra:
            self._selector.register(fd, selectors.EVENT_READ, "fd")
        try:
            t = None if timeout is None else min(max(0.0, timeout), MAX_WAIT)
            events = self._selector.select(t)
        finally:
            for fd in extra:
                self._selector.unregister(fd)
        got: Set[int] = set()
        ready: Set[int] = set()
        for key, _ in events:
            if key.data == "signals":
                got |= self.drain()
            else:
                ready.add(key.fd)
        return got, ready

    def drain(self) -> Set[int]:
        got: Set[int] = set()
        while True:
            try:
                data = os.read(self._r, 512)
            except BlockingIOError:
                break
            if not data:
                break
            got.update(data)
        return got

    def close(self) -> None:
        signal.set_wakeup_fd(self._old_fd)
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._selector.close()
        os.close(self._r)
        os.close(self._w)
