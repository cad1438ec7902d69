"""Operator requests to the ring: skip, force-fail, resume.

A request is written to the journal first (so it survives and waits for the
next driver when none runs), then the live driver is woken with SIGUSR1 - never
by pid alone: the heartbeat's pid *and* process start time must match. The
driver acts on the request at once (no polling tick on either side).
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

from ringd.journal import transitions
from ringd.inputs.config import Config
from ringd.core.errors import EX_BAD_USAGE, EX_FAILURE
from ringd.host.heartbeat import live_writer, read_heartbeat
from ringd.host.notify import read_notes, without_controls
from ringd.journal.sqlite import Journal, JournalError, RunRow, journal_path
from ringd.cli.reap import alert_closed, reap_if_orphaned
from ringd.cli.status import OperatorError, known_names, open_reader, require_state_dir, unknown_agent
from ringd.inputs.roster import roster_view

MAX_REASON_CHARS = 500


def clean_reason(reason: Optional[str]) -> Optional[str]:
    """An operator's ``--reason`` as the journal keeps it: one line, its control
    characters spaces, at most MAX_REASON_CHARS; None for none."""
    if not reason:
        return None
    clean = " ".join(without_controls(reason).split())
    if len(clean) > MAX_REASON_CHARS:
        clean = clean[:MAX_REASON_CHARS - 3] + "..."
    return clean or None


def wake_driver(state_dir: Path) -> Optional[int]:
    """SIGUSR1 to the live driver of ``state_dir``. Returns its pid, or None when no
    driver runs (the request then waits in the journal for the next one).
    With the ring owner's privileges (reaper.as_ring_owner): the heartbeat is
    the ring user's to write, and SIGUSR1 ends a process that does not handle
    it - root waking another user's ring must signal nothing that user could not."""
    from ringd.host import proctree
    from ringd.loops.reaper import as_ring_owner
    writer = live_writer(read_heartbeat(state_dir))
    if writer is None:
        return None
    pid, start = writer
    return pid if as_ring_owner(state_dir, lambda: proctree.signal_process(pid, start, signal.SIGUSR1)) else None


def _writer(state_dir: Path, config: Config, create: bool = False) -> Journal:
    try:
        if config.ring.journal:  # a many-host ring: its PostgreSQL journal
            from ringd.journal.pg import PgJournal
            return PgJournal.connect(config.ring.journal, ttl=config.ring.lease_ttl)
        # a journal whose log was removed under the driver waits for it: woken, it takes it up at once
        return Journal.open(state_dir, create=create, nudge=lambda: wake_driver(state_dir))
    except JournalError as e:
        raise OperatorError(str(e)) from None


def record_event(state_dir: Path, config: Config, kind: str, detail: str, *,
                 actor: Optional[dict] = None, reason: Optional[str] = None) -> None:
    """An operator's event about the whole ring (``reload``), with who asked and why."""
    writer = _writer(state_dir, config, create=True)
    try:
        writer.note_event(kind, detail, actor=actor, reason=reason)
    except JournalError as e:
        raise OperatorError(f"{writer.path}: cannot write journal: {e}") from None
    finally:
        writer.close()


# --- skip -------------------------------------------------------------------------

@dataclass
class SkipResult:
    agent: str
    current: bool                      # the agent was running when asked
    run_id: Optional[int] = None       # its run, if current
    driver_pid: Optional[int] = None   # the driver woken, if any
    final_status: Optional[str] = None  # the run's status once it left 'running' (if waited)
    waited: float = 0.0                # seconds until it did
    ran_for: Optional[float] = None    # how long the run had been going when it ended (its duration)
    elapsed: Optional[float] = None    # ... or, not seen ending, when the skip was asked


