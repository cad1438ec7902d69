"""A client-side bound on every PostgreSQL call of a many-host ring's driver.

The server's own timeouts (statement_timeout, lock_timeout) are enforced by
the server process: a stopped one (SIGSTOP, a paused VM) never applies them,
and keepalives do not fire while the peer's kernel still acknowledges. A call
then blocked the driver for good: no heartbeat, no SIGTERM heard. So psycopg's
wait for the server's answer is ours (``journal_pg`` plugs :func:`wait` into
its connection): one ``poll`` on the connection's socket and the driver's
wake-up pipe, which ends the call

- when it has not answered within its bound (:func:`call_bound`), or
- ``STOP_GRACE`` after a signal the driver is to act on at once arrived
  while it was in flight (:func:`ends_call`: a stop always; a reload or a
  wake-up once the driver is ready),

by raising :class:`Abandoned`; the connection is then dropped and made again
by the next call. Every signal heard meanwhile is put back into the pipe for
the driver's next wait. Decisions (:func:`verdict`, :func:`poll_ms`)
are pure; the loop only carries them out. No psycopg import here.
"""
from __future__ import annotations

import math
import select
import signal
import time
from typing import Callable, Optional, Protocol, Set

from ringd.core.lease import BEATS_PER_TTL

# s a call still has after a stop signal: a call the server is answering (a few
# ms) ends on its own, and the row or the lease it writes stays consistent; one
# it is not answering is ended well within the SPEC's 1 s.
STOP_GRACE = 0.2
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
# The SPEC's "acts on SIGTERM, SIGINT, SIGHUP and SIGUSR1 within 1 s" holds while
# a call hangs too: a reload or an operator's wake-up waiting out the bound (7.5 s
# at the default TTL) broke it. A call the server is answering ends on its own
# within the grace, so only a hung one is given up (and retried by the loop).
# SIGCHLD is not one: an agent's exit must never cost a renewal in flight.
# During start-up (a slow first connection, the migration lock) a SIGHUP or SIGUSR1
# is honoured once the driver is ready (SPEC): ending the call for it failed the
# start-up, an exit 69. Only a stop ends a call then.
PROMPT_SIGNALS = STOP_SIGNALS | {signal.SIGHUP, signal.SIGUSR1}
OVERDUE, STOPPING = "overdue", "stopping"
# psycopg's wait states and readiness (``psycopg.waiting``): bit 1 read, bit 2 write
READ, WRITE = _READ, _WRITE = 1, 2


def call_bound(ttl: float) -> float:
    """How long one call may go unanswered: a fifth of the lease's TTL, its
    beat period (``lease.beat_every`` never beats less often). So a hung call
    delays the driver's beat by one lease beat period at most, never past the
    half-TTL switch on its own, and far less than ``watch.stale_after``; it is
    also the server's own statement and lock timeout (``journal_pg``), so a
    server that is merely slow ends a call the same way."""
    return ttl / BEATS_PER_TTL


def ends_call(got: Set[int], ready: bool) -> bool:
    """Whether signals ``got``, heard while a call is in flight, end it (after
    the grace): a stop always; a reload or a wake-up once the driver is
    ``ready`` (in its loop, where it acts on them), never during start-up."""
    return bool(got & (PROMPT_SIGNALS if ready else STOP_SIGNALS))


def verdict(now: float, deadline: float, stop_at: Optional[float]) -> Optional[str]:
    """Whether a call in flight is to be ended at ``now`` (None: wait on)."""
    if now >= deadline:
        return OVERDUE
    if stop_at is not None and now >= stop_at + STOP_GRACE:
        return STOPPING
    return None


def poll_ms(now: float, deadline: float, stop_at: Optional[float]) -> int:
    """How long the next poll may sleep: until the earlier of the two ends."""
    end = deadline if stop_at is None else min(deadline, stop_at + STOP_GRACE)
    return max(0, math.ceil((end - now) * 1000))


class Abandoned(Exception):
    """A call ended on our side: its connection is in an unknown state."""


class SignalTap(Protocol):
    """The driver's wake-up pipe (``ringd.host.wakeup.Wakeups``); ``ready``: its
    owner has started and acts on every signal at once."""
    ready: bool

    def fileno(self) -> int: ...
    def drain(self) -> Set[int]: ...
    def put_back(self, sigs: Set[int]) -> None: ...


def wait(gen, fileno: int, bound: float, tap: Optional[SignalTap] = None,
         clock: Callable[[], float] = time.monotonic, stopping: bool = False):
    """Drive psycopg's generator ``gen`` on socket ``fileno`` to its end (its
    return value), as ``psycopg.waiting.wait`` does, within ``bound`` seconds
    and, with a ``tap``, until a stop signal; raises :class:`Abandoned`.
    ``stopping``: the driver is stopping already (its stop signal heard before
    the call): the call has the stop's grace from its start, as one in flight
    when the signal came has. Each call of a stop (its run's end, the lease's
    release, the last metrics) waited out its whole bound on a server that
    does not answer: 30 s in all at a TTL of 40 s, past the watcher's patience."""
    deadline = clock() + bound
    stop_at: Optional[float] = clock() if stopping else None
    heard: Set[int] = set()
    poll = select.poll()
    if tap is not None:
        poll.register(tap.fileno(), select.POLLIN)
    try:
        state = next(gen)
        while True:
            poll.register(fileno, (select.POLLIN if state & _READ else 0) | (select.POLLOUT if state & _WRITE else 0))
            ready = 0
            for fd, ev in poll.poll(poll_ms(clock(), deadline, stop_at)):
                if fd == fileno:
                    ready = (_READ if ev & select.POLLIN else 0) | (_WRITE if ev & select.POLLOUT else 0)
                    if ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                        ready = state   # libpq tries, and says what broke
                else:
                    got = tap.drain()
                    heard |= got
                    if stop_at is None and ends_call(got, tap.ready):
                        stop_at = clock()
            if ready:
                state = gen.send(ready)
                continue
            why = verdict(clock(), deadline, stop_at)
            if why == OVERDUE:
                raise Abandoned(f"no answer within {bound:g}s (a fifth of ring.lease_ttl); connection dropped")
            if why == STOPPING:
                what = "is stopping" if stopping or heard & STOP_SIGNALS else "has a signal to act on"
                raise Abandoned(f"call ended: the driver {what}; connection dropped")
    except StopIteration as done:
        return done.value
    finally:
        if heard:
            tap.put_back(heard)   # the driver's next wait hears them
