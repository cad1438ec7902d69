"""The driver loop, ``ringd run``: lock, reap, then forever: hear signals, beat,
reload the roster, choose the turn (one journal transaction that commits the
last run's end, reads the operator's controls and the agent whose turn it is,
asks :func:`ringd.core.policy.plan_turn` and writes the next start), take it, and
wait - never spinning - when nothing is due. A run's end that the next turn
does not commit at once is committed alone before any wait (:meth:`Driver.flush`).

Every effect goes through ``self.env`` (:class:`ringd.host.env.RealEnv`, or a test's
fake): the loop itself never calls ``time``, ``os`` or ``signal``. Every wait is
one ``env.wait`` with a timeout equal to the next thing due (a heartbeat, a
back-off's end, a look at the roster file), so an idle driver costs nothing and
still hears signals and roster edits.
"""
from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence, Set

from ringd.host import alerts
from ringd.host import cgroup
from ringd.core import events, quota
from ringd.core.levels import ERR, INFO, WARNING
from ringd.core import silence
from ringd.loops import metrics
from ringd.host import proctree
from ringd.host import safefile
from ringd.inputs import schedule
from ringd.journal import transitions
from ringd.inputs.config import Config, ConfigError, load_config
from ringd.host.env import RealEnv, stderr_logger
from ringd.host.seam import DriverEnv
from ringd.core.errors import EX_CONFIG, EX_OK, EX_TEMPFAIL, EX_UNAVAILABLE, RingError, exit_for
from ringd.host.heartbeat import iso, live_writer, read_heartbeat
from ringd.host.servicemanager import watchdog_interval
from ringd.loops.hop import Hop, HopResult, Pending
from ringd.journal.sqlite import PRUNE_BATCH, Journal, JournalError
from ringd.host.lock import LOCK_FILE, KernelLock, LockHeld
from ringd.core.policy import (Action, Requests, Spin, TurnInputs, alerts_after, plan_turn, round_after,
                     spin_after_run, spin_at_lap_end, wait_timeout)
from ringd.host.wakeup import requests_from
from ringd.loops.reaper import driver_alive, orphan_cause, reap
from ringd.inputs.roster import RosterSource, next_index, wraps
from ringd.inputs.startup import inputs_for_run

PRUNE_EVERY = PRUNE_BATCH // 2   # runs between two retention batches on a fast ring
LOCK_LOSS_GRACE = 1.0       # s a replaced lock file must stay locked by another before we give way
JOURNAL_RETRY = (1.0, 5.0)   # s; wait before retrying a turn the journal could not record
CLOCK_STEP = 1.0            # s the wall clock must jump (against the monotonic one) to count as stepped
# A stopping driver tries this long to record an end it saw (another writer's lock, a
# full disk) before it leaves the row to the next driver's reaper: within the watcher's
# and systemd's stop timeouts, after the agent's own grace.
END_WRITE_WAIT = 5.0        # s
END_WRITE_RETRY = 0.25      # s between two of those tries
UNCONFIRMED_START = ("its start was committed, but the driver never heard so (the journal's connection "
                     "was lost at the commit): no process was started")

HOST = socket.gethostname()

log = stderr_logger


class RingView(NamedTuple):
    """The roster as the turn choice reads it (see :meth:`Driver.view`)."""
    agents: Optional[list]   # the roster's agents this view was made from
    config: Optional[Config]
    roster: list             # (name, line) pairs, in roster order
    names: list
    scheduled: list          # (name, Schedule) of the scheduled agents
    scheduled_at: dict       # name -> roster index of each scheduled agent (policy.TurnInputs)
    pool_of: dict = {}       # name -> quota pool of each agent on one (SPEC "Agents on a shared quota")
    windows: tuple = ()      # (pool, window) of each pool an agent of the roster draws on, by name


def pooled(config: Config, agents) -> "tuple[dict, tuple]":
    """RingView's ``pool_of`` and ``windows``: who of ``agents`` draws on which pool."""
    pool_of = {a.name: config.quota_for(a.name) for a in agents if config.quota_for(a.name) in config.quotas}
    return pool_of, tuple((name, config.quotas[name].window) for name in sorted(set(pool_of.values())))


def role_fields(leader) -> dict:
    """What the heartbeat says of leadership (a SQLite ring's one driver always leads)."""
    if leader is None:
        return {"host": HOST, "role": "leader", "lease": None}
    return {"host": leader.host, "role": leader.role,
            "lease": {"holder": leader.lease_holder, "expires_at": leader.lease_expires_at}}


def reload_record(seq: int, at: float, old: Config, new: Config, old_agents: Sequence, new_agents: Sequence,
                  errors: Sequence) -> dict:
    """Pure: the heartbeat's ``reload``: its number, when, what changed in the
    config and the roster, and the errors that kept an old one (kind, text)."""
    from ringd.core.timefmt import iso
    from ringd.inputs.config import config_changes
    from ringd.inputs.roster import roster_changes
    return {"seq": seq, "at": iso(at), "changed": config_changes(old, new) + roster_changes(old_agents, new_agents),
            "errors": [{"kind": kind, "detail": detail} for kind, detail in errors]}


def journal_exit(e: JournalError) -> int:
    """The exit code of a driver that cannot go on with its journal: an outage
    (busy, full or read-only, PostgreSQL unreachable or its connection lost:
    ``transient``) is no configuration error - 78 stops ringwatch and systemd
    restarting it (and a many-host ring would not survive its box); a journal
    no restart can help (damaged, a newer ring's, psycopg missing) is one."""
    return EX_UNAVAILABLE if e.transient else EX_CONFIG


def startup_journal_exit(e: JournalError, env, logger: Callable[[str, int], None]) -> int:
    """The exit of a driver whose journal failed before it was ready. A stop
    signal ends a journal call in flight (``ringd.journal.pgcall``) and is put back:
    an outage (transient) with a stop pending is the stop itself (SPEC: a
    signal during start-up is honoured), exit 0 as a service manager expects
    of a stop - not an outage (69, a failed unit). A journal no restart can
    help (damaged, a newer ring's) is refused all the same: 78."""
    if e.transient and requests_from(env.wait(0)[0]).stop:
        logger(f"stopped while starting ({e})", INFO)
        return EX_OK
    logger(str(e), ERR)
    return journal_exit(e)


def for_leadership(config: Config) -> Config:
    """A many-host driver beats (and renews its lease) at least twice per half
    TTL, whatever ``heartbeat_interval`` says."""
    if not config.ring.journal:
        return config
    from ringd.core.lease import beat_every
    every = beat_every(config.ring.lease_ttl, config.ring.heartbeat_interval)
    return dataclasses.replace(config, ring=dataclasses.replace(config.ring, heartbeat_interval=every))


def for_watchdog(config: Config) -> Config:
    """Under systemd's watchdog (ringd.service, WatchdogSec=) the driver beats,
    and so sends WATCHDOG=1, at least every half WatchdogSec, whatever
    ``heartbeat_interval`` says: one of 60 s or more under the shipped
    WatchdogSec=60 had systemd abort and restart a healthy driver every minute."""
    every = watchdog_interval()
    if every is None or every >= config.ring.heartbeat_interval:
        return config
    return dataclasses.replace(config, ring=dataclasses.replace(config.ring, heartbeat_interval=every))


