"""One hop: run one agent to its end and close its journal row.

The row is ``running`` (committed, fsync'd) before the process starts - the
driver wrote it in the transaction that chose the turn. Then the hop sleeps on
events (the agent's pidfd, signals, the next deadline) and feeds what it sees to
the pure run state machine (:mod:`ringd.core.runstate`), carrying out the actions it
returns: beat, SIGTERM the group, kill the tree, close the row. However the run
ends, nothing it started survives it. Every effect goes through the driver's
:class:`ringd.host.env.RealEnv` (or a test's fake).

An ordinary hop costs one commit: the end of the previous run, the turn's
choice and the start of this one, in one transaction, before this process
starts (the driver commits an end alone before it waits for anything). The
agent's pid is recorded in a write of its own only when the run lives past
``PID_RECORD_DELAY`` (status and the reaper need it then; a run that ends
sooner records it with its end).
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol, Set, Union

from ringd.core import levels, quota, runstate
from ringd.core.levels import ERR, INFO, WARNING
from ringd.journal import transitions
from ringd.inputs.config import Config
from ringd.journal.sqlite import Journal, JournalError
from ringd.host.seam import DriverEnv
from ringd.host.notify import Notes, watchdog_usec
from ringd.core.policy import Requests, is_outage, outage_retry_after
from ringd.inputs.roster import Agent, resolve_cwd, resolve_program
from ringd.core.runstate import Beat, Close, Exited, KillTree, Log, Phase, Ping, SetPhase, Skip, Stop, Term, Tick, Trigger

PID_RECORD_DELAY = 0.1   # s; a run alive this long gets its pid recorded before its end
PID_RECORD_RETRY = 1.0   # s; a pid record the journal could not take now is tried again this much later
USE_RECORD_INTERVAL = 1.0   # s between two records of a run's quota use while it runs (a flood: one a second)


class Host(Protocol):
    """What a hop needs from its driver."""
    env: DriverEnv
    journal: Journal
    config: Config
    state_key: str
    roster_dir: Path
    agent_umask: int
    base_env: dict        # the driver's environment, cleaned (proctree.clean_env)
    stop_requested: bool
    stop_reason: str
    next_beat: float
    notify_dropped: int   # datagrams its runs' notify sockets did not hear, in the driver's life
    leader: object   # leader.Leader of a many-host ring (None: SQLite, always leading)
    quota_read: object   # the pools' use as the driver last read it: dropped when a run records use

    def beat(self, agent: Optional[str] = None, run_id: Optional[int] = None, run_pid: Optional[int] = None,
             run_started_at: Optional[float] = None) -> None: ...

    def absorb(self, sigs: Set[int], keep: tuple = (), agent_exited: bool = False) -> Requests: ...


@dataclass(frozen=True)
class HopResult:
    run_id: int
    agent: str
    status: str
    duration: float
    closed: Optional[transitions.Closed]   # None: someone else (operator, reaper) closed the row first


def agent_env(base, agent: str, run_id: int, budget: float, deadline: float, state_key: str) -> dict:
    """The environment of a run: the driver's ``base_env`` (ours, cleaned once
    of systemd's notify/watchdog variables by proctree.clean_env: an agent must
    never speak to systemd as the driver), plus the run's own."""
    return {**base, "RING_AGENT": agent, "RING_RUN_ID": str(run_id), "RING_RUN_BUDGET": f"{budget:g}",
            "RING_DEADLINE": f"{deadline:.3f}", "RING_STATE": state_key}


