"""A driver's leadership of a many-host ring (PostgreSQL journal): one object the
driver asks "may I run agents and record?" and tells "a heartbeat is due".

It carries out ``lease``'s pure decisions with ``journal_pg``'s SQL: every beat
tries to take or renew the lease; a leader whose renewals have failed for half
the TTL (its own boot clock, so a freeze counts) stops leading before its lease
can pass to another host, and the driver kills its agent at once. With a
SQLite journal there is no Leader: the lock file already makes the one driver
the leader.

The switch is checked by the driver's loop, and also by a watchdog thread:
a driver blocked on the journal past its switch must still kill its agent in
time. (A call is bounded, ``ringd.journal.pgcall``, at a fifth of the TTL, a new
connection included; but a few of them in a row can outlast the switch.) The thread
only sends SIGKILL to the run's processes (it never reaps: the loop owns every
exit status) and stops this driver leading and recording. Every effect - the
lease's clock, the kill, the host's name - goes through the driver's env
(``ringd.host.seam.DriverEnv``).
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

from ringd.core import lease as leaselib
from ringd.core.levels import ERR, INFO, WARNING
from ringd.host.seam import DriverEnv
from ringd.journal.sqlite import JournalError
from ringd.journal.transitions import close_row

LEADER, STANDBY = "leader", "standby"
KILL_SETTLE = 10.0   # s: at most this long a regained leadership waits for its watchdog's kill to end


class Leader:
    def __init__(self, journal, ttl: float, log: Callable[[str, int], None], env: DriverEnv,
                 host: Optional[str] = None):
        self.journal = journal            # a journal_pg.PgJournal
        self.ttl = ttl
        self.log = log
        self.env = env
        self.host = host or env.hostname()
        self.me = leaselib.holder_name(self.host, env.pid, env.pid_start)
        self.renew_sent_at: Optional[float] = None   # lease clock of the last good renewal
        self.leading = False
        self.lease_holder: Optional[str] = None
        self.lease_expires_at: Optional[float] = None  # server epoch seconds
        self.took_over_from: Optional[str] = None      # set on a take-over, cleared by settle_takeover
        self.took_over = False
        self._failing: Optional[str] = None
        self._cond = threading.Condition()
        self._agent: Optional[tuple] = None   # (pid, start ticks, state key, run id) of the run in flight
        self.killed_pid: Optional[int] = None  # the agent the watchdog killed (its run is not recorded)
        self._killing = False   # the watchdog is killing a run's processes right now
        threading.Thread(target=self._watchdog, name="lease-watchdog", daemon=True).start()

    def guard(self, pid: Optional[int], start_ticks: Optional[int], state_key: str = "",
              run_id: int = 0, cgroup=None) -> None:
        """The run the watchdog kills at the switch (pid None: no run in flight);
        ``cgroup``: its :class:`ringd.host.cgroup.RunCgroup`, if it has one."""
        with self._cond:
            self._agent = (pid, start_ticks, state_key, run_id, cgroup) if pid else None
            if pid:
                self.killed_pid = None
            self._cond.notify()

    def _watchdog(self) -> None:
        while True:
            with self._cond:
                sent = self.renew_sent_at
                if not self.leading or sent is None or self._agent is None:
                    self._cond.wait()
                    continue
                left = leaselib.stop_deadline(sent, self.ttl) - self.env.lease_clock()
                if left > 0:
                    self._cond.wait(left)
                    continue
                pid, ticks, state_key, run_id, cgroup = self._agent
                self._agent = None
                # past the switch with the same renewal: the loop is stuck somewhere.
                # Stop leading and recording now (the loop sees it when it returns).
                self.leading = False
                self.killed_pid = pid
                self._killing = True
                self.journal.stop_recording()
            try:
                self._kill_run(pid, ticks, state_key, run_id, cgroup)
            finally:
                with self._cond:
                    self._killing = False
                    self._cond.notify_all()

    def _kill_run(self, pid: int, ticks: Optional[int], state_key: str, run_id: int, cgroup=None) -> None:
        """SIGKILL the run's processes at once (DriverEnv.kill_run_now: signals
        only, from this thread; the loop reaps them later and removes the cgroup)."""
        n = self.env.kill_run_now(pid, ticks, state_key, run_id, cgroup)
        self.log(f"lease: not renewed for half its TTL while the driver waits on the journal; "
                 f"killed run {run_id} ({n} process(es), agent pid {pid})", ERR)

    @property
    def role(self) -> str:
        return LEADER if self.leading else STANDBY

    def beat_every(self, heartbeat_interval: float) -> float:
        return leaselib.beat_every(self.ttl, heartbeat_interval)

    def must_stop(self) -> bool:
        """A leader past its half-TTL switch (or no leader at all): no agent may run."""
        if self.leading and leaselib.must_stop(self.renew_sent_at, self.ttl, self.env.lease_clock()):
            self._lose("lease not renewed for half its TTL")
        return not self.leading

    def seconds_left(self) -> float:
        """Until the half-TTL switch (the hop wakes then)."""
        if not self.leading or self.renew_sent_at is None:
            return 0.0
        return max(0.0, leaselib.stop_deadline(self.renew_sent_at, self.ttl) - self.env.lease_clock())

    def beat(self) -> None:
        """Take or renew the lease (one short transaction). Never raises."""
        self.must_stop()
        sent = self.env.lease_clock()
        try:
            d = self.journal.acquire(self.me, self.ttl)
            view = self.journal.read_lease()
        except JournalError as e:
            self._say_repairs()
            if self._failing is None:
                left = f"leading for at most {self.seconds_left():.1f}s more" if self.leading else "standing by"
                self.log(f"lease: cannot {'renew' if self.leading else 'take'} it ({e}); {left}", ERR)
            self._failing = str(e)
            self.must_stop()
            return
        self._say_repairs()
        if self._failing is not None:
            self.log("lease: journal reachable again", INFO)
            self._failing = None
        self.lease_holder, self.lease_expires_at = view.holder, view.expires_at
        if d.action == leaselib.WAIT:
            if self.leading:
                self._lose(f"lease taken by {view.holder}")
            return
        with self._cond:
            self.renew_sent_at = sent
            regained = not self.leading or d.action == leaselib.TAKE
            self.leading = True
            self._cond.notify()
        if regained:
            # A take-over, or a renewal that landed after this driver had let go
            # (the watchdog fired while it waited on the journal): either way the
            # run left `running` by the previous lease is reaped before going on.
            self.took_over = True
            self.took_over_from = d.previous if d.action == leaselib.TAKE else self.me
            self.log(f"lease: leading (epoch {d.epoch})"
                     f"{f', after {d.previous}' if d.previous else ''}", INFO)

    def _say_repairs(self) -> None:
        """What of the schema the journal made again (a table dropped under the
        running ring; by this beat or by any write since the last), said once."""
        repaired = self.journal.take_repaired()
        if repaired:
            self.log(f"journal schema: {', '.join(repaired)} missing (dropped by hand?); made again", WARNING)

    def _lose(self, why: str) -> None:
        with self._cond:
            self.leading = False
        self.journal.stop_recording()
        self.log(f"lease: no longer leading ({why}); recording nothing more, standing by", WARNING)

    def settle_takeover(self, config, on_reaped=None) -> None:
        """After taking the lease: close the lapsed leader's ``running`` row as
        ``interrupted`` (source ``reaper``, reason naming its host). Its agent is
        not ours to kill: its own driver did that at its half-TTL switch (or its
        box is down)."""
        if not self.took_over:
            return
        # Our own watchdog may still be killing what the last run left (it walks
        # all our descendants): nothing new may start before it is done.
        with self._cond:
            self._cond.wait_for(lambda: not self._killing, timeout=KILL_SETTLE)
        row = self.journal.running_row()
        if row is None:
            self.took_over = False
            return
        previous = self.took_over_from or f"a driver (pid {row.driver_pid})"
        reason = (f"leader {previous} (host {leaselib.holder_host(previous) or '?'}) "
                  f"lost its lease while it ran")
        now = self.env.wall()
        closed = close_row(self.journal, row, "interrupted", source="reaper", now=now, ring=config.ring,
                           reason=reason)
        self.took_over = False
        if closed is not None:
            self.log(f"reaper: run {row.id} of {row.agent} closed as interrupted ({reason})", WARNING)
            if on_reaped is not None:
                on_reaped(row, closed)

    def release(self) -> None:
        if self.leading:
            try:
                self.journal.release()
            except JournalError as e:
                self.log(f"lease: cannot release ({e}); it lapses in {self.ttl:g}s", WARNING)
        self.leading = False