def prepare_state_dir(state_dir: Path) -> None:
    """Create a missing state dir 0700; refuse one others may write (the rule
    ``ringd check`` applies too: safefile.check_state_dir)."""
    if not state_dir.exists():
        try:
            os.makedirs(state_dir, mode=0o700, exist_ok=True)
        except OSError as e:
            raise RingError(f"{state_dir}: cannot create state dir: {e.strerror}", exit_for(e)) from None
    safefile.check_state_dir(state_dir)


def acquire_lock(state_dir: Path) -> KernelLock:
    """Exclusive kernel lock on ``ringd.lock`` (released by the kernel if we die)."""
    path = state_dir / LOCK_FILE
    try:
        return KernelLock(path).acquire()
    except LockHeld as e:
        holder = e.holder
        if holder is None:  # no /proc/locks: the heartbeat names the live driver
            hb = read_heartbeat(state_dir)
            holder = hb.get("pid") if hb and not hb.get("stopped") else None
        raise RingError(f"{path}: another driver holds the lock"
                        f"{f' (pid {holder})' if holder else ''}", EX_TEMPFAIL) from None
    except OSError as e:
        raise RingError(f"{path}: cannot lock: {e.strerror}", exit_for(e)) from None


def live_driver(state_dir: Path, me: tuple, journal: Optional[Journal] = None) -> Optional[int]:
    """The pid of another driver of this state dir that is alive though we hold
    the lock - its lock file was deleted (a tmpfiles cleaner, ``git clean -X``):
    named by its heartbeat (pid *and* start time), or, the heartbeat deleted
    with it (``rm ringd.*``), by the run it has in flight (``journal``)."""
    writer = live_writer(read_heartbeat(state_dir))
    if writer is not None and writer != me:
        return writer[0]
    if journal is not None:
        try:
            row = journal.running_row()
        except JournalError:
            return None
        if row is not None and driver_alive(row, state_dir, me):
            return row.driver_pid
    return None


