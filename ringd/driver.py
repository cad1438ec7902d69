"""The driver loop, ``ringd run``: lock, reap, then forever: reload the roster,
pick the next agent, take its turn (run / skip / pass), beat, pause after a lap.

Every wait is one ``Wakeups.wait`` call with a timeout equal to the next thing
due, so an idle driver costs nothing.
"""
from __future__ import annotations

import dataclasses
import os
import sqlite3
import stat
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from . import alerts, metrics, proctree, safefile
from .config import Config, ConfigError, load_config
from .heartbeat import Heartbeat, Notifier, read_heartbeat
from .hop import Context, Hop, HopResult
from .journal import Journal, JournalError
from .lock import KernelLock, LockHeld
from .policy import FAILURES, turn_decision
from .reaper import reap
from .roster import RosterSource, next_index
from .wakeup import Wakeups

EXIT_OK = 0
EXIT_LOCKED = 75     # EX_TEMPFAIL: another driver holds the lock
EXIT_CONFIG = 78     # EX_CONFIG
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: the PostgreSQL journal cannot be reached at start
LOCK_FILE = "ringd.lock"
METRICS_MIN_INTERVAL = 1.0  # s between metrics rewrites at hop ends


def log(message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    sys.stderr.write(f"{stamp} ringd[{os.getpid()}]: {message}\n")
    sys.stderr.flush()


class Refused(Exception):
    """The driver cannot start: message and exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def prepare_state_dir(state_dir: Path) -> None:
    """Create a missing state dir 0700; refuse one others may write."""
    if not state_dir.exists():
        try:
            os.makedirs(state_dir, mode=0o700, exist_ok=True)
        except OSError as e:
            raise Refused(f"{state_dir}: cannot create state dir: {e.strerror}", EXIT_CONFIG) from None
    st = os.stat(state_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{state_dir}: state dir is not a directory", EXIT_CONFIG)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Refused(f"{state_dir}: state dir is writable by group or others "
                      f"(mode {stat.S_IMODE(st.st_mode):04o}); fix: chmod go-w {state_dir}", EXIT_CONFIG)


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
        raise Refused(f"{path}: another driver holds the lock"
                      f"{f' (pid {holder})' if holder else ''}", EXIT_LOCKED) from None
    except OSError as e:
        raise Refused(f"{path}: cannot lock: {e.strerror}", EXIT_CONFIG) from None


class Driver:
    def __init__(self, state_dir: Path, config_path: Optional[Path], config: Config,
                 roster: RosterSource, journal: Journal, *, once: bool = False,
                 agent_umask: int = 0o022, logger: Callable[[str], None] = log, leader=None):
        self.state_dir = state_dir
        self.config_path = config_path
        self.roster = roster
        self.once = once
        self.log = logger
        self.notifier = Notifier()
        self.wakeups = Wakeups()
        self.ctx = Context(state_dir=state_dir, config=config, journal=journal,
                           heartbeat=Heartbeat(state_dir, self.notifier), notifier=self.notifier,
                           wakeups=self.wakeups, roster_dir=roster.path.parent, log=logger,
                           roster_error=roster.error, agent_umask=agent_umask,
                           on_run_end=self.after_run, on_beat=self.beat_metrics, leader=leader)
        self.leader = leader
        self._metrics_failing = False
        self._metrics_at = float("-inf")
        self._metrics_dirty = False

    # --- helpers -------------------------------------------------------------
    @property
    def config(self) -> Config:
        return self.ctx.config

    def sleep(self, seconds: float) -> None:
        """Pause (lap pause, idle) while beating; returns early on a signal."""
        end = time.monotonic() + seconds
        while not self.ctx.stop_requested:
            now = time.monotonic()
            if now >= end:
                return
            self.ctx.beat()
            timeout = min(end - now, self.config.ring.heartbeat_interval)
            sigs, _ = self.wakeups.wait(timeout)
            if self.ctx.absorb(sigs):
                return

    # --- what others see: metrics and alerts -----------------------------------
    def beat_metrics(self, agent: Optional[str] = None, run_started_at: Optional[float] = None) -> None:
        """With a heartbeat: refresh metrics.prom unless a hop end just did."""
        due = self.config.ring.heartbeat_interval * 0.9
        if self._metrics_dirty or time.monotonic() - self._metrics_at >= due:
            self.write_metrics(agent, run_started_at)

    def write_metrics(self, agent: Optional[str] = None, run_started_at: Optional[float] = None) -> None:
        """metrics.prom at every hop end and heartbeat; never allowed to hurt the ring."""
        now = time.time()
        self._metrics_at = time.monotonic()
        self._metrics_dirty = False
        try:
            snap = metrics.snapshot(
                self.ctx.journal, now=now,
                current=(agent, now - run_started_at) if agent and run_started_at else None,
                heartbeat_at=now, driver_started_at=self.ctx.heartbeat.started_at,
                laps=self.ctx.lap - 1, roster_agents=len(self.roster.agents),
                roster_error=self.roster.error is not None, state_dir=self.state_dir,
                role=self.leader.role if self.leader is not None else "leader")
            metrics.write_metrics(self.state_dir, metrics.render(snap))
            self._metrics_failing = False
        except (OSError, sqlite3.Error) as e:
            if not self._metrics_failing:
                self.log(f"cannot write metrics: {e}")
            self._metrics_failing = True

    def alert(self, kind: str, agent: Optional[str], detail: str, **extra) -> None:
        alerts.fire(self.config.alerts.command, kind, agent, detail, self.state_dir, extra,
                    timeout=self.config.alerts.timeout, log=self.log)

    def after_run(self, result: HopResult) -> None:
        # Every hop end refreshes metrics, at most once a second: a ring of
        # sub-second agents would otherwise spend its time rewriting the file.
        # Idle waits and the stop write them too, so they settle when runs do.
        if time.monotonic() - self._metrics_at >= METRICS_MIN_INTERVAL:
            self.write_metrics()
        else:
            self._metrics_dirty = True
        self.alert_on_agent_state(result.agent, result.status, result.agent_state, run_id=result.run_id)

    def alert_on_agent_state(self, agent: str, status: str, state: dict, **extra) -> None:
        if state.get("entered_quarantine"):
            self.alert(alerts.QUARANTINED, agent,
                       f"{agent} quarantined after {state.get('bad_streak')} bad endings in a row", **extra)
        failures = state.get("consecutive_failures") or 0
        every = self.config.alerts.failures_in_a_row
        if status in FAILURES and failures and failures % every == 0:
            self.alert(alerts.FAILURES, agent, f"{agent} failed {failures} times in a row "
                                               f"(last: {status})", **extra)

    def on_reaped(self, row, state: dict) -> None:
        self.alert(alerts.RUN_REAPED, row.agent, f"run {row.id} of {row.agent} was left running by a "
                                                 f"dead driver (pid {row.driver_pid}); closed as interrupted",
                   run_id=row.id)
        self.alert_on_agent_state(row.agent, "interrupted", state, run_id=row.id)

    def reload(self, force: bool = False) -> None:
        if force and self.config_path is not None:
            try:
                self.ctx.config = for_leadership(load_config(self.config_path))
                self.log(f"config reloaded from {self.config_path}")
            except ConfigError as e:
                self.log(f"config error, keeping the running config: {e}")
        if self.roster.refresh(force=force):
            if self.roster.error:
                self.log(f"roster error, keeping the last good roster: {self.roster.error}")
            else:
                self.log(f"roster loaded: {len(self.roster.agents)} agent(s)")
            self.ctx.roster_error = self.roster.error
            try:
                self.ctx.journal.set_meta("roster_error", self.roster.error)
            except sqlite3.OperationalError as e:   # state dir full or read-only
                self.log(f"cannot record the roster state in the journal: {e}")

    # --- the loop ------------------------------------------------------------
    def stand_by(self) -> bool:
        """A many-host ring's driver without the lease: beat (each beat tries to
        take it) until it leads; then close the lapsed leader's run. False if
        told to stop first."""
        ctx, leader = self.ctx, self.leader
        if leader.must_stop():
            self.notifier.notify("STATUS=standby: another driver leads the ring")
            self.log("standing by: another driver leads the ring (or the journal is unreachable)")
        while not ctx.stop_requested:
            if not leader.must_stop():
                try:
                    leader.settle_takeover(self.config, on_reaped=self.on_reaped)
                except (sqlite3.Error, OSError) as e:
                    self.log(f"cannot close the lapsed leader's run yet: {e}")
                else:
                    return True
            sigs, _ = self.wakeups.wait(self.config.ring.heartbeat_interval)
            ctx.absorb(sigs)
            ctx.beat()
        return False

    def run(self) -> int:
        ctx = self.ctx
        journal = ctx.journal
        if self.leader is not None:
            ctx.beat()
            self.notifier.notify("READY=1")  # a standby is a started, healthy driver
            if not self.stand_by():
                self.shutdown()
                return EXIT_OK
        journal.set_meta("roster_error", self.roster.error)
        last = journal.last_run()
        cursor_name = last.agent if last else None
        cursor_pos = last.position if last else None
        turns_left = len(self.roster.agents) if self.once else None
        passes = 0          # turns in a row that started nothing (all backing off)
        prev_index = None
        ctx.beat()
        self.notifier.notify("READY=1")
        self.notifier.notify(f"STATUS=running the ring of {len(self.roster.agents)} agent(s)")
        self.log(f"driver started: {len(self.roster.agents)} agent(s), state {self.state_dir}")
        while not ctx.stop_requested:
            if turns_left is not None and turns_left <= 0:
                break
            if self.leader is not None and time.monotonic() - ctx.last_beat >= self.config.ring.heartbeat_interval:
                ctx.beat()  # a ring of quick agents never waits inside a hop: renew between turns too
            if self.leader is not None and (self.leader.must_stop() or self.leader.took_over):
                if not self.stand_by():
                    break
                last = journal.last_run()  # continue after the run the lapsed leader left
                cursor_name = last.agent if last else None
                cursor_pos = last.position if last else None
                prev_index = None
            self.reload(force=ctx.reload_requested)
            ctx.reload_requested = False
            agents = self.roster.agents
            index = next_index([a.name for a in agents], cursor_name, cursor_pos)
            if prev_index is not None and index <= prev_index:
                ctx.lap += 1
                if self.config.ring.lap_pause > 0 and not self.once:
                    self.sleep(self.config.ring.lap_pause)
                    if ctx.stop_requested:
                        break
            prev_index = index
            agent = agents[index]
            cursor_name, cursor_pos = agent.name, index
            if turns_left is not None:
                turns_left -= 1
            try:
                took = self.take_turn(agent, index)
            except (sqlite3.OperationalError, OSError) as e:
                # a skip or quarantine change that could not be written: nothing ran
                self.log(f"{agent.name}: journal or state dir failure, turn not taken: {e}")
                self.sleep(min(5.0, max(1.0, self.config.ring.heartbeat_interval)))
                took = True
            passes = 0 if took else passes + 1
            if passes >= len(agents) and not self.once:
                self.wait_for_backoff()
                passes = 0
        self.shutdown()
        return EXIT_OK

    def take_turn(self, agent, index: int) -> bool:
        """Run, skip or pass one agent. Returns False when it passed silently."""
        ctx = self.ctx
        state = ctx.journal.agent_state(agent.name)
        decision, reason = turn_decision(state, time.time(), agent.text)
        if decision == "pass":
            return False
        if state.get("quarantined_until") is not None and reason and "line changed" in reason:
            ctx.journal.set_agent(agent.name, quarantined_until=None, quarantine_line=None, bad_streak=0)
            self.log(f"{agent.name}: {reason}")
        elif state.get("quarantined_until") is not None:
            self.log(f"{agent.name}: {reason}")
        if decision == "skip":
            ctx.journal.record_skip(agent.name, index, reason or "skipped", "operator",
                                    clear_skip_request=True)
            self.log(f"{agent.name}: turn skipped ({reason})")
            return True
        ctx.notifier.notify(f"STATUS=lap {ctx.lap}: running {agent.name}")
        try:
            Hop(ctx, agent, index).run()
        except (sqlite3.Error, OSError) as e:
            # The journal could not record the run, so it was not started (or not
            # closed): say why and try again after a breath, never a silent run.
            self.log(f"{agent.name}: journal or state dir failure, run not recorded: {e}")
            self.sleep(min(5.0, max(1.0, self.config.ring.heartbeat_interval)))
        return True

    def wait_for_backoff(self) -> None:
        """Every agent is backing off or quarantined: sleep until the first one is due."""
        states = self.ctx.journal.agent_states()
        now = time.time()
        dues = [s[k] for s in states.values() for k in ("backoff_until", "quarantined_until")
                if s.get(k) is not None and s[k] > now]
        delay = (min(dues) - now) if dues else self.config.ring.heartbeat_interval
        self.log(f"nothing to run: every agent is backing off; next in {delay:.1f}s")
        self.sleep(delay)

    def shutdown(self) -> None:
        self.notifier.notify("STOPPING=1")
        if self.leader is not None:
            self.leader.release()  # a standby takes over at once, not after the TTL
        self.write_metrics()
        try:
            self.ctx.heartbeat.beat(lap=self.ctx.lap, agent=None, run_id=None, stopped=True)
        except OSError as e:
            self.log(f"cannot record the clean stop in the heartbeat: {e}")
        self.log("driver stopped")


def for_leadership(config: Config) -> Config:
    """A many-host driver beats (and renews its lease) at least twice per half
    TTL, whatever ``heartbeat_interval`` says."""
    if not config.ring.journal:
        return config
    from .lease import beat_every
    every = beat_every(config.ring.lease_ttl, config.ring.heartbeat_interval)
    return dataclasses.replace(config, ring=dataclasses.replace(config.ring, heartbeat_interval=every))


def run_driver(state_dir: Path, config_path: Optional[Path], *, once: bool = False,
               logger: Callable[[str], None] = log) -> int:
    """``ringd run``: returns the process exit code. Errors are one line on stderr."""
    try:
        config = load_config(config_path)
        for w in config.warnings:
            logger(f"warning: {w}")
        prepare_state_dir(state_dir)
        caller_umask = os.umask(0o077)  # journal, heartbeat, logs: 0600 whatever the umask
        roster = RosterSource(config.roster_path(state_dir))
        roster.refresh(force=True)
        if roster.error:
            raise Refused(roster.error, EXIT_CONFIG)
        lock = acquire_lock(state_dir)
    except ConfigError as e:
        logger(f"configuration error: {e}")
        return EXIT_CONFIG
    except Refused as e:
        logger(str(e))
        return e.code
    leader = None
    try:
        if config.ring.journal:
            from .journal_pg import PgJournal
            from .leader import Leader
            journal = PgJournal.connect(config.ring.journal, ttl=config.ring.lease_ttl)
            journal.stop_recording()  # until this driver takes the lease
            leader = Leader(journal, config.ring.lease_ttl, logger)
            config = for_leadership(config)
        else:
            journal = Journal.open(state_dir, verify=True)
            journal.start_ids_after(safefile.highest_run_log_id(state_dir))  # a reset journal: no old log reused
    except JournalError as e:
        logger(str(e))
        lock.release()
        return EXIT_CONFIG if leader is None and not config.ring.journal else EXIT_UNAVAILABLE
    proctree.set_child_subreaper()
    try:
        driver = Driver(state_dir, config_path, config, roster, journal, once=once,
                        agent_umask=caller_umask, logger=logger, leader=leader)
        if leader is None:
            # the lock proves every earlier driver of this state dir is dead; with
            # PostgreSQL the lease decides instead (Driver.stand_by)
            reap(journal, state_dir, config, lock_held=True, log=logger, on_reaped=driver.on_reaped)
        return driver.run()
    finally:
        journal.close()
        lock.release()