class Hop:
    def __init__(self, host: Host, agent: Agent, position: int, run_id: int, started_at: float,
                 quota_env: Optional[dict] = None):
        self.host = host
        self.env = host.env
        self.agent = agent
        self.position = position
        self.run_id = run_id
        self.started_at = started_at       # wall clock, as in the row
        self.limits = host.config.limits_for(agent.name)
        self.log_path: Optional[str] = None
        self.pid: Optional[int] = None
        self.child = None   # the agent process once started (its cgroup's CPU time is read at its end)
        self.pid_start: Optional[float] = None
        self.watchdog = host.config.watchdog_for(agent.name)
        self.notify = None   # the run's notify socket (ringd.host.notify.NotifySocket), if one could be made
        self.notes = None    # what the agent said, as published for status (ringd.host.notify.Notes)
        self._notes_failing = False   # its last publication failed (said once, until one succeeds)
        self.cgroup = None   # the run's cgroup until the spawn hands it to the child
        self._log_fd: Optional[int] = None
        self._log_error: Optional[OSError] = None
        self._notify_error: Optional[OSError] = None
        self._run_env: Optional[dict] = None
        # the driver's follow-up of the previous run's end (its log line, alerts):
        # done once this agent is started, while it execs on another core
        self.after_start: Optional[Callable[[], None]] = None
        self._hook_error: Optional[Exception] = None
        self._pid_deferred = False   # its pid could not be recorded yet (said once)
        self.lost = False   # leadership lost before the agent started: nothing is recorded
        # shared quotas: the run's RING_QUOTA* (ringd.core.quota.Gate.env), what it reported
        # (recorded as it goes, at most once a USE_RECORD_INTERVAL, and with its end)
        self.quota_env = quota_env or {}
        self.pool = host.config.quota_for(agent.name)
        self.use = quota.RunUse()
        self._use_at = float("-inf")        # monotonic time of the last record of its use
        self._use_failing: Optional[str] = None
        self._reports_said: Set[str] = set()   # kinds of ignored reports said (once a run each)

    def say(self, text: str, level: int) -> None:
        self.env.log(f"run {self.run_id}: {self.agent.name} {text}", level)

    # --- the run ---------------------------------------------------------------------
    def prepare(self) -> None:
        """Make the run's files and cgroup: its log, its notify socket. Done once
        its row is committed, just before the spawn, so a row that never commits
        leaves no files. The log is always a new file (a follower holding an
        older run's log must never read this run's bytes). Effects only: what
        went wrong is said by :meth:`run`."""
        self.cgroup = self.env.make_cgroup(self.run_id)
        if self._open_log():
            self._open_voice(self.started_at)

    def _open_log(self) -> bool:
        try:
            self._log_fd, self.log_path = self.env.open_run_log(self.agent.name, self.run_id)
        except OSError as e:
            self._log_error = e
            return False
        self._log_error = None
        return True

    def _open_voice(self, started: float) -> None:
        """The run's environment (its deadline counted from ``started``) and notify socket."""
        self._run_env = agent_env(self.host.base_env, self.agent.name, self.run_id, self.limits.run_budget,
                                  started + self.limits.run_budget, self.host.state_key)
        self._run_env.update(self.quota_env)
        try:
            self.notify = self.env.open_notify(self.run_id)
        except OSError as e:
            self._notify_error = e

    def _wait_for_room(self) -> Optional[Close]:
        """The run's log cannot be made because the state dir is full (space or
        inodes), over quota, read-only or failing: an outage, never the agent's
        fault (policy.is_outage). The agent is not started until its log can be
        made: the driver beats, hears its signals and tries again (policy.
        outage_retry_after), and says so once. A stop or an operator's skip
        meanwhile closes the run as ``interrupted`` by the driver or ``skipped``
        (neither counts against the agent); leadership lost: ``self.lost``.
        None once the log is made (or the error is no longer an outage)."""
        env, host = self.env, self.host
        self.say(f"cannot make its run log yet ({env.errno_reason(self._log_error)}): the state dir is full "
                 f"or unwritable, not the agent's fault; it starts once there is room", WARNING)
        delay = outage_retry_after(None)
        retry_at = env.monotonic() + delay
        while True:
            if host.leader is not None and host.leader.must_stop():
                self.lost = True
                return None
            if host.stop_requested:
                return Close("interrupted", "driver", None, None, f"{host.stop_reason} before it could start "
                             f"(the state dir was full)")
            now = env.monotonic()
            until = min(retry_at, host.next_beat)
            if host.leader is not None:
                until = min(until, now + host.leader.seconds_left())
            sigs, _ = env.wait(max(0.0, until - now))
            if sigs and host.absorb(sigs).wake and self._skip_requested():
                return Close("skipped", "operator", None, None, "skipped by operator before it could start")
            now = env.monotonic()
            if now >= host.next_beat:
                host.beat(self.agent.name, self.run_id, None, self.started_at)
            if now < retry_at:
                continue
            if self._open_log():
                self.say("run log made: starting it", INFO)
                self._open_voice(env.wall())
                return None
            if not is_outage(self._log_error.errno):
                return None
            delay = outage_retry_after(delay)
            retry_at = env.monotonic() + delay

    def _wire_voice(self) -> None:
        """Wire the notify socket (SPEC "Agents that talk back"): a socket that
        could not be made costs the agent its voice, never its run - so its
        watchdog, which it could not ping, is off for the run."""
        if self._notify_error is not None:
            off = f"; its {self.watchdog:g}s watchdog is off for this run" if self.watchdog else ""
            self.say(f"gets no notify socket: {self.env.errno_reason(self._notify_error)}{off}", WARNING)
            self._notify_error = None
        if self.notify is not None:
            self._run_env["NOTIFY_SOCKET"] = self.notify.env
            self.notes = Notes(self.run_id)
            self.env.watch(self.notify.fileno())
        else:
            self.watchdog = None
        if self.watchdog and self._run_env is not None:
            # (WATCHDOG_PID is set in the child: the agent's pid is known only there)
            self._run_env["WATCHDOG_USEC"] = watchdog_usec(self.watchdog)

    def run(self) -> "Union[Pending, HopResult]":
        """Run the agent to its end. Returns that end for the driver to commit
        (a HopResult when nothing may be recorded: leadership lost)."""
        try:
            end = self._run()
        finally:
            self._started()
        if self._hook_error is not None:   # only now: the agent was supervised to its end first
            raise self._hook_error
        return end

    def _started(self) -> None:
        hook, self.after_start = self.after_start, None
        if hook is not None:
            try:
                hook()
            except Exception as e:   # noqa: BLE001 - re-raised by run() once the run is over
                self._hook_error = e

    def _run(self) -> "Union[Pending, HopResult]":
        env, host, name = self.env, self.host, self.agent.name
        self.prepare()
        if self._log_error is not None and is_outage(self._log_error.errno):
            self._started()
            ended = self._wait_for_room()
            if ended is not None or self.lost:
                env.remove_cgroup(self.cgroup)
                self.cgroup = None
                if self.lost:
                    return HopResult(self.run_id, name, "running", env.wall() - self.started_at, None)
                return self._close(ended)
        self._wire_voice()
        cg, self.cgroup = self.cgroup, None
        if self._log_error is not None:
            from ringd.host.env import log_open_reason
            env.remove_cgroup(cg)
            self._started()
            return self._close_error(f"cannot open run log logs/{name}/{self.run_id}.log: "
                                     f"{log_open_reason(self._log_error)}")
        log_fd, run_env, self._log_fd = self._log_fd, self._run_env, None
        try:
            try:
                child = env.spawn(resolve_program(self.agent.argv, host.roster_dir),
                                  cwd=resolve_cwd(host.config.cwd_for(name), host.roster_dir), env=run_env,
                                  stdout_fd=log_fd, umask=host.agent_umask,
                                  pid_var="WATCHDOG_PID" if self.watchdog else None, run_cgroup=cg)
            except OSError as e:
                env.write_fd(log_fd, f"ringd: cannot start {self.agent.argv[0]!r}: {env.errno_reason(e)}\n")
                self._started()
                return self._close_error(f"cannot start: {env.errno_reason(e)}")
            finally:
                env.close_fd(log_fd)
            self._started()
            self.pid = child.pid
            self.child = child
            if self.notify is not None:
                self.notify.set_agent(child.pid)
            self.say(f"started (pid {child.pid}, budget {self.limits.run_budget:g}s"
                     f"{f', watchdog {self.watchdog:g}s' if self.watchdog else ''})", INFO)
            leader = host.leader
            if leader is not None:
                # killed at the switch even while we block in a database call
                leader.guard(child.pid, env.start_time(child), host.state_key, self.run_id,
                             getattr(child, "cgroup", None))
            try:
                close = self._supervise(child)
            finally:
                if leader is not None:
                    leader.guard(None, None)
            if close is None or (leader is not None and leader.killed_pid == child.pid
                                 and close.signal == signal.SIGKILL):
                # leadership lost and the agent killed for it: record nothing, the row
                # is the next leader's to close (an end of the agent's own is kept)
                return HopResult(self.run_id, name, "running", env.wall() - self.started_at, None)
            if self.notify is not None:   # last words: a STATUS= sent just before the exit
                self._note(self.notify.drain())
            self._close_notify()          # gone before the row says the run has ended
            return self._close(close)
        finally:
            self._close_notify()

    # --- the agent's voice (SPEC "Agents that talk back") ----------------------------------
    def _hear(self, now: float) -> list:
        """Drain what the agent said (capped per wake) into run-state events."""
        heard = self._note(self.notify.drain())
        events = []
        if heard.phase is not None:
            events.append(Phase(heard.phase))
        if heard.pings:
            events.append(Ping())
        if heard.triggered:
            events.append(Trigger())
        return events

    def _note(self, heard):
        wall = self.env.wall()
        self.notes.hear(heard, wall)
        self.host.notify_dropped += heard.dropped
        if heard.reports:
            self._take_reports(heard.reports, wall)
        return heard

    def _take_reports(self, reports, wall_now: float) -> None:
        """Quota reports (SPEC "Agents on a shared quota"): one that does not
        parse, names no pool of the config or a number no provider means is
        said once a run and ignored."""
        pools = self.host.config.quotas
        for key, value in reports:
            try:
                report = quota.parse_report(key, value, wall_now, pools)
            except quota.BadReport as e:
                if e.kind not in self._reports_said:
                    self._reports_said.add(e.kind)
                    self.say(f"sent a quota report that is ignored: {e}", WARNING)
                continue
            if isinstance(report, quota.Refused) and f"refused:{report.pool}" not in self._reports_said:
                self._reports_said.add(f"refused:{report.pool}")
                self.say(f"reports quota {report.pool} exhausted for {max(0.0, report.until - wall_now):.0f}s", INFO)
            self.use.take(report, wall_now)

    def _record_use(self, now: float) -> None:
        """Record what the run reported of its quotas so far, so a driver that
        dies (or a leader whose host does) leaves it in the journal. Never waits
        out the journal's write lock: tried again USE_RECORD_INTERVAL later."""
        self._use_at = now
        try:
            with self.host.journal.transaction(patient=False) as tx:
                transitions.record_use(tx, self.run_id, self.agent.name, self.use)
        except JournalError as e:
            if self._use_failing is None:
                self.say(f"cannot record its quota use yet ({e}); it is recorded with its end", WARNING)
            self._use_failing = str(e)
            if not e.transient:
                self.use.dirty = False   # (its end records it, or says why not)
            return
        self.use.dirty = False
        self.host.quota_read = None
        if self._use_failing is not None:
            self._use_failing = None
            self.say("quota use recorded", INFO)

    def _publish_notes(self, now: float, force: bool = False) -> None:
        due = self.notes.due_at() if self.notes is not None else None
        if due is not None and (force or now >= due):
            try:
                self.env.write_notes(self.notes, now)
            except OSError as e:   # a full state dir: status shows an older phase, the run goes on
                self.notes.dirty = False
                if not self._notes_failing:   # said once, as for the heartbeat: never once a second
                    self.say(f"cannot publish its phase: {self.env.errno_reason(e)}", ERR)
                self._notes_failing = True
            else:
                self._notes_failing = False

    def _close_notify(self) -> None:
        if self.notify is not None:
            self.env.unwatch(self.notify.fileno())
            self.env.close_notify(self.notify)
            self.notify = None

    def _supervise(self, child) -> Optional[Close]:
        """Sleep on events until the state machine closes the run; carry out its actions."""
        env, host = self.env, self.host
        t0 = env.monotonic()
        rs = runstate.start(t0, budget=self.limits.run_budget, stall=self.limits.stall_threshold,
                            beat_at=host.next_beat, beat_every=host.config.ring.heartbeat_interval,
                            tempfail_exit_code=host.config.ring.tempfail_exit_code, watchdog=self.watchdog)
        record_at: Optional[float] = t0 + PID_RECORD_DELAY
        stop_sent = exit_heard = False
        close: Optional[Close] = None
        leader = host.leader
        notify_fd = self.notify.fileno() if self.notify is not None else None
        while close is None:
            if leader is not None and self._lost_lead(child):
                return None
            deadline = runstate.next_deadline(rs)
            if record_at is not None:
                deadline = min(deadline, record_at)
            if leader is not None:
                deadline = min(deadline, env.monotonic() + leader.seconds_left())
            notes_due = self.notes.due_at() if self.notes is not None else None
            if notes_due is not None:
                deadline = min(deadline, notes_due)
            if self.use.dirty:
                deadline = min(deadline, self._use_at + USE_RECORD_INTERVAL)
            # (once it has exited, its pidfd stays readable: a wait on it would spin)
            sigs, ready = env.wait(deadline - env.monotonic(), [] if child.exited else [child.pidfd])
            if leader is not None and self._lost_lead(child):
                return None
            now = env.monotonic()
            events = []
            if notify_fd is not None and notify_fd in ready:
                events += self._hear(now)
            # (child.exited: a look elsewhere, e.g. _lost_lead, saw the exit first; it is still delivered once)
            if not exit_heard and (child.exited or child.pidfd is None or child.pidfd in ready):
                ended = env.exit_status(child)
                if ended is not None:
                    exit_heard = True
                    events.append(Exited(*ended))   # an exit seen with anything else is the agent's own ending
            if sigs:
                req = host.absorb(sigs, keep=(child.pid,), agent_exited=child.exited)
                if req.wake and self._skip_requested():
                    events.append(Skip())
            if host.stop_requested and not stop_sent:
                stop_sent = True
                events.append(Stop(host.stop_reason))
            events.append(Tick())
            for ev in events:
                rs, actions = runstate.step(rs, ev, now)
                for a in actions:
                    if isinstance(a, Close):
                        close = a
                    else:
                        self._do(a, child)
            if close is None and record_at is not None and now >= record_at:
                record_at = self._record_pid(child, now)
            if close is None and self.use.dirty and now >= self._use_at + USE_RECORD_INTERVAL:
                self._record_use(now)
            if close is None:
                self._publish_notes(now)
        env.reap(child)
        return close

    def _lost_lead(self, child) -> bool:
        """A many-host driver past its half-TTL switch kills its agent at once - right
        after waking, before any beat asks a database that may not answer - and
        records nothing (the next leader reaps the row as interrupted)."""
        if not self.host.leader.must_stop():
            return False
        if self.env.exit_status(child) is not None:
            return False   # it has ended on its own: an end this driver knows, kept (Driver.flush)
        self.say("lost its leadership; SIGKILL to its whole process tree, recording nothing more", WARNING)
        self.env.kill_tree(child, self.host.state_key, self.run_id)
        self.env.reap(child)
        return True

    def _do(self, a, child) -> None:
        env, host = self.env, self.host
        if isinstance(a, Beat):
            host.beat(self.agent.name, self.run_id, child.pid, self.started_at)
        elif isinstance(a, Term):
            env.term(child)
        elif isinstance(a, KillTree):
            killed = env.kill_tree(child, host.state_key, self.run_id)
            if killed:
                self.say(f"left {killed} process(es) behind; killed them", WARNING)
        elif isinstance(a, Log):
            self.say(a.text, a.level)
        elif isinstance(a, SetPhase):
            pass   # published by _publish_notes (at most once a second), kept on the row at the close

    def _skip_requested(self) -> bool:
        try:
            return transitions.skip_requested_for(self.host.journal, self.run_id)
        except JournalError as e:
            # the agent is supervised to its end whatever the journal does
            self.say(f"cannot read operator requests ({e}); the run goes on", ERR)
            return False

    def _record_pid(self, child, now: float) -> Optional[float]:
        """Record the agent's pid on its row, for status and a later reaper.
        Never waits out the journal's write lock: another process (an operator's
        command, a ``sqlite3`` shell, the agent itself) may hold it for seconds,
        and the agent's budget and stall threshold come first. A write that
        cannot be made now is tried again PID_RECORD_RETRY later: returns when
        (None: done, or never)."""
        self.pid_start = self.env.start_time(child)
        try:
            with self.host.journal.transaction(patient=False) as tx:
                tx.set_process(self.run_id, child.pid, self.pid_start, self.log_path)
        except JournalError as e:
            # the row exists (written before the start); only its pid is missing:
            # supervise the agent anyway, never leave it running unwatched
            if not e.transient:
                self.say(f"cannot record its pid: {e}", ERR)
                return None
            if not self._pid_deferred:
                self.say(f"cannot record its pid yet ({e}); trying again every {PID_RECORD_RETRY:g}s", WARNING)
                self._pid_deferred = True
            return now + PID_RECORD_RETRY
        if self._pid_deferred:
            self.say("pid recorded", INFO)
        return None

    # --- closing -------------------------------------------------------------------------
    def _close_error(self, reason: str) -> "Pending":
        self.say(f"could not start: {reason}", ERR)
        return self._close(Close("error", "driver", None, None, reason))

    def _close(self, c: Close) -> "Pending":
        return Pending(self, c, self.env.wall())