class Driver:
    def __init__(self, env: DriverEnv, state_dir: Path, config_path: Optional[Path], config: Config,
                 roster: RosterSource, journal: Journal, *, lock=None, once: bool = False,
                 agent_umask: int = 0o022, base_env: Optional[dict] = None, leader=None):
        self.env = env
        self.state_dir = state_dir
        self.state_key = str(state_dir)
        self.config_path = config_path
        self.config = config
        self.roster = roster
        self.journal = journal
        journal.wait_busy_unless(self.stop_pending)
        journal.on_taken_up = self.journal_taken_up
        self.lock = lock
        self.once = once
        self.agent_umask = agent_umask
        self.base_env = proctree.clean_env(base_env or {}, {})   # once: each run adds its RING_* (hop.agent_env)
        self.leader = leader   # leader.Leader of a many-host ring (None: SQLite, the lock makes us leader)
        self.log = env.log
        # what signals asked for
        self.stop_requested = False
        self.stop_reason = "driver stopping"
        self.reload_requested = False
        self.reload_seq = 0                    # SIGHUP reloads done (``ringd reload`` waits for it to move)
        self.last_reload: Optional[dict] = None   # what the last one did: changes, or the error that kept the old
        self.config_loaded_at = env.wall()     # the running config's load (run_driver loaded it just now)
        self.config_error: Optional[str] = None   # why the last reload kept the old config
        self.beat_fields: dict = {}            # the last beat's run fields: a beat between two is the same
        self.exit_code = EX_OK
        # the ring's position
        self.lap = 1
        self.notify_dropped = 0   # datagrams the runs' notify sockets did not hear (status: driver.notify_dropped)
        self.cursor: "tuple[Optional[str], Optional[int]]" = (None, None)
        self.cursor_roster: Optional[Sequence[str]] = None   # the roster's names at the last turn (None: not known)
        self.spin = Spin()
        self.pending: Optional[Pending] = None   # the last run's end, not yet committed
        # run id -> (agent, position) of starts whose turn failed to commit: with
        # PostgreSQL a commit whose answer is lost may have happened all the same
        self.unconfirmed: "dict[int, tuple[str, int]]" = {}
        self.spin_logged = False
        self.idle_logged = False
        self.at_lap_start = False
        # heartbeat and metrics
        self.next_beat = env.monotonic()
        self.beat_error: Optional[str] = None
        self.lock_lost_since: Optional[float] = None
        self._metrics_at = float("-inf")
        self._metrics_dirty = False
        self._metrics_failing = False
        self._prune_failing = False
        self.journal_moved = False   # journal.db replaced under us, or its log lost (seen at a beat or a wake)
        self._orphan_said = False    # said that its -wal or -shm went and its log waits to be saved
        self._runs_since_prune = 0
        self.paused_said = False
        self.quota_held: Set[str] = set()   # pools said to hold their agents (Driver.say_quota)
        self.due_seen: "dict[str, float]" = {}   # scheduled agents' next due times at the last turn (metrics)
        self.quota_read: Optional[quota.Read] = None   # the pools' use as last read (dropped when a run records use)
        self._view = RingView(None, None, [], [], [], {})
        self._noted_roster: Optional[list] = None   # the roster agents last recorded (Tx.note_roster)
        self._silence_failing = False

    @property
    def roster_dir(self) -> Path:
        """The folder of the file the roster in use was read from: relative
        programs resolve, and agents run, there (hop)."""
        return (self.roster.origin or self.roster.path).parent

    # --- hearing and beating ------------------------------------------------------------
    def absorb(self, sigs: Set[int], keep: tuple = (), agent_exited: bool = False) -> Requests:
        """Turn signals into the driver's flags (and reap exited children but
        ``keep``; when the agent has exited, its end's tree kill collects the
        run's, and only alert helpers are left to reap here)."""
        req = requests_from(sigs)
        if req.children:
            self.env.reap_helpers(keep, helpers_only=agent_exited)
        if req.stop and not self.stop_requested:
            self.stop_requested = True
            self.log("stop requested: finishing up", INFO)
        if req.reload and not self.stop_requested:
            # at once, during a run too (SPEC: within 1 s): ``ringd reload`` waits for it;
            # the run in flight keeps its limits, the next one has the new ones
            self.reload_requested = True
            self.reload()
        if req.wake:
            # an operator's request (SIGUSR1) was written to the journal at the path, or
            # waits for us to take it up again: looked for there before the next turn
            # trusts the controls it reads
            self.look_at_journal()
        return req

    def stop_pending(self) -> bool:
        """Told to stop, or a stop signal not yet heard: the journal gives up
        waiting for another process's write lock (Journal.wait_busy_unless)."""
        return self.stop_requested or self.env.stop_pending()

    def hear(self) -> Requests:
        """Signals that arrived since the last wait (between runs: no sleeping)."""
        return self.absorb(self.env.signals())

    def beat(self, agent: Optional[str] = None, run_id: Optional[int] = None, run_pid: Optional[int] = None,
             run_started_at: Optional[float] = None) -> None:
        # A heartbeat that cannot be written (state dir full or read-only) must
        # never abandon a running agent nor kill the driver: say so once, go on.
        self.next_beat = self.env.monotonic() + self.config.ring.heartbeat_interval
        self.beat_fields = dict(agent=agent, run_id=run_id, run_pid=run_pid, run_started_at=run_started_at)
        if self.leader is not None:
            self.leader.beat()   # renew (or take) the lease with every heartbeat
        try:
            self.env.beat(lap=self.lap, agent=agent, run_id=run_id, run_pid=run_pid,
                          run_started_at=run_started_at, extra=self.facts())
        except OSError as e:
            if self.beat_error is None:
                self.log(f"cannot write the heartbeat ({self.env.errno_reason(e)}); "
                         f"the ring goes on, a watcher will see it as stale", ERR)
            self.beat_error = str(e)
        else:
            if self.beat_error is not None:
                self.log("heartbeat written again", INFO)
            self.beat_error = None
        self.check_lock()
        self.look_at_journal()
        if self._runs_since_prune:
            self.prune_journal()
        due = self.config.ring.heartbeat_interval * 0.9
        if self._metrics_dirty or self.env.monotonic() - self._metrics_at >= due:
            self.write_metrics(agent, run_started_at)
        self.watch_silence()

    def facts(self) -> dict:
        """What the heartbeat says of the ring this driver runs, for ``status``,
        ``reload`` and the commands that find their config through it: the config
        and roster it loaded (and when), the errors that kept them, its pace."""
        from ringd.core.timefmt import iso
        return {"config": str(self.config_path) if self.config_path is not None else None,
                "config_loaded_at": iso(self.config_loaded_at), "config_signature": self.config.signature,
                "config_error": self.config_error, "roster_path": str(self.roster.path),
                "roster_agents": [a.name for a in self.roster.agents], "roster_error": self.roster.error,
                "heartbeat_interval": self.config.ring.heartbeat_interval,
                "journal": "postgresql" if self.config.ring.journal else "sqlite",
                "reload": self.last_reload, "notify_dropped": self.notify_dropped, **role_fields(self.leader)}

    def look_at_journal(self) -> None:
        """journal.db, its -wal or its -shm removed or replaced under us (three
        stats, once a beat, mid-run too, and at each operator's wake)? Another
        journal in its place is taken up between runs (reopen_journal); a -wal
        or -shm gone, at once - every commit since went to a log no other
        process reads, and operator commands wait for it (journal_taken_up)."""
        if self.journal_moved:
            return
        what = self.journal.replaced()
        if what is None:
            return
        if what == str(self.journal.path):
            self.journal_moved = True
            return
        try:
            self.journal.take_up_companions()
        except JournalError as e:   # (tried again at the next look, or the next write)
            self.log(f"cannot take the journal up again: {e}", ERR)

    def journal_taken_up(self, what: str, fate: str) -> None:
        """Say what became of the driver's writes when its -wal or -shm went
        (Journal.take_up_companions)."""
        self._metrics_dirty = True
        if fate == "saved":
            self._orphan_said = False
            self.log(f"{what} was removed or replaced under the driver; its log was saved into the journal "
                     f"(nothing lost) and the journal taken up again", WARNING)
        elif fate == "lost":
            # the journal now there is another history than ours: taken up as a new one between runs
            self.journal_moved, self._orphan_said = True, False
            self.log(f"{what} was removed or replaced under the driver and another process began a new log: "
                     f"the driver's writes since the journal's last checkpoint are lost; using the journal "
                     f"now there (what others wrote since is kept)", ERR)
        elif not self._orphan_said:
            self._orphan_said = True
            self.log(f"{what} was removed or replaced under the driver while another process has the journal "
                     f"open; its log is kept out of journal.db until it can be saved there", WARNING)

    def beat_if_due(self) -> None:
        if self.env.monotonic() >= self.next_beat:
            self.beat()

    def check_lock(self) -> None:
        """Our lock file deleted or replaced: take it again, or stop if another driver got it."""
        if self.lock is None:
            return
        verdict = self.lock.verify()
        now = self.env.monotonic()
        if verdict != "lost":
            self.lock_lost_since = None
        if verdict == "retaken":
            self.log(f"{self.lock.path} was removed or replaced; locked it again", WARNING)
        elif verdict == "lost" and self.lock_lost_since is None:
            # a second driver that locked the new file gives it up at once when it
            # sees us alive: only a loss that lasts means another driver runs
            self.lock_lost_since = now
        elif verdict == "lost" and now - self.lock_lost_since >= LOCK_LOSS_GRACE and not self.stop_requested:
            self.log(f"{self.lock.path} was replaced and another driver holds it; stopping", ERR)
            self.stop_requested, self.stop_reason, self.exit_code = True, "driver lost its lock", EX_TEMPFAIL

    # --- waiting -----------------------------------------------------------------------
    def pause(self, seconds: Optional[float], *, until_roster_edit: bool = False,
              wall_until: Optional[float] = None) -> None:
        """Sleep ``seconds`` (None: until something happens) while beating; returns
        early on a signal that asks for something, or on a roster edit. ``wall_until``:
        also return once the wall clock reaches it, or is stepped (looked at every
        beat): a due time is a wall-clock time, and the wall clock may be stepped
        forward, move on through a suspend, or be stepped back - bringing a due
        time of the new clock nearer than ``seconds`` - while the monotonic clock
        does not."""
        env = self.env
        self.flush()   # never wait with a run's end unrecorded
        end = None if seconds is None else env.monotonic() + seconds
        skew = env.wall() - env.monotonic()
        while not self.stop_requested:
            now = env.monotonic()
            if end is not None and now >= end:
                return
            if wall_until is not None:
                wall = env.wall()
                if wall >= wall_until or abs(wall - now - skew) > CLOCK_STEP:
                    return
            self.beat_if_due()
            # the roster file is looked at (one stat) at least once a heartbeat
            timeout = wait_timeout(now, end, self.next_beat, self.next_beat)
            sigs, _ = env.wait(timeout)
            if self.absorb(sigs).any:
                return
            had_error = self.roster.error is not None
            if until_roster_edit and self.roster.refresh():
                self.roster_changed(had_error)
                return

    # --- reloading ------------------------------------------------------------------------
    def reload(self) -> None:
        """Look at the roster (one stat); after a SIGHUP re-read the config and
        the roster, record what changed (or what kept the old ones) in the
        heartbeat, and beat at once so ``ringd reload`` hears it."""
        force = self.reload_requested
        self.reload_requested = False
        if not force:
            had_error = self.roster.error is not None
            if self.roster.refresh():
                self.roster_changed(had_error)
            return
        old_config, old_agents, errors = self.config, list(self.roster.agents), []
        if self.config_path is not None:
            try:
                self.config = for_watchdog(for_leadership(self.keep_journal(load_config(self.config_path))))
                self.config_loaded_at, self.config_error = self.env.wall(), None
                self.log(f"config reloaded from {self.config_path}", INFO)
            except ConfigError as e:
                self.config_error = str(e)
                errors.append(("config", str(e)))
                self.log(f"config error, keeping the running config: {e}", ERR)
            # ring.roster may name another file now: read that one from here on
            # (status and check already do), keeping the last good roster until it parses
            path = self.config.roster_path(self.state_dir)
            if path != self.roster.path:
                self.log(f"roster is now {path} (was {self.roster.path})", INFO)
                self.roster = self.roster.moved_to(path)
        had_error = self.roster.error is not None
        if self.roster.refresh(force=True):
            self.roster_changed(had_error)
        if self.roster.error:
            errors.append(("roster", self.roster.error))
        self.reload_seq += 1
        self.last_reload = reload_record(self.reload_seq, self.env.wall(), old_config, self.config,
                                         old_agents, self.roster.agents, errors)
        self.beat(**self.beat_fields)

    def keep_journal(self, new: Config) -> Config:
        """``new`` with the running ``ring.journal`` and ``ring.lease_ttl``: the
        journal is opened and the lease taken at start-up only. Taken as read,
        they made the beat follow a lease this driver does not hold (a new
        longer TTL: beats rarer than the running lease needs, and leadership
        lost between beats; a SQLite ring given a URI: beats at TTL/5)."""
        old = self.config.ring
        if (new.ring.journal, new.ring.lease_ttl) == (old.journal, old.lease_ttl):
            return new
        self.log("ring.journal and ring.lease_ttl take effect when the driver restarts; "
                 "keeping the running ones", WARNING)
        return dataclasses.replace(new, ring=dataclasses.replace(new.ring, journal=old.journal,
                                                                 lease_ttl=old.lease_ttl))

    def roster_changed(self, had_error: bool = False) -> None:
        if self.roster.error:
            self.log(f"roster error, keeping the last good roster: {self.roster.error}", ERR)
        elif had_error:
            self.log(f"roster fixed: {self.roster.path} loaded again, {len(self.roster.agents)} agent(s)", INFO)
        else:
            self.log(f"roster loaded: {len(self.roster.agents)} agent(s)", INFO)
        try:
            self.journal.set_meta("roster_error", self.roster.error)
        except JournalError as e:   # state dir full or read-only
            self.log(f"cannot record the roster state in the journal: {e}", ERR)

    # --- metrics and alerts ---------------------------------------------------------------
    def write_metrics(self, agent: Optional[str] = None, run_started_at: Optional[float] = None) -> None:
        """metrics.prom at hop ends and heartbeats; never allowed to hurt the ring."""
        now = self.env.wall()
        self._metrics_at = self.env.monotonic()
        self._metrics_dirty = False
        try:
            snap = metrics.snapshot(
                self.journal, now=now,
                current=(agent, now - run_started_at) if agent and run_started_at else None,
                heartbeat_at=now, driver_started_at=self.env.started_at,
                laps=self.lap - 1, roster=self.view().roster,
                roster_error=self.roster.error is not None, state_dir=self.state_dir,
                role=self.leader.role if self.leader is not None else "leader", ring=self.config.ring,
                quotas=self.config.quotas, due=self.due_seen,
                silent_after=self.config.alerts.silent_after)
            metrics.write_metrics(self.state_dir, metrics.render(snap))
            self._metrics_failing = False
        except (OSError, JournalError) as e:
            if not self._metrics_failing:
                self.log(f"cannot write metrics: {e}", ERR)
            self._metrics_failing = True

    def watch_silence(self) -> None:
        """``alerts.silent_after`` and ``alerts.paused_longer_than``, looked at once a
        beat: one alert (and one event) per silence and per pause, as
        :func:`ringd.core.silence.alerts_due` decides; the marks live in the
        journal, so a restarted driver never raises one again. Off: no read at all."""
        a = self.config.alerts
        if a.silent_after is None and a.paused_longer_than is None:
            return
        if self.leader is not None and self.leader.must_stop():
            return   # a standby: the leader watches
        now = self.env.wall()
        try:
            with self.journal.snapshot() as tx:
                states, pauses, marks = tx.agents(), tx.pauses(), tx.alert_marks()
            due = silence.alerts_due(silence.silent_agents(states, self.view().names, now, a.silent_after),
                                     silence.pauses_too_long(pauses, now, a.paused_longer_than), marks)
            if not due.changed:
                return
            with self.journal.transaction() as tx:
                tx.set_alert_marks(marks, due.marks)
                for kind, who, since in due.fire:
                    tx.event(None, kind, "driver", silence_detail(kind, who, since, now), now, agent=who or None)
        except JournalError as e:
            if not self._silence_failing:
                self.log(f"cannot look for silent agents or long pauses: {e}", ERR)
            self._silence_failing = True
            return
        self._silence_failing = False
        for kind, who, since in due.fire:
            detail = silence_detail(kind, who, since, now)
            self.log(detail, WARNING)
            self.alert(kind, who or None, detail, since=iso(since), seconds=round(now - since, 3))

    def alert(self, kind: str, agent: Optional[str], detail: str, **extra) -> None:
        alerts.fire(self.config.alerts.command, kind, agent, detail, self.state_dir, extra,
                    timeout=self.config.alerts.timeout, log=self.log)

    def alert_closed(self, closed: transitions.Closed) -> None:
        for kind, detail in alerts_after(closed.agent, closed.status, closed.source, closed.settled,
                                         self.config.alerts.failures_in_a_row):
            self.alert(kind, closed.agent, detail, run_id=closed.run_id)

    def reap_orphans(self, journal: Journal, kill_by: Optional[float] = None) -> None:
        """Close the run a dead driver left ``running`` in ``journal`` (at start-up, and
        in a journal taken up under us); this driver's own live run is never one.
        ``kill_by``: the deadline of its leftovers' kill (reaper.kill_orphan)."""
        reap(journal, self.state_dir, self.config, me=(self.env.pid, self.env.pid_start), log=self.log,
             line_of={a.name: a.text for a in self.roster.agents}.get, on_reaped=self.on_reaped,
             kill_by=kill_by)

    def on_reaped(self, row, closed: transitions.Closed) -> None:
        self.alert(events.RUN_REAPED, row.agent, f"run {row.id} of {row.agent} was left running "
                                                 f"({orphan_cause(row, (self.env.pid, self.env.pid_start))}); "
                                                 f"closed as interrupted", run_id=row.id)
        self.alert_closed(closed)

    def after_run(self, result: HopResult) -> None:
        # Metrics are rewritten at the next heartbeat (and at the stop), never on
        # the hop path: a ring of sub-second agents would spend its time on them.
        self._metrics_dirty = True
        if result.closed is not None:
            self.alert_closed(result.closed)
        self.spin = spin_after_run(self.spin, result.status, result.duration, self.config.ring.fast_fail)
        self._runs_since_prune += 1
        if self._runs_since_prune >= PRUNE_EVERY:
            self.prune_journal()

    def use_kept_after(self) -> Optional[float]:
        """Retention keeps every run whose quota use is still inside a window."""
        windows = [p.window for p in self.config.quotas.values()]
        return self.env.wall() - max(windows) if windows else None

    def prune_journal(self) -> None:
        """Journal retention (``ring.keep_runs``): one batch (up to PRUNE_BATCH runs)
        at heartbeats and every PRUNE_EVERY runs - off the ordinary hop, and still
        faster than any ring adds runs."""
        self._runs_since_prune = 0
        if not self.config.ring.keep_runs:
            return
        logged: "list[tuple[int, str]]" = []
        try:
            self.journal.prune(self.config.ring.keep_runs, logged=logged,
                               keep_use_after=self.use_kept_after())
            self._prune_failing = False
        except JournalError as e:   # never allowed to hurt the ring; say so once
            if not self._prune_failing:
                self.log(f"cannot prune the journal (ring.keep_runs): {e}", ERR)
            self._prune_failing = True
            return   # (nothing was deleted: the transaction rolled back)
        # The logs of the runs that went, of agents no longer on the roster: no
        # command reaches them now, and nothing else would ever prune them (keep_logs
        # prunes an agent's logs as it runs). An agent on the roster keeps its newest.
        names = set(self.view().names)
        gone: "dict[str, list[int]]" = {}
        for run_id, agent in logged:
            if agent not in names:
                gone.setdefault(agent, []).append(run_id)
        for agent, run_ids in gone.items():
            self.env.drop_logs(agent, run_ids)

    # --- leadership (a many-host ring) --------------------------------------------------
    def stand_by(self) -> bool:
        """A many-host ring's driver without the lease: beat (each beat tries to
        take it) until it leads; then write the end of its own last run if it
        knows one, and close the lapsed leader's run. False if told to stop first."""
        leader = self.leader
        if leader.must_stop():
            self.env.notify("STATUS=standby: another driver leads the ring")
            self.log("standing by: another driver leads the ring (or the journal is unreachable)", INFO)
        while not self.stop_requested:
            if not leader.must_stop():
                try:
                    self.flush()   # a run this driver saw end is written, never reaped
                    if self.stop_requested:
                        break
                    if self.pending is None and not leader.must_stop():
                        leader.settle_takeover(self.config, on_reaped=self.on_reaped)
                        return True
                except (JournalError, OSError) as e:
                    self.log(f"cannot close the lapsed leader's run yet: {e}", WARNING)
            sigs, _ = self.env.wait(self.config.ring.heartbeat_interval)
            self.absorb(sigs)
            self.beat()
        return False

    def lead(self) -> bool:
        """Before a turn: still leading (or took over: continue after the lapsed
        leader's run)? False when told to stop while standing by."""
        if self.leader is None or not (self.leader.must_stop() or self.leader.took_over):
            return True
        self.flush()
        if not self.stand_by():
            return False
        self.resume_from_journal()
        return True

    def reopen_journal(self) -> None:
        """journal.db, or its -wal or -shm, was removed (to start afresh) or
        replaced under us: our connection wrote where no reader looks, and
        operator requests (pause, skip, resume) went to a journal we never read.
        Between runs, take up the files now at the path - made anew if there
        are none, as at start-up - and say so: the history and counters are the
        new journal's (a lone -wal or -shm gone: ours, saved into journal.db
        when no other process wrote meanwhile; Journal.close)."""
        self.flush()   # the last run's end, into the journal it started in
        what = self.journal.replaced() or str(self.journal.path)
        # Closed first: the close removes our journal.db-wal/-shm at the path, which
        # a new journal there would otherwise take up as its own (Journal.close).
        # Should the new one not open (a full disk), the next turn tries again.
        fate = self.journal.close()
        new = Journal.open(self.state_dir, verify=True, give_up=self.stop_pending)
        try:
            new.start_ids_after(safefile.highest_run_log_id(self.state_dir))   # no old run log reused
            # Reaped as at start-up: a backup restored there holds the run going when it
            # was taken - ours, long ended - `running`, and every start would meet it.
            self.reap_orphans(new)
        except JournalError:
            new.close()   # (the next turn opens it again)
            raise
        new.on_taken_up = self.journal_taken_up
        self.journal, self.journal_moved, self.unconfirmed, self.quota_read = new, False, {}, None
        self._noted_roster = None   # (the new journal knows nobody's join yet)
        if fate == "saved":
            self.log(f"{what} was removed or replaced under the driver; its journal was closed with "
                     f"nothing lost and opened again", WARNING)
        elif fate == "lost":
            self.log(f"{what} was removed or replaced under the driver and another process began a new one: "
                     f"the driver's writes since the journal's last checkpoint are lost; using the journal "
                     f"now there (what others wrote since is kept)", ERR)
        else:
            self.log(f"{new.path} was removed or replaced under the driver; using the journal now there "
                     f"(history and counters start from it)", WARNING)
        try:
            self.journal.set_meta("roster_error", self.roster.error)   # what status reads of it
        except JournalError as e:
            self.log(f"cannot record the roster state in the journal: {e}", ERR)
        self._metrics_dirty = True

    def resume_from_journal(self) -> None:
        """Go on after the last turn the journal records (a scheduled agent's
        run is not one: schedule.last_turn), and at its lap: at start-up and
        after a takeover (the leader before us counted laps meanwhile)."""
        self.quota_read = None   # (the runs of a leader before us spent too)
        last = schedule.last_turn(self.journal, self.config, self.journal.last_run())
        self.cursor = (last.agent, last.position) if last else (None, None)
        if self.journal.meta(schedule.ROUND_KEY) is not None:
            # a new driver (or leader) starts a new round: a job due again at once runs at start
            with self.journal.transaction() as tx:
                schedule.write_round(tx, frozenset())
        self.cursor_roster = None   # (the journal keeps no roster: its position rule)
        lap = self.journal.meta("lap")   # laps count on across restarts; status reads it live
        self.lap = int(lap) if lap and lap.isascii() and lap.isdigit() else 1

    # --- the loop ---------------------------------------------------------------------
    def run(self) -> int:
        if self.leader is not None:
            self.env.prove_containment()
            self.beat()
            self.env.ready()  # a standby is a started, healthy driver
            if not self.stand_by():
                self.shutdown()
                return EX_OK
        try:
            self.resume_from_journal()
            self.journal.set_meta("roster_error", self.roster.error)
        except JournalError as e:
            return startup_journal_exit(e, self.env, self.log)
        turns_left = len(self.roster.agents) if self.once else None
        self.env.index_run_logs(a.name for a in self.roster.agents)
        self.write_metrics()   # (the slow part of a beat: done before the proof, so the beat below skips it)
        # Proven as late as it can be: its cgroup migration waits out the kernel's
        # grace period, so the first run's step into its cgroup does not (Containment.prove).
        self.env.prove_containment()
        self.beat()
        self.env.ready()
        self.env.notify(f"STATUS=running the ring of {len(self.roster.agents)} agent(s)")
        self.log(f"driver started: {len(self.roster.agents)} agent(s), state {self.state_dir}", INFO)
        while True:
            self.hear()
            if self.stop_requested or (turns_left is not None and turns_left <= 0):
                break
            self.beat_if_due()
            try:
                if not self.lead():
                    break
                self.reload()
                if self.journal_moved:
                    self.reopen_journal()
                taken = self.turn(turns_left)
            except JournalError as e:
                if not e.transient:
                    # an unusable journal: nothing can be recorded; any agent is already stopped
                    self.log(f"journal unusable, stopping: {e}", ERR)
                    self.exit_code = EX_CONFIG
                    break
                self.log(f"journal failure, turn not taken: {e}", ERR)
                try:
                    self.pause(min(JOURNAL_RETRY[1], max(JOURNAL_RETRY[0], self.config.ring.heartbeat_interval)))
                except JournalError as e2:   # the last run's end met an unusable journal
                    self.log(f"journal unusable, stopping: {e2}", ERR)
                    self.exit_code = EX_CONFIG
                    break
                continue
            if turns_left is not None:
                turns_left -= taken
        self.shutdown()
        return self.exit_code

    def turn(self, limit: Optional[int]) -> int:
        """Choose and take one turn, or wait when none is due. Returns how many
        roster positions it went through (for ``--once``)."""
        env = self.env
        view = self.view()
        agents, roster = view.agents, view.roster
        start = next_index(view.names, *self.cursor, self.cursor_roster)
        now = env.wall()
        started, plan, hop, ran, gate = None, None, None, frozenset(), None
        pending, closed = self.pending, None
        unconfirmed, lost = list(self.unconfirmed.items()), []
        # the last run's end, the operator's controls, the choice and the next start commit together
        try:
            with self.journal.transaction() as tx:
                if pending is not None:
                    closed = pending.write(tx)
                lost = self.close_unconfirmed(tx, unconfirmed, now)
                if self._noted_roster is not agents:   # who is on the roster since when (silence)
                    tx.note_roster(view.names, now)
                controls = tx.controls(first=roster[start][0])   # (others' pauses: as the turn walks)
                # read paused or not: the first look at a schedule is recorded (schedule.entry),
                # so one first seen during a pause counts from then, and a slot that passed in
                # the pause runs on resume - not from the resume, a slot later
                scheduled = self.schedules(tx, now)
                # the round lives in the journal, where ``ringd status`` reads it too
                ran = schedule.read_round(tx) if scheduled else frozenset()
                if not controls.ring_paused:
                    states = transitions.AgentStates(tx, now, self.config.ring)
                    gate = self.quota_gate(tx, view, now, scheduled, controls.paused)
                    plan = plan_turn(TurnInputs(roster, start, states, now, limit=limit, paused=controls.paused,
                                                requested=tx.take_next(controls),
                                                scheduled=scheduled, ran_scheduled=ran,
                                                scheduled_at=view.scheduled_at, quota=gate))
                    new_lap = (plan.index is not None and not plan.forced and not plan.scheduled
                               and self.cursor[0] is not None   # (a first turn ever begins lap 1)
                               and wraps(view.names, *self.cursor, plan.index, self.cursor_roster))
                    if new_lap and not self.at_lap_start:
                        plan = None   # a new lap: count it (and pause) before anything starts
                    elif plan.again:
                        pass          # a new round of scheduled runs: slow down first if need be
                    elif plan.index is not None:
                        agent = agents[plan.index]
                        d = plan.decision
                        if d.line_changed:
                            transitions.lift(tx, agent.name, now, "roster line changed", source="driver")
                        if d.action is Action.SKIP:
                            transitions.skip_turn(tx, agent.name, plan.index, d.reason or "skipped", now)
                        else:
                            limits = self.config.limits_for(agent.name)
                            started = tx.start_run(agent.name, plan.index, now=now, run_budget=limits.run_budget,
                                                   stall_threshold=limits.stall_threshold, driver_pid=env.pid,
                                                   driver_start=env.pid_start)
                            if plan.scheduled:
                                schedule.record_start(tx, agent.name, now)
                            hop = Hop(self, agent, plan.index, started, now, quota_env=gate and gate.env(agent.name))
                if scheduled and (after := round_after(ran, plan, view.names, ring_paused=controls.ring_paused,
                                                       once=self.once)) != ran:
                    schedule.write_round(tx, after)
        except BaseException:
            if started is not None:   # not committed - or was it? (the next turn closes it if so)
                self.unconfirmed[started] = (agent.name, plan.index)
            raise
        self.unconfirmed = {}
        self._noted_roster = agents
        for run_id, name in lost:
            self.log(f"run {run_id}: {name} closed as interrupted: {UNCONFIRMED_START}", WARNING)
        if pending is not None:
            self.pending = None
            if hop is not None:   # said and alerted once the next agent is started (Hop.after_start)
                hop.after_start = lambda: self.after_run(pending.done(closed))
            else:
                self.after_run(pending.done(closed))
        return self.take(plan, view, limit, controls.ring_paused, ran, now, started, hop)

    def take(self, plan, view, limit: Optional[int], ring_paused: bool, ran, now: float,
             started: Optional[int], hop: Optional[Hop]) -> int:
        """Act on the turn the journal's transaction chose: wait out a pause, count a
        lap, idle, or run the hop it started. Returns the roster positions gone through."""
        env = self.env
        if plan is not None and plan.index is not None:
            agent, d = view.agents[plan.index], plan.decision
        if ring_paused:
            return self.wait_paused(limit)
        if self.paused_said:
            self.paused_said = False
            self.log("ring resumed by the operator", INFO)
        if plan is None:
            self.lap_boundary()
            return 0
        if plan.again:   # the job due again starts the next round
            self.end_round(ran)
            return 0
        if plan.index is None:
            if self.once:
                return len(plan.passed) or 1
            self.end_round(ran)
            self.idle(plan.until, now)
            return 0
        self.idle_logged = False
        if plan.scheduled:
            # a scheduled agent's run is not a turn: the ring's position and lap stay
            if started is None:
                self.log(f"{agent.name}: scheduled run skipped ({d.reason})", INFO)
                return 0
            self.log(f"{agent.name}: due ({self.config.schedule_for(agent.name).describe()})", INFO)
            env.notify(f"STATUS=lap {self.lap}: running {agent.name} (scheduled)")
            self.ended(hop.run())
            return 0
        if not plan.forced:   # ``ringd next`` is out of order: the ring then goes on from its place
            self.at_lap_start = False
            self.cursor, self.cursor_roster = (agent.name, plan.index), view.names
        if d.action is Action.RUN and d.reason:   # line changed, probation
            self.log(f"{agent.name}: {d.reason}", INFO)
        if started is None:
            self.log(f"{agent.name}: turn skipped ({d.reason})", INFO)
            return len(plan.passed) + 1
        env.notify(f"STATUS=lap {self.lap}: running {agent.name}")
        self.ended(hop.run())
        return 0 if plan.forced else len(plan.passed) + 1

    def close_unconfirmed(self, tx, unconfirmed: list, now: float) -> list:
        """A start that did commit left a `running` row with no process: every
        later start would be refused (one running row). Closed before anything
        starts (SQLite may hand its id out again). Returns [(run id, agent)] closed."""
        lost = []
        for run_id, (name, position) in unconfirmed:
            if transitions.close_in(tx, run_id, name, position, "interrupted", source="driver",
                                    now=now, ring=self.config.ring, reason=UNCONFIRMED_START):
                lost.append((run_id, name))
        return lost

    def ended(self, end: "Pending | HopResult") -> None:
        if isinstance(end, Pending):
            self.pending = end   # committed with the next turn's start, or alone before any wait
        else:
            self.after_run(end)

    def flush(self) -> None:
        """Commit the last run's end now (before a wait, a stop, a hand-over).
        While the state dir is full or read-only, or another process holds the
        journal's write lock: say why once, keep beating and retry. Told to stop
        while another process holds the lock, the driver goes on trying for
        END_WRITE_WAIT, so an end it saw is recorded as it was, never reaped
        later as ``interrupted``; only past that bound (or at once, for a
        failure no short wait mends) does the row stay ``running`` for the next
        driver's reaper.
        A many-host driver that loses its lead meanwhile keeps the end it knows,
        and writes it once it leads again (:meth:`stand_by`): a driver never
        reaps a run it saw end. An unusable journal is raised (the agent is gone)."""
        pending = self.pending
        if pending is None:
            return
        delay, failing, give_up_at = 0.2, False, None
        while True:
            if self.leader is not None and self.leader.must_stop():
                return   # kept: written if this driver leads again, else the next leader's reaper decides
            try:
                with self.journal.transaction() as tx:
                    closed = pending.write(tx)
            except JournalError as e:
                if not e.transient:
                    self.pending = None
                    raise
                if self.stop_requested and not e.busy:
                    self.pending = None   # (a full disk, an unreachable server: no wait within a stop mends it)
                    pending.hop.say(f"ended, but its end could not be recorded ({e}); the next driver's reaper "
                                    f"closes it", ERR)
                    return
                if self.stop_requested:
                    now = self.env.monotonic()
                    if give_up_at is None:
                        give_up_at = now + END_WRITE_WAIT
                        pending.hop.say(f"ended; trying for up to {END_WRITE_WAIT:g}s to record its end before "
                                        f"the driver stops ({e})", WARNING)
                    elif now >= give_up_at:
                        self.pending = None
                        pending.hop.say(f"ended, but its end could not be recorded within {END_WRITE_WAIT:g}s "
                                        f"of the stop ({e}); the next driver's reaper closes it", ERR)
                        return
                    failing = True
                    self.absorb(self.env.wait(min(END_WRITE_RETRY, give_up_at - now))[0])
                    self.beat_if_due()
                    continue
                if not failing:
                    until = getattr(e, "retry_until", "the state dir is writable")
                    pending.hop.say(f"ended, but its end cannot be recorded ({e}); retrying until {until}", ERR)
                failing = True
                sigs, _ = self.env.wait(delay)
                self.absorb(sigs)
                self.beat()
                delay = min(delay * 2, 5.0)
                continue
            if failing:
                pending.hop.say("end recorded", INFO)
            self.pending = None
            self.after_run(pending.done(closed))
            return

    def wait_paused(self, limit: Optional[int]) -> int:
        """``ringd pause``: start nothing; beat, and wake on the operator's SIGUSR1
        (``ringd resume``), else look again after a heartbeat interval (a leader
        also checks its lease at the loop's top). A paused ``--once`` runs nothing."""
        if not self.paused_said:
            self.paused_said = True
            self.log("ring paused by the operator: starting nothing until `ringd resume`", INFO)
            self.env.notify("STATUS=paused (ringd resume)")
        if self.once:
            return limit or 1
        # (a pause ends the round of scheduled runs: policy.round_after)
        self.pause(self.config.ring.heartbeat_interval)
        return 0

    def view(self) -> "RingView":
        """The roster as each turn reads it, rebuilt only when the roster or the
        config is reloaded, not at every hop."""
        agents, config = self.roster.agents, self.config
        if self._view.agents is not agents or self._view.config is not config:
            if self._view.agents is not agents:
                self.env.roster_is(a.name for a in agents)   # (what it keeps of agents is theirs only)
            scheduled = [(a.name, config.schedule_for(a.name)) for a in agents]
            self._view = RingView(agents, config, [(a.name, a.text) for a in agents], [a.name for a in agents],
                                  [(name, sched) for name, sched in scheduled if sched is not None],
                                  {name: i for i, (name, sched) in enumerate(scheduled) if sched is not None},
                                  *pooled(config, agents))
        return self._view

    def schedules(self, tx, now: float) -> "dict[str, float]":
        """Next due time of each scheduled agent on the roster (SPEC "Scheduled agents")."""
        scheduled = self.view().scheduled
        if not scheduled:
            return {}
        zone = schedule.local_zone()
        return {name: schedule.entry(tx, name, sched, now).next_due(zone) for name, sched in scheduled}

    def quota_gate(self, tx, view: "RingView", now: float, scheduled, paused) -> Optional[quota.Gate]:
        """The quota side of this turn (None: no agent on the roster draws on a
        pool): each pool's use in its window and its last exhausted report, in
        one read of the journal (SPEC "Agents on a shared quota"), kept while it
        holds (quota.Read: a read sums every use in the window, 0.2 ms per
        1,000 uses, and only this driver's runs change them)."""
        if not view.pool_of:
            return None
        read = self.quota_read
        if read is None or not read.holds(view.windows, now):
            read = self.quota_read = quota.Read(now, view.windows, *tx.quota_use(dict(view.windows), now))
        gate = quota.Gate(self.config.quotas, view.pool_of.get, read.uses, now, exhausted=read.exhausted,
                          due=scheduled, paused=paused)
        self.due_seen = scheduled
        self.say_quota(gate, view.windows)
        return gate

    def say_quota(self, gate: quota.Gate, windows: tuple) -> None:
        """Say when a pool stops letting its ordinary agents run, and when it
        lets them again (once each, not at every turn that passes them over)."""
        for name, _ in windows:
            st = gate.standing(name)
            hold = st.hold(None)
            if (hold is not None) == (name in self.quota_held):
                continue
            if hold is None:
                self.quota_held.discard(name)
                self.log(f"quota {name}: open again, {st.left_for(None)} of {st.pool.limit} left", INFO)
                continue
            self.quota_held.add(name)
            reserved = f", {st.reserved_total} reserved for {', '.join(sorted(st.reserved))}" if st.reserved else ""
            until = ("until an operator or a scheduled run changes it" if hold.until is None else
                     f"until {schedule.wall_clock(hold.until).strftime('%H:%M:%S')} "
                     f"(in {max(0.0, hold.until - gate.now):.1f}s)")
            self.log(f"{hold.reason}: {st.used} of {st.pool.limit} used in its "
                     f"{st.pool.window:g}s window{reserved}; its agents wait {until}", INFO)

    def lap_boundary(self) -> None:
        """A new lap starts when the ring wraps: count it, pause if configured, and
        slow down if every run of the lap failed at once (SPEC: never spins)."""
        self.at_lap_start = True
        self.lap += 1
        try:
            self.journal.set_meta("lap", str(self.lap))
        except JournalError as e:   # state dir full or read-only: the ring goes on
            self.log(f"cannot record lap {self.lap} in the journal: {e}", ERR)
        self.spin = spin_at_lap_end(self.spin, self.config.ring.backoff_max)
        if self.once:
            return
        self.slow_down_if_spinning()
        if self.config.ring.lap_pause > 0:
            self.pause(self.config.ring.lap_pause)

    def end_round(self, ran: frozenset) -> None:
        """A round of scheduled runs (``ran``) ends with no ordinary turn (nothing
        else is due, or a job is due again; policy.round_after): a ring of
        scheduled agents has no lap, so its round is one for the fast-fail guard."""
        if ran:
            self.spin = spin_at_lap_end(self.spin, self.config.ring.backoff_max)
            self.slow_down_if_spinning()

    def slow_down_if_spinning(self) -> None:
        """At the end of a lap (or of a round of scheduled runs): wait ``spin.delay``
        if every run of it failed at once (SPEC: a ring that fails at once never spins)."""
        if self.spin.delay > 0:
            if not self.spin_logged:
                self.log(f"every run of the last lap failed within {self.config.ring.fast_fail:g}s; "
                         f"waiting between laps (from 1s, doubling up to {self.config.ring.backoff_max:g}s)", WARNING)
                self.spin_logged = True
            self.pause(self.spin.delay)
        else:
            self.spin_logged = False

    def idle(self, until: Optional[float], now: float) -> None:
        """Nothing is due (every agent backing off, quarantined ...): wait until the
        first one is, hearing signals, beating and watching the roster meanwhile."""
        delay = None if until is None else max(0.0, until - now)
        if not self.idle_logged:
            self.log("nothing to run: every agent is backing off, quarantined, paused, not due "
                     "or held by its quota" + (f"; next in {delay:.1f}s" if delay is not None else ""), WARNING)
            self.idle_logged = True
        self.pause(delay, until_roster_edit=True, wall_until=until)

    def shutdown(self) -> None:
        try:
            self.flush()
        except JournalError as e:
            self.log(f"journal unusable, the last run's end is not recorded: {e}", ERR)
        self.env.notify("STOPPING=1")
        if self.leader is not None:
            self.leader.release()  # a standby takes over at once, not after the TTL
        self.write_metrics()
        try:
            self.env.beat(lap=self.lap, agent=None, run_id=None, stopped=True, extra=self.facts())
        except OSError as e:
            self.log(f"cannot record the clean stop in the heartbeat: {e}", ERR)
        self.log("driver stopped", INFO)


