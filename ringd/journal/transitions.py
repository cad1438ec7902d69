"""The ring's state changes that span a run and its agent, each in one journal
transaction: close a run and settle its agent (the one place every closer -
hop, reaper, force-fail - goes through), record a turn not taken, take an
operator's skip or resume. The rules themselves are :mod:`ringd.core.policy`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterator, Mapping, Optional

from ringd.core.settings import RingSettings
from ringd.journal.sqlite import AgentState, Journal, JournalError, RunRow, Tx
from ringd.core.policy import Settled, after_run, lifted, seen_at
from ringd.core.quota import RunUse

SKIP_RUN_KEY = "skip_run"   # meta: the id of the run an operator asked to end now


class AgentStates(Mapping):
    """Agents' states read on demand inside a transaction, as they stand at
    ``now`` (:func:`ringd.core.policy.seen_at`): the turn choice looks at one agent
    per turn as a rule, never at the whole roster."""

    def __init__(self, tx: Tx, now: float, ring: RingSettings):
        self._tx, self._now, self._ring = tx, now, ring

    def __getitem__(self, name: str) -> AgentState:
        return seen_at(self._tx.agent(name), self._now, self._ring)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tx.agents())

    def __len__(self) -> int:
        return len(self._tx.agents())


@dataclass(frozen=True)
class Closed:
    run_id: int
    agent: str
    status: str
    source: str
    settled: Settled


def close_in(tx: Tx, run_id: int, agent: str, position: Optional[int], status: str, *,
             source: str, now: float, ring: RingSettings, line: Optional[str] = None,
             exit_code: Optional[int] = None, signal: Optional[int] = None,
             reason: Optional[str] = None, log_path: Optional[str] = None,
             pid: Optional[int] = None, pid_start: Optional[float] = None,
             phase: Optional[str] = None, cpu_seconds: Optional[float] = None,
             use: Optional[RunUse] = None, pool: Optional[str] = None,
             actor: Optional[Mapping[str, Any]] = None, operator_reason: Optional[str] = None) -> Optional[Closed]:
    """Close a ``running`` row and store its agent's new state, inside the caller's
    transaction. An agent entering quarantine gets its one ``skipped`` row saying
    so. None when the row was no longer running (an operator or the reaper closed
    it first). ``use``: what the run reported of its quotas, recorded with it
    (``pool``: the agent's own, whose exhausted report spares it a back-off).
    ``actor`` and ``operator_reason``: who closed it and why (an operator's
    force-fail); a run an operator skipped gets those of the skip's request, so
    its closing event names them."""
    if actor is None and status == "skipped" and source == "operator":
        actor, operator_reason = tx.asked_by(run_id, agent)
        if operator_reason:
            reason = f"{reason or 'skipped by operator'}: {operator_reason}"
    if not tx.close_run(run_id, status, source=source, now=now, exit_code=exit_code,
                        signal=signal, reason=reason, log_path=log_path, pid=pid, pid_start=pid_start,
                        phase=phase, cpu_seconds=cpu_seconds, agent=agent, actor=actor,
                        operator_reason=operator_reason):
        return None
    if use is not None:
        record_use(tx, run_id, agent, use)
    stored = tx.agent(agent)
    before = seen_at(stored, now, ring)
    settled = after_run(before, status, source, now, ring, line,
                        pool_exhausted=use is not None and use.exhausts(pool, now))
    if settled.state is not stored and settled.state.decided() != stored.decided():
        # (an ordinary ok run of a healthy agent changes nothing: the very same state)
        tx.put_agent(settled.state)
    if settled.entered_quarantine:
        until = datetime.fromtimestamp(settled.state.quarantined_until, tz=timezone.utc).isoformat()
        # (stalled, timeout or force-failed ones: ringd.core.policy.counts_against)
        tx.add_skipped(agent, position, f"quarantined until {until} after {settled.state.bad_streak} "
                                        f"bad endings in a row (the last: {status} by {source})", source, now,
                       kind="quarantined")
    return Closed(run_id, agent, status, source, settled)


def record_use(tx: Tx, run_id: int, agent: str, use: RunUse) -> None:
    """What a run reported of its quotas so far: its use with the run, each
    exhausted report on its pool (upserts: written again, they change nothing)."""
    for pool, (units, at) in use.used.items():
        tx.put_use(run_id, pool, agent, units, at)
    for pool, report in use.exhausted.items():
        tx.set_exhausted(pool, report)


def close_row(journal: Journal, row: RunRow, status: str, *, source: str, now: float,
              ring: RingSettings, line: Optional[str] = None, reason: Optional[str] = None,
              phase: Optional[str] = None, actor: Optional[Mapping[str, Any]] = None,
              operator_reason: Optional[str] = None) -> Optional[Closed]:
    """Close ``row`` in a transaction of its own (the reaper, an operator's force-fail).
    ``phase``: the agent's last STATUS= as its driver published it (ringd.host.notify.read_notes)."""
    with journal.transaction() as tx:
        return close_in(tx, row.id, row.agent, row.position, status, source=source, now=now,
                        ring=ring, line=line, reason=reason, phase=phase, actor=actor,
                        operator_reason=operator_reason)


def skip_turn(tx: Tx, agent: str, position: int, reason: str, now: float) -> int:
    """A turn an operator asked to skip: a ``skipped`` row (its event names who
    asked, and why); the request is used up."""
    actor, why = tx.asked_by(None, agent)
    run_id = tx.add_skipped(agent, position, f"{reason}: {why}" if why else reason, "operator", now,
                            actor=actor, operator_reason=why)
    tx.put_agent(tx.agent(agent).with_(skip_requested=False))
    return run_id


def lift(tx: Tx, agent: str, now: float, reason: str, source: str = "operator",
         actor: Optional[Mapping[str, Any]] = None, operator_reason: Optional[str] = None) -> bool:
    """Lift an agent's quarantine and back-off (``ringd resume``, or its roster
    line changed). True if it had either."""
    state = tx.agent(agent)
    held = state.quarantined_until is not None or state.backoff_until is not None or state.bad_streak > 0
    if held:
        tx.put_agent(lifted(state))
        tx.event(None, "resumed", source,
                 f"agent={agent} was_quarantined={int(state.quarantined_until is not None)} reason={reason}", now,
                 agent=agent, actor=actor, reason=operator_reason)
    return held


@dataclass(frozen=True)
class SkipRequest:
    agent: str
    run_id: Optional[int]    # the run to end now; None: the agent's next turn is skipped


class RunEnded(JournalError):
    """The run an operator meant has already ended."""


def request_skip(journal: Journal, agent: Optional[str], run_id: Optional[int], now: float, *,
                 actor: Optional[Mapping[str, Any]] = None, reason: Optional[str] = None) -> SkipRequest:
    """Record an operator's skip atomically against the driver's own writes.

    ``agent`` None: end the run ``run_id`` (the run the operator saw); if it has
    ended meanwhile nothing is skipped (:class:`RunEnded`). ``agent`` given: end
    its run if it is the one running, else skip its next turn. ``actor`` and
    ``reason`` go with the request's event (and the skipped run's closing one)."""
    with journal.transaction() as tx:
        running = tx.running_row()
        if agent is None:
            if running is None or running.id != run_id:
                raise RunEnded(f"run {run_id} had already ended")
            agent = running.agent
        if running is not None and running.agent == agent:
            tx.set_meta(SKIP_RUN_KEY, str(running.id))
            tx.event(running.id, "skip-requested", "operator", f"agent={agent}", now, agent=agent,
                     actor=actor, reason=reason)
            return SkipRequest(agent, running.id)
        tx.put_agent(tx.agent(agent).with_(skip_requested=True))
        tx.event(None, "skip-requested", "operator", f"agent={agent}", now, agent=agent, actor=actor, reason=reason)
        return SkipRequest(agent, None)


def skip_requested_for(journal: Journal, run_id: int) -> bool:
    """Has an operator asked to end run ``run_id`` now?"""
    return journal.meta(SKIP_RUN_KEY) == str(run_id)
