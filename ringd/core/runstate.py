"""One run as a pure state machine: ``step(state, event, now) -> (state, actions)``.

Events are what the hop observed (the agent exited, time passed, the driver was
told to stop, an operator skipped the run, the agent pinged its watchdog or told
its phase); actions are what the hop must do (beat, SIGTERM the group, kill the
tree, close the row, log). Time is a monotonic clock value passed in, so every
ordering that matters - a skip during the budget's grace, a stop during a skip,
a stall at the same instant as an exit - is a plain function call to test.

Rules (SPEC "An agent's life"): at the budget SIGTERM to the group; at the stall
threshold, or when the agent's watchdog starves before the budget (or it says
WATCHDOG=trigger), the run is killed and counts as ``stalled``; an operator skip
or a driver stop SIGTERMs the group and kills the tree after a short grace.
The first ending decided stays decided: a skipped run stays ``skipped`` if the
driver stops during the skip's grace. An exit observed together with a deadline
or a stop is the agent's own ending - but a death by a SIGTERM the driver did
not send waits TERM_SETTLE for the driver's own stop, and is ``interrupted`` if
it comes (a service manager stopping the unit signals all its processes at once).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Tuple, Union

from ringd.core.levels import ERR, INFO, WARNING
from ringd.core.errors import EX_TEMPFAIL
from ringd.core.policy import classify, died_of_term

SIGKILL = 9   # signal.SIGKILL on every platform ring runs on; the machine imports no OS module

SKIP_GRACE = 0.5   # s between SIGTERM and SIGKILL when an operator skips (ring moves on within 1 s)
STOP_GRACE = 3.0   # s between SIGTERM and SIGKILL when the driver itself stops
WATCHDOG_GRACE = 0.5  # s between SIGTERM and SIGKILL when the agent's watchdog starved
# s after the tree kill: a leader not dead by then is not dying (uninterruptible
# sleep: a hung mount, a frozen cgroup v1): the run is closed without its exit and
# the ring moves on - a wedged agent costs one slot, never the whole ring
UNKILLABLE_WAIT = 5.0
# s an agent's death by a SIGTERM the driver did not send waits for the driver's
# own stop: a service manager stopping the unit SIGTERMs every process in it at
# once, and the agent's death can be seen before the driver's signal
TERM_SETTLE = 0.5


# --- events -----------------------------------------------------------------------
@dataclass(frozen=True)
class Exited:
    exit_code: Optional[int]
    signal: Optional[int]


@dataclass(frozen=True)
class Tick:
    """Time passed: deadlines up to ``now`` fall due."""


@dataclass(frozen=True)
class Stop:
    """The driver is stopping (SIGTERM/SIGINT, or its lock was lost)."""
    reason: str = "driver stopping"


@dataclass(frozen=True)
class Skip:
    """An operator asked to end this run now."""


@dataclass(frozen=True)
class Ping:
    """The agent said WATCHDOG=1."""


@dataclass(frozen=True)
class Trigger:
    """The agent said WATCHDOG=trigger: end it as if its watchdog starved."""


@dataclass(frozen=True)
class Phase:
    """The agent said STATUS=text (one line, cut to its length by notify.clean_phase)."""
    text: str


Event = Union[Exited, Tick, Stop, Skip, Ping, Trigger, Phase]


# --- actions ----------------------------------------------------------------------
@dataclass(frozen=True)
class Beat:
    pass


@dataclass(frozen=True)
class Term:
    """SIGTERM (and SIGCONT, so a stopped agent can act on it) to the agent's group."""


@dataclass(frozen=True)
class KillTree:
    """SIGKILL the run's whole tree, wait (bounded) until its leader is gone."""


@dataclass(frozen=True)
class Close:
    status: str
    source: str
    exit_code: Optional[int]
    signal: Optional[int]
    reason: Optional[str]


@dataclass(frozen=True)
class Log:
    text: str
    level: int   # ringd.core.levels


@dataclass(frozen=True)
class SetPhase:
    text: str