def echo_to_terminal() -> None:
    """A driver started by a watcher on a terminal (``RING_ECHO_FD``, the
    watcher's stderr: driverproc.start_driver) writes its log lines there too,
    as ``ringd run`` in the foreground does: the quick start shows the ring
    turning. Taken out of the environment, so no agent inherits the name."""
    from ringd.host import logline
    raw = os.environ.pop("RING_ECHO_FD", None)
    if raw is not None and raw.isascii() and raw.isdigit():
        logline.echo_to(int(raw))


def silence_detail(kind: str, who: str, since: float, now: float) -> str:
    """The one line a silence's or a long pause's alert and log say."""
    quiet = fmt_span(now - since)
    if kind == events.SILENT:
        return f"{who}: silent: no ok run for {quiet} (since {iso(since)})"
    return (f"{'the ring' if not who else who}: paused for {quiet} (since {iso(since)}); "
            f"`ringd resume{'' if not who else ' ' + who}` lifts it")


def fmt_span(seconds: float) -> str:
    """``3d 4h``, ``2h 5min``, ``40s``: a silence's or a pause's length, as a time span."""
    s = int(max(0.0, seconds))
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "min", 60)):
        if s >= size:
            rest = (s % size) // sub_size
            return f"{s // size}{unit}" + (f" {rest}{sub}" if rest else "")
    return f"{s // 60}min" if s >= 60 else f"{s}s"


