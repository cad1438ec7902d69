"""One hop: run one agent to its end and close its journal row.

Start (row ``running`` first, then the process), then sleep until something
happens: the agent exits, the budget (SIGTERM to the group), the stall
threshold (SIGKILL to the whole tree), an operator skip, a driver stop, or a
heartbeat is due. However the run ends, nothing it started survives it.
"""
from __future__ import annotations

import errno
import os
import signal
import socket
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from . import proctree, safefile
from .config import Config
from .heartbeat import Heartbeat, Notifier
from .journal import Journal
from .policy import after_run, classify
from .roster import Agent, resolve_program
from .wakeup import Wakeups

HOST = socket.gethostname()
SKIP_GRACE = 0.5   # s between SIGTERM and SIGKILL when an operator skips (ring moves on within 1 s)
STOP_GRACE = 3.0   # s between SIGTERM and SIGKILL when the driver itself stops


@dataclass
class Context:
    """What a hop needs from the driver (kept small so a hop is easy to follow)."""
    state_dir: Path
    config: Config
    journal: Journal
    heartbeat: Heartbeat
    notifier: Notifier
    wakeups: Wakeups
    roster_dir: Path
    log: Callable[[str], None]
    agent_umask: int = 0o022
    lap: int = 1
    stop_requested: bool = False
    reload_requested: bool = False
    roster_error: Optional[str] = None
    on_run_end: Optional[Callable[["HopResult"], None]] = None
    on_beat: Optional[Callable[[Optional[str], Optional[float]], None]] = None
    beat_error: Optional[str] = None   # why the last heartbeat could not be written
    last_beat: float = float("-inf")   # monotonic time of the last heartbeat
    leader: Optional[Any] = None       # leader.Leader of a many-host ring (None: SQLite, always leading)

    @property
    def state_key(self) -> str:
        return str(self.state_dir)

    def absorb(self, sigs, keep_unreaped: Iterable[int] = ()) -> bool:
        """Turn the signals a wait returned into the driver's flags (and reap
        exited children but ``keep_unreaped``). True if one asks the caller to
        stop waiting (stop, reload, operator request)."""
        if signal.SIGCHLD in sigs:
            proctree.reap_zombie_children(keep_unreaped)  # orphans re-parented to us, alerts
        if signal.SIGHUP in sigs:
            self.reload_requested = True
        if signal.SIGTERM in sigs or signal.SIGINT in sigs:
            self.stop_requested = True
        return bool(sigs & {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1})

    def beat(self, agent: Optional[str] = None, run_id: Optional[int] = None,
             run_pid: Optional[int] = None, run_started_at: Optional[float] = None) -> None:
        # A heartbeat that cannot be written (state dir full or read-only) must
        # never abandon a running agent nor kill the driver: say so once, go on.
        self.last_beat = time.monotonic()
        if self.leader is not None:
            self.leader.beat()  # renew (or take) the lease with every heartbeat
        try:
            self.heartbeat.beat(lap=self.lap, agent=agent, run_id=run_id, run_pid=run_pid,
                                run_started_at=run_started_at,
                                extra={"roster_error": self.roster_error, **role_fields(self.leader)})
        except OSError as e:
            if self.beat_error is None:
                self.log(f"cannot write the heartbeat ({proctree.errno_reason(e)}); "
                         f"the ring goes on, a watcher will see it as stale")
            self.beat_error = str(e)
        else:
            if self.beat_error is not None:
                self.log("heartbeat written again")
            self.beat_error = None
        if self.on_beat is not None:
            self.on_beat(agent, run_started_at)


def role_fields(leader) -> dict:
    """What the heartbeat says of leadership (a SQLite ring's one driver always leads)."""
    if leader is None:
        return {"host": HOST, "role": "leader", "lease": None}
    return {"host": leader.host, "role": leader.role,
            "lease": {"holder": leader.lease_holder, "expires_at": leader.lease_expires_at}}


@dataclass
class HopResult:
    run_id: int
    agent: str
    status: str
    exit_code: Optional[int] = None
    signal: Optional[int] = None
    reason: Optional[str] = None
    duration: float = 0.0
    closed: bool = True  # False: someone else (operator, reaper) closed the row first
    agent_state: dict = field(default_factory=dict)  # the agent's state after the close