Action = Union[Beat, Term, KillTree, Close, Log, SetPhase]


@dataclass(frozen=True)
class RunState:
    budget: float
    stall: float
    term_at: float                      # monotonic deadlines
    stall_at: float
    beat_at: float
    beat_every: float
    tempfail_exit_code: int = EX_TEMPFAIL
    watchdog: Optional[float] = None    # s between WATCHDOG=1 the agent promised (None: off)
    watchdog_at: Optional[float] = None
    ending: Optional[str] = None        # None | "stall" | "watchdog" | "skip" | "stop" (classify's ended_by)
    termed_at_budget: bool = False
    kill_at: Optional[float] = None     # the end of a grace: kill the tree then
    killed: bool = False
    killed_at: Optional[float] = None   # when the tree kill was sent (UNKILLABLE_WAIT runs from it)
    reason: Optional[str] = None
    phase: Optional[str] = None
    exited: Optional[Tuple[Optional[int], Optional[int]]] = None   # a SIGTERM death held until settle_at
    settle_at: Optional[float] = None
    closed: bool = False


def start(now: float, *, budget: float, stall: float, beat_at: float, beat_every: float,
          tempfail_exit_code: int = EX_TEMPFAIL, watchdog: Optional[float] = None) -> RunState:
    return RunState(budget=budget, stall=stall, term_at=now + budget, stall_at=now + stall,
                    beat_at=beat_at, beat_every=beat_every, tempfail_exit_code=tempfail_exit_code,
                    watchdog=watchdog, watchdog_at=now + watchdog if watchdog else None)


def next_deadline(s: RunState) -> float:
    """The next monotonic time at which a Tick has something to do."""
    times = [s.beat_at]
    if s.settle_at is not None:
        return min(times + [s.settle_at])
    if s.kill_at is not None and not s.killed:
        times.append(s.kill_at)
    if s.killed_at is not None:
        times.append(s.killed_at + UNKILLABLE_WAIT)
    if s.ending is None:
        times.append(s.stall_at)
        if not s.termed_at_budget:
            times.append(s.term_at)
        if s.watchdog_at is not None and not s.termed_at_budget:
            times.append(s.watchdog_at)
    return min(times)


def _ending(s: RunState, kind: str, reason: str, grace: float, now: float) -> Tuple[RunState, List[Action]]:
    return replace(s, ending=kind, reason=reason, kill_at=now + grace), [Term()]


def _source(s: RunState) -> str:
    """Who ended the run, for its row's closing event."""
    return "operator" if s.ending == "skip" else "driver"


def _close(s: RunState, exit_code: Optional[int], signal: Optional[int],
           stopping: Optional[str] = None) -> Tuple[RunState, List[Action]]:
    """Close on the agent's exit; ``stopping``: the reason of a driver stop heard with it."""
    ended_by = s.ending
    if ended_by == "stall" and signal != SIGKILL:
        ended_by = None   # it ended by itself (the budget's SIGTERM) before the kill landed
    status = classify(exit_code, signal, ended_by=ended_by, termed_at_budget=s.termed_at_budget,
                      tempfail_exit_code=s.tempfail_exit_code, stopping=stopping is not None)
    reason = stopping if status == "interrupted" and ended_by is None else s.reason
    # the tree is killed again even after a kill: a process re-parented late is caught now
    return replace(s, closed=True), [KillTree(), Close(status, _source(s), exit_code, signal, reason)]