def run_driver(state_dir: Path, config_path: Optional[Path], *, once: bool = False,
               logger: Callable[[str, int], None] = log, found=None) -> int:
    """``ringd run``: returns the process exit code. Errors are one line on stderr.
    ``found``: how the command line found the config and state dir
    (config.Location): said when they were not given, and always when the
    ring falls back to the built-in defaults."""
    proctree.close_on_exec_all()   # nothing we inherited reaches an agent (proctree.spawn)
    echo_to_terminal()
    if found is not None and (found.found.config_from not in ("--config", "$RING_CONFIG")
                              or found.found.state_from not in ("--state", "$RING_STATE")):
        state_line, config_line = found.says()
        logger(f"config {config_line}; state dir {state_line}", INFO)
    try:
        inputs = inputs_for_run(state_dir, config_path)   # (ringd check's rule)
        config = inputs.config
        for w in config.warnings:
            logger(f"warning: {w}", WARNING)
        prepare_state_dir(state_dir)
        caller_umask = os.umask(0o077)  # journal, heartbeat, logs: 0600 whatever the umask
        roster = RosterSource(inputs.roster_path)
        roster.refresh(force=True)
        if roster.error:
            raise ConfigError(roster.error)
        lock = acquire_lock(state_dir)
    except RingError as e:
        logger(f"configuration error: {e}" if isinstance(e, ConfigError) else str(e), ERR)
        return e.code
    env = RealEnv(state_dir, logger, prove_containment=False)   # proven just before the first run (Driver.run)
    me = (env.pid, env.pid_start)
    leader = None
    try:
        if config.ring.journal:
            from ringd.journal.pg import PgJournal
            from ringd.loops.leader import Leader
            # its calls are bounded, and a stop signal ends one in flight (pgcall)
            journal = PgJournal.connect(config.ring.journal, ttl=config.ring.lease_ttl, tap=env.wakeups)
            journal.stop_recording()  # until this driver takes the lease
            repaired = journal.take_repaired()
            if repaired:
                logger(f"journal schema: {', '.join(repaired)} missing (dropped by hand?); made again", WARNING)
            leader = Leader(journal, config.ring.lease_ttl, logger, env)
            config = for_leadership(config)
        else:
            journal = Journal.open(state_dir, verify=True, give_up=env.stop_pending)   # a stop heard at once
            journal.start_ids_after(safefile.highest_run_log_id(state_dir))  # a reset journal: no old log reused
            journal.preallocate_wal()   # the first ~150 commits no longer grow the file
    except JournalError as e:
        code = startup_journal_exit(e, env, logger)
        lock.release()
        env.close()
        return code
    # Before the sweep below, which kills every run cgroup of this ring: a live
    # driver's run is in one. (A many-host ring's lease decides instead.)
    other = live_driver(state_dir, me, journal if leader is None else None)
    if other is not None:
        logger(f"{state_dir / LOCK_FILE}: another driver (pid {other}) is alive though its lock file "
               f"was removed; not starting beside it", ERR)
        journal.close()
        lock.release()
        env.close()
        return EX_TEMPFAIL
    proctree.set_child_subreaper()
    # One bound for the start-up's kills: the sweep and the reaper below kill the
    # same dead driver's run (its cgroup is one of the sweep's), and processes
    # SIGKILL cannot end (a hung mount) held each of their waits to its bound
    # (18 s before the first beat, deaf to a stop meanwhile).
    kill_by = env.monotonic() + cgroup.KILL_WAIT
    # (we hold the lock and no other driver lives)
    swept = cgroup.sweep(state_dir, also=env.containment.parent, deadline=kill_by)
    if swept:
        logger(f"removed {swept} run cgroup(s) left by a dead driver (anything still in them killed)", WARNING)
    driver = None
    try:
        driver = Driver(env, state_dir, config_path, for_watchdog(config), roster, journal, lock=lock, once=once,
                        agent_umask=caller_umask, base_env=dict(os.environ), leader=leader)
        if leader is None:
            # Holding the lock proves every earlier driver of this state dir dead,
            # whatever pid it had: its running row is reaped (only a live driver's
            # is not). With PostgreSQL the lease decides instead (Driver.stand_by).
            try:
                driver.reap_orphans(journal, kill_by=kill_by)
            except JournalError as e:
                return startup_journal_exit(e, env, logger)
        return driver.run()
    finally:
        journal.close()
        if driver is not None and driver.journal is not journal:   # reopened (Driver.reopen_journal)
            driver.journal.close()
        lock.release()
        env.close()