@dataclass
class Pending:
    """A run that has ended, its end not yet committed: the driver writes it in
    the transaction that starts the next run (one commit per ordinary hop, the
    end still committed before the next run starts), or alone before it waits
    for anything (:meth:`ringd.loops.driver.Driver.flush`)."""
    hop: Hop
    close: Close
    now: float
    tried: Optional[transitions.Closed] = None   # what a write whose commit failed recorded, if it did

    def write(self, tx) -> Optional[transitions.Closed]:
        h, c = self.hop, self.close
        if h.use.used or h.use.exhausted:
            h.host.quota_read = None   # the turn this is written in reads the pools anew
        closed = transitions.close_in(
            tx, h.run_id, h.agent.name, h.position, c.status, source=c.source, now=self.now,
            ring=h.host.config.ring, line=h.agent.text, exit_code=c.exit_code, signal=c.signal,
            reason=c.reason, log_path=h.log_path, pid=h.pid, pid_start=h.pid_start,
            cpu_seconds=getattr(h.child, "cpu_seconds", None),
            phase=h.notes.phase if h.notes is not None else None,
            use=h.use if (h.use.used or h.use.exhausted) else None, pool=h.pool)
        if closed is None and self.tried is not None:
            # Retried, and the row is closed already. A commit whose answer was lost
            # (PostgreSQL's connection cut) may have recorded this very end: then it
            # is ours - said and alerted as such - not an operator's or the reaper's.
            row = tx.run(h.run_id)
            if row is not None and row.status == c.status and row.ended_at == self.now:
                return self.tried
        self.tried = closed
        return closed

    def done(self, closed: Optional[transitions.Closed]) -> HopResult:
        """After the commit: say how it ended, keep the agent's log dir small."""
        h, c, env = self.hop, self.close, self.hop.env
        duration = max(0.0, self.now - h.started_at)
        detail = f"exit {c.exit_code}" if c.exit_code is not None else (f"signal {c.signal}" if c.signal else "")
        if closed is not None:
            h.say(f"{c.status}{f' ({detail})' if detail else ''} after {duration:.2f}s", levels.of_end(c.status))
            if closed.settled.entered_quarantine:
                env.log(f"{h.agent.name}: quarantined ({closed.settled.state.bad_streak} bad endings in a row)", WARNING)
        else:
            h.say("ended, but its row was already closed (by an operator or the reaper)", WARNING)
        if h.log_path is not None:
            env.keep_logs(h.agent.name, h.run_id, h.host.config.ring.keep_logs)
        return HopResult(h.run_id, h.agent.name, c.status, duration, closed)