@dataclass
class _Ending:
    """How the run is being ended, once we started ending it."""
    kind: Optional[str] = None          # None | "stall" | "skip" | "stop"
    kill_at: Optional[float] = None     # monotonic time of the SIGKILL
    termed_at_budget: bool = False
    reason: Optional[str] = None


def open_log(state_dir: Path, agent: str, run_id: int) -> "tuple[int, str]":
    """Open ``logs/<agent>/<run_id>.log`` (0600) without following any symlink a
    local user planted in the state dir."""
    fd = safefile.open_file(state_dir, ("logs", agent), f"{run_id}.log",
                            os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    return fd, str(state_dir / "logs" / agent / f"{run_id}.log")


def _log_open_reason(e: OSError) -> str:
    """Say plainly when the log path was tampered with (never followed)."""
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return "a symbolic link (or a non-directory) is in the way; refusing to follow it"
    if e.errno == errno.EEXIST:
        return "a file or symbolic link is already there; refusing to write through it"
    return proctree.errno_reason(e)


def prune_logs(state_dir: Path, agent: str, keep: int) -> None:
    """Keep the newest ``keep`` run logs of an agent (by run id)."""
    folder = state_dir / "logs" / agent
    ids = safefile.run_log_ids(folder)
    for old in ids[:-keep] if keep > 0 else ids:
        try:
            os.unlink(folder / f"{old}.log")
        except OSError:
            pass


class Hop:
    def __init__(self, ctx: Context, agent: Agent, position: int):
        self.ctx = ctx
        self.agent = agent
        self.position = position
        self.limits = ctx.config.limits_for(agent.name)

    # --- the run ---------------------------------------------------------------
    def run(self) -> HopResult:
        ctx, name = self.ctx, self.agent.name
        started = time.time()
        run_id = ctx.journal.start_run(name, self.position, run_budget=self.limits.run_budget,
                                       stall_threshold=self.limits.stall_threshold,
                                       driver_pid=ctx.heartbeat.pid, driver_start=ctx.heartbeat.pid_start,
                                       now=started)
        if ctx.journal.agent_state(name).get("skip_requested"):
            # `ringd skip NAME` landed after this turn was decided but before the
            # row existed (the CLI saw nothing running and promised to skip the
            # next turn): honour it now, never start (found by the soak)
            ctx.log(f"run {run_id}: {name} skipped by operator before it started")
            return self._close(run_id, "skipped", "operator", None, None, "operator requested skip")
        try:
            log_fd, log_path = open_log(ctx.state_dir, name, run_id)
        except OSError as e:
            return self._close_error(run_id, f"cannot open run log logs/{name}/{run_id}.log: "
                                             f"{_log_open_reason(e)}")
        try:
            child = self._spawn(run_id, started, log_fd, log_path)
        except OSError as e:
            os.write(log_fd, f"ringd: cannot start {self.agent.argv[0]!r}: {proctree.errno_reason(e)}\n".encode())
            ctx.journal.set_log_path(run_id, log_path)
            return self._close_error(run_id, f"cannot start: {proctree.errno_reason(e)}")
        finally:
            os.close(log_fd)
        ctx.log(f"run {run_id}: {name} started (pid {child.pid}, budget {self.limits.run_budget:g}s)")
        if ctx.leader is not None:
            ctx.leader.guard(child.pid, child.start_time, ctx.state_key, run_id)  # killed at the switch even if we block
        try:
            ctx.journal.set_process(run_id, child.pid, child.start_time, log_path)
        except (sqlite3.OperationalError, OSError) as e:
            # the row exists (written before the start); only its pid is missing:
            # supervise the agent anyway, never leave it running unwatched
            ctx.log(f"run {run_id}: cannot record the pid of {name}: {e}")
        try:
            status_word, ending = self._wait(run_id, child, started)
        finally:
            if ctx.leader is not None:
                ctx.leader.guard(None, None)
            child.close()
        if ending.kind == "lease" or (ctx.leader is not None and ctx.leader.killed_pid == child.pid):
            # Killed because leadership is gone: record nothing (the next leader
            # reaps the row as interrupted).
            return HopResult(run_id=run_id, agent=name, status="running", reason=ending.reason, closed=False)
        exit_code, sig = proctree.decode_status(status_word)
        status = classify(exit_code, sig, ended_by=ending.kind, termed_at_budget=ending.termed_at_budget,
                          tempfail_exit_code=ctx.config.ring.tempfail_exit_code)
        source = "operator" if ending.kind == "skip" else "driver"
        return self._close(run_id, status, source, exit_code, sig, ending.reason)

    def _spawn(self, run_id: int, started: float, log_fd: int, log_path: str) -> proctree.Child:
        ctx = self.ctx
        env = proctree.clean_env(os.environ, {
            "RING_AGENT": self.agent.name,
            "RING_RUN_ID": str(run_id),
            "RING_RUN_BUDGET": f"{self.limits.run_budget:g}",
            "RING_DEADLINE": f"{started + self.limits.run_budget:.3f}",
            "RING_STATE": ctx.state_key,
        })
        cwd = ctx.config.cwd_for(self.agent.name) or str(ctx.roster_dir)
        argv = resolve_program(self.agent.argv, ctx.roster_dir)
        return proctree.spawn(argv, cwd=cwd, env=env, stdout_fd=log_fd, umask=ctx.agent_umask)

    def _wait(self, run_id: int, child: proctree.Child, started: float) -> "tuple[int, _Ending]":
        """Sleep on events until the agent's leader has exited; then end the rest of
        its tree and reap the leader. Returns (wait status, how it ended)."""
        ctx = self.ctx
        t0 = time.monotonic()
        term_at = t0 + self.limits.run_budget
        stall_at = t0 + self.limits.stall_threshold
        ending = _Ending()
        hb_interval = ctx.config.ring.heartbeat_interval
        next_beat = ctx.last_beat + hb_interval  # keeps its rhythm across hops (status reads the journal)
        while proctree.peek_exit(child.pid) is None:
            if ctx.leader is not None and ctx.leader.must_stop():
                # checked before any beat: a driver waking from a freeze kills
                # its agent at once, before asking a database that may not answer
                ending.kind, ending.reason = "lease", "leadership lost"
                ctx.log(f"run {run_id}: {self.agent.name}: leadership lost; SIGKILL to its whole process "
                        f"tree, recording nothing more")
                break
            now = time.monotonic()
            if now >= next_beat:
                ctx.beat(self.agent.name, run_id, child.pid, started)
                next_beat = now + hb_interval
            if ending.kill_at is not None and now >= ending.kill_at:
                break  # grace over (stall, skip or stop): kill the tree below
            if now >= stall_at and ending.kind is None:
                ending.kind, ending.reason = "stall", f"no exit {self.limits.stall_threshold:g}s after start"
                ending.kill_at = now
                ctx.log(f"run {run_id}: {self.agent.name} stalled; SIGKILL to its whole process tree")
                break
            if now >= term_at and not ending.termed_at_budget and ending.kind is None:
                ending.termed_at_budget = True
                ending.reason = f"run budget of {self.limits.run_budget:g}s reached"
                ctx.log(f"run {run_id}: {self.agent.name} reached its budget; SIGTERM to its process group")
                proctree.signal_group(child.pid, signal.SIGTERM)
            deadlines = [next_beat, stall_at]
            if not ending.termed_at_budget:
                deadlines.append(term_at)
            if ending.kill_at is not None:
                deadlines.append(ending.kill_at)
            if ctx.leader is not None:
                deadlines.append(time.monotonic() + ctx.leader.seconds_left())
            sigs, _ = ctx.wakeups.wait(min(deadlines) - time.monotonic(), fds=[child.pidfd])
            self._on_signals(sigs, run_id, child, ending)
        # Whatever happened, nothing of this run may survive it. The leader is
        # kept as an unreaped zombie meanwhile so its group id cannot be reused.
        proctree.signal_process(child.pid, child.start_time, signal.SIGKILL)
        # Let the leader finish dying first: until it is a zombie its escaped
        # children are still being re-parented to us, and a walk of our process
        # tree at that moment misses them (they leave the leader's list after we
        # read ours) - found by the soak: a setsid grandchild survived its run.
        proctree.wait_exit(child.pidfd, timeout=2.0)
        killed = proctree.kill_run(ctx.state_key, run_id, child.pid, keep_unreaped=[child.pid])
        if killed:
            ctx.log(f"run {run_id}: killed {killed} leftover process(es) of {self.agent.name}")
        _, status_word = os.waitpid(child.pid, 0)
        child.popen.returncode = os.waitstatus_to_exitcode(status_word)  # we reaped it, not Popen
        proctree.reap_zombie_children()
        return status_word, ending

    def _on_signals(self, sigs, run_id: int, child: proctree.Child, ending: _Ending) -> None:
        ctx = self.ctx
        ctx.absorb(sigs, keep_unreaped=[child.pid])
        if ctx.stop_requested and ending.kind != "stop":
            self._begin_end(child, ending, "stop", STOP_GRACE, "driver stopping")
            ctx.log(f"run {run_id}: stopping {self.agent.name}: the driver is shutting down")
        if signal.SIGUSR1 in sigs and ending.kind is None:
            if ctx.journal.agent_state(self.agent.name).get("skip_requested"):
                self._begin_end(child, ending, "skip", SKIP_GRACE, "skipped by operator")
                ctx.log(f"run {run_id}: {self.agent.name} skipped by operator")

    @staticmethod
    def _begin_end(child: proctree.Child, ending: _Ending, kind: str, grace: float, reason: str) -> None:
        ending.kind, ending.reason = kind, reason
        ending.kill_at = time.monotonic() + grace
        proctree.signal_group(child.pid, signal.SIGTERM)
        proctree.signal_group(child.pid, signal.SIGCONT)

    # --- closing ------------------------------------------------------------------
    def _close_error(self, run_id: int, reason: str) -> HopResult:
        self.ctx.log(f"run {run_id}: {self.agent.name} could not start: {reason}")
        return self._close(run_id, "error", "driver", None, None, reason)

    def _until_recorded(self, run_id: int, write: Callable[[], object]) -> object:
        """Run a journal write that must not be lost (closing a run that has ended):
        while the state dir is full or read-only, say why once, keep beating and
        retry; give up only when the driver is told to stop (the row then stays
        ``running`` and the next driver's reaper closes it as ``interrupted``)."""
        ctx = self.ctx
        delay, failing = 0.2, False
        while True:
            try:
                result = write()
            except (sqlite3.OperationalError, OSError) as e:
                if ctx.stop_requested or (ctx.leader is not None and ctx.leader.must_stop()):
                    raise
                if not failing:
                    ctx.log(f"run {run_id}: cannot record the end of {self.agent.name} ({e}); "
                            f"retrying until the state dir is writable")
                failing = True
                sigs, _ = ctx.wakeups.wait(delay)
                ctx.absorb(sigs)
                ctx.beat()
                delay = min(delay * 2, 5.0)
                continue
            if failing:
                ctx.log(f"run {run_id}: end of {self.agent.name} recorded")
            return result

    def _close(self, run_id: int, status: str, source: str, exit_code: Optional[int],
               sig: Optional[int], reason: Optional[str]) -> HopResult:
        ctx = self.ctx
        now = time.time()

        after = self._until_recorded(run_id, lambda: ctx.journal.close_run(
            run_id, status, source=source, exit_code=exit_code, signal=sig, reason=reason, now=now,
            settle=lambda state: after_run(state, status, now, ctx.config.ring, self.agent.text)))
        row = ctx.journal.run(run_id)
        result = HopResult(run_id=run_id, agent=self.agent.name, status=row.status if row else status,
                           exit_code=exit_code, signal=sig, reason=reason,
                           duration=(row.duration or 0.0) if row else 0.0, closed=after is not None,
                           agent_state=after or {})
        detail = f"exit {exit_code}" if exit_code is not None else (f"signal {sig}" if sig else "")
        if after is not None:
            ctx.log(f"run {run_id}: {self.agent.name} {status}"
                    f"{f' ({detail})' if detail else ''} after {result.duration:.2f}s")
            if after.get("entered_quarantine"):
                ctx.log(f"{self.agent.name}: quarantined ({after.get('bad_streak')} bad endings in a row)")
        else:
            ctx.log(f"run {run_id}: {self.agent.name} ended, but its row was already closed "
                    f"as {result.status} (by an operator or the reaper)")
        prune_logs(ctx.state_dir, self.agent.name, ctx.config.ring.keep_logs)
        if ctx.on_run_end is not None:
            ctx.on_run_end(result)
        return result