def step(s: RunState, ev: Event, now: float) -> Tuple[RunState, List[Action]]:
    if s.closed:
        return s, []
    if s.exited is not None:
        return _settling(s, ev, now)
    if isinstance(ev, Exited):
        if s.ending is None and not s.termed_at_budget and died_of_term(ev.exit_code, ev.signal):
            # a SIGTERM the driver did not send: its own stop may be on the way
            return replace(s, exited=(ev.exit_code, ev.signal), settle_at=now + TERM_SETTLE), [KillTree()]
        return _close(s, ev.exit_code, ev.signal)
    if isinstance(ev, Stop):
        if s.ending is None and not s.termed_at_budget:
            return _ending(s, "stop", ev.reason, STOP_GRACE, now)
        # an ending already decided (skip, stall, timeout) stays; the stop only shortens its grace
        kill_at = now + STOP_GRACE if s.kill_at is None else min(s.kill_at, now + STOP_GRACE)
        return replace(s, kill_at=kill_at), []
    if isinstance(ev, Skip):
        if s.ending is not None:
            return s, []
        s2, acts = _ending(s, "skip", "skipped by operator", SKIP_GRACE, now)
        return s2, [Log("skipped by operator", INFO)] + acts
    if isinstance(ev, Ping):
        return (replace(s, watchdog_at=now + s.watchdog) if s.watchdog else s), []
    if isinstance(ev, Trigger):
        if s.ending is not None:
            return s, []
        s, acts = _ending(s, "watchdog", "watchdog: the agent asked to be ended (WATCHDOG=trigger)",
                          WATCHDOG_GRACE, now)
        return s, [Log(f"{s.reason}; ending it like a stall", WARNING)] + acts
    if isinstance(ev, Phase):
        return replace(s, phase=ev.text), [SetPhase(ev.text)]
    return _tick(s, now)


def _settling(s: RunState, ev: Event, now: float) -> Tuple[RunState, List[Action]]:
    """The agent died of a SIGTERM the driver did not send: ``interrupted`` if
    the driver's own stop comes within TERM_SETTLE, else classified as it ended."""
    code, sig = s.exited
    if isinstance(ev, Stop):
        return _close(s, code, sig, stopping=ev.reason)
    if isinstance(ev, Tick):
        acts: List[Action] = []
        if now >= s.beat_at:
            acts.append(Beat())
            s = replace(s, beat_at=now + s.beat_every)
        if now >= s.settle_at:
            s, more = _close(s, code, sig)
            acts += more
        return s, acts
    return s, []   # it has exited: skips, pings and phases come too late


def _tick(s: RunState, now: float) -> Tuple[RunState, List[Action]]:
    acts: List[Action] = []
    if now >= s.beat_at:
        acts.append(Beat())
        s = replace(s, beat_at=now + s.beat_every)
    if s.killed_at is not None and now >= s.killed_at + UNKILLABLE_WAIT:
        reason = (f"{s.reason}; " if s.reason else "") + \
            f"its process did not die of SIGKILL within {UNKILLABLE_WAIT:g}s (uninterruptible sleep?): left behind"
        status = classify(None, SIGKILL, ended_by=s.ending, termed_at_budget=s.termed_at_budget,
                          tempfail_exit_code=s.tempfail_exit_code)
        return replace(s, closed=True), acts + [Log(reason, ERR), Close(status, _source(s), None, None, reason)]
    if s.kill_at is not None and not s.killed and now >= s.kill_at:
        acts.append(KillTree())
        s = replace(s, killed=True, killed_at=now)
    if s.ending is None and now >= s.stall_at:
        s = replace(s, ending="stall", reason=f"no exit {s.stall:g}s after start", killed=True, killed_at=now)
        acts += [Log("stalled; SIGKILL to its whole process tree", WARNING), KillTree()]
    elif s.ending is None and not s.termed_at_budget and s.watchdog_at is not None and now >= s.watchdog_at:
        # (after the budget's SIGTERM the run is ending: its watchdog is off, as systemd's is for a stopping service)
        s, more = _ending(s, "watchdog", f"watchdog: no ping for {s.watchdog:g} s", WATCHDOG_GRACE, now)
        acts += [Log(f"{s.reason}; ending it like a stall", WARNING)] + more
    elif s.ending is None and not s.termed_at_budget and now >= s.term_at:
        s = replace(s, termed_at_budget=True, reason=f"run budget of {s.budget:g}s reached")
        acts += [Log("reached its budget; SIGTERM to its process group", WARNING), Term()]
    return s, acts
