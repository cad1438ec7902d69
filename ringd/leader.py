"""A driver's leadership of a many-host ring (PostgreSQL journal): one object the
driver asks "may I run agents and record?" and tells "a heartbeat is due".

It carries out ``lease``'s pure decisions with ``journal_pg``'s SQL: every beat
tries to take or renew the lease; a leader whose renewals have failed for half
the TTL (its own boot clock, so a freeze counts) stops leading before its lease
can pass to another host, and the driver kills its agent at once. With a
SQLite journal there is no Leader: the lock file already makes the one driver
the leader.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Callable, Optional

from . import lease as leaselib
from . import procid
from .journal import JournalError
from .policy import after_run

LEADER, STANDBY = "leader", "standby"


class Leader:
    def __init__(self, journal, ttl: float, log: Callable[[str], None], host: Optional[str] = None):
        self.journal = journal            # a journal_pg.PgJournal
        self.ttl = ttl
        self.log = log
        self.host = host or socket.gethostname()
        self.me = leaselib.holder_name(self.host, os.getpid(), procid.start_ticks(os.getpid()))
        self.renew_sent_at: Optional[float] = None   # lease clock of the last good renewal
        self.leading = False
        self.lease_holder: Optional[str] = None
        self.lease_expires_at: Optional[float] = None  # server epoch seconds
        self.took_over_from: Optional[str] = None      # set on a take-over, cleared by settle_takeover
        self.took_over = False
        self._failing: Optional[str] = None

    @property
    def role(self) -> str:
        return LEADER if self.leading else STANDBY

    def beat_every(self, heartbeat_interval: float) -> float:
        return leaselib.beat_every(self.ttl, heartbeat_interval)

    def must_stop(self) -> bool:
        """A leader past its half-TTL switch (or no leader at all): no agent may run."""
        if self.leading and leaselib.must_stop(self.renew_sent_at, self.ttl, leaselib.clock()):
            self._lose("lease not renewed for half its TTL")
        return not self.leading

    def seconds_left(self) -> float:
        """Until the half-TTL switch (the hop wakes then)."""
        if not self.leading or self.renew_sent_at is None:
            return 0.0
        return max(0.0, leaselib.stop_deadline(self.renew_sent_at, self.ttl) - leaselib.clock())

    def beat(self) -> None:
        """Take or renew the lease (one short transaction). Never raises."""
        self.must_stop()
        sent = leaselib.clock()
        try:
            d = self.journal.acquire(self.me, self.ttl)
            view = self.journal.read_lease()
        except JournalError as e:
            if self._failing is None:
                left = f"leading for at most {self.seconds_left():.1f}s more" if self.leading else "standing by"
                self.log(f"lease: cannot reach the journal ({e}); {left}")
            self._failing = str(e)
            self.must_stop()
            return
        if self._failing is not None:
            self.log("lease: journal reachable again")
            self._failing = None
        self.lease_holder, self.lease_expires_at = view.holder, view.expires_at
        if d.action == leaselib.WAIT:
            if self.leading:
                self._lose(f"lease taken by {view.holder}")
            return
        self.renew_sent_at = sent
        if d.action == leaselib.TAKE:
            self.leading = True
            self.took_over = True
            self.took_over_from = d.previous
            self.log(f"lease: leading (epoch {d.epoch})"
                     f"{f', after {d.previous}' if d.previous else ''}")

    def _lose(self, why: str) -> None:
        self.leading = False
        self.journal.stop_recording()
        self.log(f"lease: no longer leading ({why}); recording nothing more, standing by")

    def settle_takeover(self, config, on_reaped=None) -> None:
        """After taking the lease: close the lapsed leader's ``running`` row as
        ``interrupted`` (source ``reaper``, reason naming its host). Its agent is
        not ours to kill: its own driver did that at its half-TTL switch (or its
        box is down)."""
        if not self.took_over:
            return
        row = self.journal.running_row()
        if row is None:
            self.took_over = False
            return
        previous = self.took_over_from or f"a driver (pid {row.driver_pid})"
        reason = (f"leader {previous} (host {leaselib.holder_host(previous) or '?'}) "
                  f"lost its lease while it ran")
        now = time.time()
        after = self.journal.close_run(row.id, "interrupted", source="reaper", reason=reason, now=now,
                                       settle=lambda st: after_run(st, "interrupted", now, config.ring))
        self.took_over = False
        if after is not None:
            self.log(f"reaper: run {row.id} of {row.agent} closed as interrupted ({reason})")
            if on_reaped is not None:
                on_reaped(row, after)

    def release(self) -> None:
        if self.leading:
            try:
                self.journal.release()
            except JournalError as e:
                self.log(f"lease: cannot release ({e}); it lapses in {self.ttl:g}s")
        self.leading = False

    def status(self) -> dict:
        return {"host": self.host, "role": self.role, "lease_holder": self.lease_holder,
                "lease_expires_at": self.lease_expires_at}