def skip(state_dir: Path, config: Config, name: Optional[str], *, wait: float = 5.0,
         clock: Callable[[], float] = time.monotonic, actor: Optional[dict] = None,
         reason: Optional[str] = None) -> SkipResult:
    """Skip ``name`` (None: the current run). The current run ends now (SIGTERM,
    short grace, SIGKILL; status ``skipped``); another agent's next turn is skipped.
    When the current run was targeted and a driver was woken, wait (bounded) for
    the row to leave ``running`` and report how long the run had been going.
    ``actor`` and ``reason`` are recorded with the request."""
    require_state_dir(state_dir)
    reader = None
    try:
        reader = open_reader(state_dir, config)
    except JournalError as e:
        raise OperatorError(str(e)) from None
    try:
        running: Optional[RunRow] = None
        if reader is not None:
            reap_if_orphaned(state_dir, config, reader)
            running = reader.running_row()
        by_run = name is None
        if name is None:
            if running is None:
                raise OperatorError("nothing is running; name an agent to skip its next turn "
                                    "(ringd skip NAME)", EX_FAILURE)
            name = running.agent
        else:
            known = known_names(config, state_dir, reader)
            if name not in known:
                raise unknown_agent(name, known)
    finally:
        if reader is not None:
            reader.close()

    seen_run = running.id if by_run and running is not None else None
    writer = _writer(state_dir, config, create=True)  # a first-ever request may create the journal
    try:
        # Keyed by the run the operator saw: a run that ended meanwhile is never
        # mistaken for the next one (the request and the driver's writes serialise).
        try:
            req = transitions.request_skip(writer, None if by_run else name, seen_run, time.time(),
                                           actor=actor, reason=clean_reason(reason))
        except transitions.RunEnded as e:
            raise OperatorError(str(e), EX_FAILURE) from None
        except JournalError as e:
            raise OperatorError(str(e)) from None
        current = req.run_id is not None
        result = SkipResult(agent=name, current=current, run_id=req.run_id)
        if current and running is not None and running.started_at is not None:
            result.elapsed = max(0.0, time.time() - running.started_at)
        t0 = clock()
        result.driver_pid = wake_driver(state_dir)
        if current and result.driver_pid is not None and wait > 0:
            deadline = t0 + wait
            while True:
                row = writer.run(result.run_id)
                if row is None or row.status != "running":
                    result.final_status = row.status if row else None
                    result.ran_for = row.duration if row else None
                    result.waited = clock() - t0
                    break
                if clock() >= deadline:
                    result.waited = clock() - t0
                    break
                time.sleep(0.01)
    finally:
        writer.close()
    if result.final_status not in (None, "skipped"):
        # A run ended by the skip is `skipped` whatever else happens (runstate);
        # another ending is the run's own, seen by the driver before the request
        # landed (it commits an end with the next start): nothing was skipped.
        raise OperatorError(f"run {result.run_id} had already ended (as {result.final_status}); "
                            f"nothing was skipped", EX_FAILURE)
    return result


# --- force-fail ------------------------------------------------------------------

@dataclass
class ForceFailResult:
    run_id: int
    agent: str
    closed: bool
    status: str          # the row's status afterwards
    killed: int = 0


def force_fail(state_dir: Path, config: Config, name: Optional[str] = None, run_id: Optional[int] = None,
               reason: Optional[str] = None, actor: Optional[dict] = None) -> ForceFailResult:
    """Close NAME's (or run ``run_id``'s) ``running`` row as ``interrupted``
    (source ``operator``) - a guarded update by that row's id, so a run that
    finished meanwhile, or the next agent's, is never touched - then kill what is
    left of its process tree anywhere on the host. Neither named while a run
    goes on: OperatorError(2) naming it (the run at that moment may be any
    agent's). NAME not running, or not run ``run_id`` -> OperatorError(1);
    unknown NAME -> OperatorError(2)."""
    require_state_dir(state_dir)
    if not config.ring.journal and not journal_path(state_dir).exists():
        if name is not None:
            _known_or_exit(state_dir, config, name)
        raise OperatorError("nothing is running (no journal yet)", EX_FAILURE)
    writer = _writer(state_dir, config)
    try:
        row = writer.running_row()
        if name is not None and (row is None or row.agent != name):
            _known_or_exit(state_dir, config, name, include_journal=True)
        _check_target(row, name, run_id)
        text = "forced by operator"
        why = clean_reason(reason)
        if why:
            text += f": {why}"
        _, roster, _ = roster_view(config, state_dir)
        line = dict(roster).get(row.agent) if roster else None
        closed = transitions.close_row(writer, row, "interrupted", source="operator", now=time.time(),
                                       ring=config.ring, line=line, reason=text,
                                       phase=read_notes(state_dir, row.id).get("phase"),
                                       actor=actor, operator_reason=why)
        after = writer.run(row.id)
        result = ForceFailResult(run_id=row.id, agent=row.agent, closed=closed is not None,
                                 status=after.status if after else "interrupted")
        if closed is None:
            raise OperatorError(f"run {row.id} of {row.agent} finished meanwhile as {result.status}; "
                                f"nothing was forced", EX_FAILURE)
        from ringd.loops.reaper import driver_alive, kill_orphan
        # A many-host ring's run may be on another box: its pids mean nothing
        # here. Kill only when its driver is a live process of this box.
        if not config.ring.journal or driver_alive(row, state_dir):
            result.killed = kill_orphan(state_dir, row)
        alert_closed(state_dir, config, closed)
        from ringd.loops.metrics import refresh_without_driver
        refresh_without_driver(state_dir, config, writer)   # (a live driver's is left to it)
    finally:
        writer.close()
    return result


def _check_target(row: Optional[RunRow], name: Optional[str], run_id: Optional[int]) -> None:
    """Is ``row`` (the running run, or None) the one the operator named? Else
    the one-line refusal: never the run that happens to be going on."""
    target = " and ".join(t for t in (name, None if run_id is None else f"run {run_id}") if t)
    if row is None:
        raise OperatorError(f"{target or 'nothing'} is not running; nothing was forced" if target
                            else "nothing is running", EX_FAILURE)
    if name is None and run_id is None:
        raise OperatorError(f"run {row.id} of {row.agent} is running; say which run to close: "
                            f"ringd force-fail {row.agent} (or --run {row.id})", EX_BAD_USAGE)
    if (name is not None and row.agent != name) or (run_id is not None and row.id != run_id):
        raise OperatorError(f"{target} is not running (the running run is {row.id} of {row.agent}); "
                            f"nothing was forced", EX_FAILURE)


# --- pause, resume, next ------------------------------------------------------------------

def _known_or_exit(state_dir: Path, config: Config, name: str, include_journal: bool = False) -> None:
    """``name`` must be on the roster (or, with a broken roster or
    ``include_journal``, known to the journal): else exit 2."""
    _, roster, _ = roster_view(config, state_dir)
    if roster is not None and include_journal and name not in dict(roster):
        roster = None   # (a run of an agent since removed may still be going on)
    if roster is None:
        # A broken roster: the names the journal knows stand in for it.
        try:
            reader = open_reader(state_dir, config)
        except JournalError as e:
            raise OperatorError(str(e)) from None
        try:
            known = known_names(config, state_dir, reader) if reader else []
        finally:
            if reader is not None:
                reader.close()
    else:
        known = [n for n, _ in roster]
    if name not in known:
        raise unknown_agent(name, known)


@dataclass
class ControlResult:
    agent: Optional[str]          # None: the whole ring
    changed: bool                 # False: it already was so
    driver_pid: Optional[int] = None
    lifted: List[str] = field(default_factory=list)   # resume NAME: what it lifted
    replaced: Optional[str] = None                    # next: the request it replaced


def pause(state_dir: Path, config: Config, name: Optional[str], *, actor: Optional[dict] = None,
          reason: Optional[str] = None) -> ControlResult:
    """Pause the ring (after the current run, start nothing) or pass NAME over.
    Stored in the journal: survives driver and watcher restarts."""
    require_state_dir(state_dir)
    if name is not None:
        _known_or_exit(state_dir, config, name)
    writer = _writer(state_dir, config, create=True)
    try:
        changed = writer.set_paused(name, True, actor=actor, reason=clean_reason(reason))
    except JournalError as e:
        raise OperatorError(f"{writer.path}: cannot write journal: {e}") from None
    finally:
        writer.close()
    return ControlResult(agent=name, changed=changed, driver_pid=wake_driver(state_dir) if changed else None)


def resume(state_dir: Path, config: Config, name: Optional[str], *, actor: Optional[dict] = None,
           reason: Optional[str] = None) -> ControlResult:
    """Without NAME: lift the ring's pause. With NAME: lift its pause, its
    quarantine (and streak of bad endings) and its back-off; event source
    ``operator``. Unknown NAME -> exit 2. ``lifted``: what it lifted, in the
    words status uses (:func:`ringd.core.policy.holds_lifted`)."""
    from ringd.core.policy import holds_lifted
    require_state_dir(state_dir)
    if name is not None:
        _known_or_exit(state_dir, config, name)
    if not config.ring.journal and not journal_path(state_dir).exists():
        return ControlResult(agent=name, changed=False)
    writer = _writer(state_dir, config)
    lifted: List[str] = []
    why = clean_reason(reason)
    try:
        if writer.set_paused(name, False, actor=actor, reason=why):
            lifted.append("pause lifted")
        if name is not None:
            now = time.time()
            with writer.transaction() as tx:
                held = holds_lifted(tx.agent(name), now, config.ring)
                if transitions.lift(tx, name, now, "ringd resume", actor=actor, operator_reason=why):
                    lifted += held
    except JournalError as e:
        raise OperatorError(f"{writer.path}: cannot write journal: {e}") from None
    finally:
        writer.close()
    result = ControlResult(agent=name, changed=bool(lifted), lifted=lifted)
    if lifted:
        result.driver_pid = wake_driver(state_dir)
    return result


def next_turn(state_dir: Path, config: Config, name: str, *, actor: Optional[dict] = None,
              reason: Optional[str] = None) -> ControlResult:
    """NAME takes the very next turn (after the current run), once, whatever its
    back-off, quarantine or pause; then the ring goes on from where it was."""
    require_state_dir(state_dir)
    _known_or_exit(state_dir, config, name)
    writer = _writer(state_dir, config, create=True)
    try:
        replaced = writer.request_next(name, actor=actor, reason=clean_reason(reason))
    except JournalError as e:
        raise OperatorError(f"{writer.path}: cannot write journal: {e}") from None
    finally:
        writer.close()
    return ControlResult(agent=name, changed=True, replaced=replaced if replaced != name else None,
                         driver_pid=wake_driver(state_dir))
