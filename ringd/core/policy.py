"""Pure decisions of the driver: what a run's ending means for its agent
(SPEC "Whose fault"), whether an agent takes its turn, which agent goes next
or how long to wait when none is due, which alerts an ending raises, and when
a ring whose every run fails at once must slow down. Plain functions of their
inputs and a clock value; no I/O.

Extending the turn choice (pauses, ``ringd next``, scheduled agents): add a
field to :class:`TurnInputs` and a rule in :func:`decide` or :func:`plan_turn`;
the driver only carries out the :class:`Plan` it gets.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import FrozenSet, List, Mapping, Optional, Sequence, Tuple

from ringd.core.settings import RingSettings
from ringd.core.errors import OUTAGE_ERRNOS
from ringd.core.quota import Gate
from ringd.core.records import AgentState

# Endings that count as failures of the agent (consecutive_failures, alerts),
# and those that also count towards quarantine (the agent wedged).
# ``interrupted`` counts only when an operator force-failed the run.
FAILURES = ("failed", "error", "timeout", "stalled")
WEDGED = ("timeout", "stalled")
BACKS_OFF = ("deferred", "error")   # the agent is retried after backoff_initial, doubling


SIGTERM = 15   # signal.SIGTERM on every platform ring runs on; core imports no OS module


def died_of_term(exit_code: Optional[int], signal: Optional[int]) -> bool:
    """Did a run's process die of SIGTERM? Killed by it, or a shell reporting
    that its command was (exit status 128 + 15)."""
    return signal == SIGTERM or exit_code == 128 + SIGTERM


def classify(exit_code: Optional[int], signal: Optional[int], *, ended_by: Optional[str],
             termed_at_budget: bool, tempfail_exit_code: int, stopping: bool = False) -> str:
    """The terminal status of a run from how it ended.

    ``ended_by``: None (the agent exited by itself), ``"stall"`` (killed at the
    stall threshold), ``"watchdog"`` (its watchdog starved), ``"skip"`` (an operator ended it),
    ``"stop"`` (the driver is shutting down). ``stopping``: the driver was told
    to stop around the run's end. A process that dies of SIGTERM while its
    driver is stopping is ``interrupted``, whoever sent the signal: a service
    manager stopping the unit (``KillMode=control-group``) SIGTERMs the agent at
    the same moment as the driver, and the agent's death may be seen first."""
    if ended_by in ("stall", "watchdog"):
        return "stalled"
    if ended_by == "skip":
        return "skipped"
    if ended_by == "stop":
        return "interrupted"
    if termed_at_budget:
        return "timeout"
    if stopping and died_of_term(exit_code, signal):
        return "interrupted"
    if exit_code == 0:
        return "ok"
    if exit_code == tempfail_exit_code:
        return "deferred"
    return "failed"


def counts_against(status: str, source: str) -> Tuple[bool, bool]:
    """(counts as a failure, counts towards quarantine) for an ending, per the
    SPEC's "Whose fault" table."""
    if status == "interrupted":
        forced = source == "operator"
        return forced, forced
    return status in FAILURES, status in WEDGED


def backoff_delay(streak: int, initial: float, maximum: float) -> float:
    """initial, 2x, 4x ... per consecutive back-off, capped at maximum."""
    n = max(1, streak)
    return min(maximum, initial * (2 ** min(n - 1, 62)))


# s: the first and the longest wait between two tries at a state dir that is full
# or unwritable (an outage: the driver waits it out, the agent is not blamed)
OUTAGE_RETRY = (0.2, 5.0)


def is_outage(errno_code: Optional[int]) -> bool:
    """A file system that is full (space or inodes), over quota, read-only or
    failing: an outage to wait out, never the agent's fault (no ``error`` row,
    no back-off, no quarantine count)."""
    return errno_code in OUTAGE_ERRNOS


def outage_retry_after(previous: Optional[float]) -> float:
    """The wait before the next try at an outage: OUTAGE_RETRY[0], doubling per
    failed try, capped at OUTAGE_RETRY[1]."""
    first, longest = OUTAGE_RETRY
    return first if previous is None else min(longest, max(first, previous * 2))


@dataclass(frozen=True)
class Settled:
    """An agent's state after one of its runs closed."""
    state: AgentState
    entered_quarantine: bool = False


def after_run(state: AgentState, status: str, source: str, now: float, ring: RingSettings,
              line: Optional[str] = None, pool_exhausted: bool = False) -> Settled:
    """The agent's new state after a run ended with ``status`` (closed by ``source``).
    ``pool_exhausted``: the run reported its own quota pool refused until a
    time still ahead: a deferral then waits for the pool (the turn choice
    holds it), not for a back-off, and does not count toward its doubling."""
    failure, wedged = counts_against(status, source)
    s = state   # a skip asked for the next turn stays for that turn (a running run is skipped by its id)
    if status == "ok":
        s = s.with_(consecutive_failures=0, consecutive_deferrals=0, backoff_until=None, bad_streak=0)
    if failure:
        s = s.with_(consecutive_failures=s.consecutive_failures + 1)
    if wedged:
        s = s.with_(bad_streak=s.bad_streak + 1)
    if status in BACKS_OFF and not (status == "deferred" and pool_exhausted):
        n = s.consecutive_deferrals + 1
        s = s.with_(consecutive_deferrals=n, quarantine_line=line,
                    backoff_until=now + backoff_delay(n, ring.backoff_initial, ring.backoff_max))
    if wedged and ring.quarantine_after and s.bad_streak >= ring.quarantine_after:
        return Settled(s.with_(quarantined_until=now + ring.quarantine_cooloff, quarantine_line=line), True)
    if status in ("ok", "failed", "error", "deferred") and state.quarantined_until is not None:
        # a probation run that did not wedge ends the quarantine
        s = s.with_(quarantined_until=None, quarantine_line=line if status in BACKS_OFF else None)
    return Settled(s)


def seen_at(state: AgentState, now: float, ring: RingSettings, line: Optional[str] = None) -> AgentState:
    """``state`` as it stands at ``now``. A back-off is set to end its own length
    ahead (:func:`backoff_delay` of its streak: 60 s for a first one, never more
    than ``backoff_max``), a quarantine ``quarantine_cooloff``; a wall clock
    stepped back since stretches the wait by the step. Stretched to no more than
    twice its length, it is kept (an NTP step of seconds changes nothing that
    matters); further, it would last as long as the step (an hour for a minute's
    back-off, for a clock set back an hour), so it ends now - a quarantine's
    probation run is due. (A config lowered since shortens it the same way.)

    ``line`` (readers: status, metrics): the agent's roster line now. A hold
    begun under another line is shown lifted, as the agent's next turn lifts it
    (:func:`decide`); the driver passes none, so its turn sees the change."""
    s = state
    if line is not None and _held(s, now) and line_changed(s, line):
        return lifted(s)
    if s.backoff_until is not None and s.backoff_until > now + 2 * backoff_delay(
            s.consecutive_deferrals, ring.backoff_initial, ring.backoff_max):
        s = s.with_(backoff_until=now)
    if s.quarantined_until is not None and s.quarantined_until > now + 2 * ring.quarantine_cooloff:
        s = s.with_(quarantined_until=now)
    return s


def _held(state: AgentState, now: float) -> bool:
    return state.quarantined_until is not None or (state.backoff_until is not None and now < state.backoff_until)


def line_changed(state: AgentState, line: Optional[str]) -> bool:
    """Does the roster line differ from the one its back-off or quarantine began under?"""
    return line is not None and state.quarantine_line not in (None, line)


def lifted(state: AgentState) -> AgentState:
    """The agent's state once its quarantine and back-off are lifted (``ringd
    resume NAME``, or its roster line changed)."""
    return state.with_(quarantined_until=None, quarantine_line=None, bad_streak=0,
                       backoff_until=None, consecutive_deferrals=0)


def holds_lifted(state: AgentState, now: float, ring: RingSettings) -> List[str]:
    """What ``ringd resume NAME`` lifts of ``state`` at ``now``, each in the words
    ``ringd status`` uses for it: a quarantine, a back-off still running, a
    back-off already over whose doubling starts again from ``backoff_initial``,
    bad endings that counted toward a quarantine. Empty: nothing held."""
    out: List[str] = []
    if state.quarantined_until is not None:
        out.append("quarantine lifted")
    if state.backoff_until is not None and state.backoff_until > now:
        out.append("back-off lifted")
    elif state.backoff_until is not None:
        out.append(f"back-off already over; the next one starts at {ring.backoff_initial:g}s again")
    if state.bad_streak and state.quarantined_until is None:
        n = state.bad_streak
        out.append(f"{n} bad ending{'s' if n != 1 else ''} toward quarantine forgotten")
    return out


# --- the turn ---------------------------------------------------------------------

class Action(enum.Enum):
    RUN = "run"      # start the agent
    SKIP = "skip"    # record a skipped row (an operator asked), start nothing
    PASS = "pass"    # go on to the next agent silently (backing off, quarantined)


@dataclass(frozen=True)
class TurnDecision:
    action: Action
    reason: Optional[str] = None
    line_changed: bool = False   # the roster line differs from the one its back-off/quarantine began under
    until: Optional[float] = None  # PASS: when the agent is due again (None: not by itself)


def decide(state: AgentState, now: float, line: Optional[str] = None) -> TurnDecision:
    """Does an agent take its turn?"""
    if state.skip_requested:
        return TurnDecision(Action.SKIP, "operator requested skip")
    if _held(state, now) and line_changed(state, line):
        return TurnDecision(Action.RUN, "roster line changed; quarantine and back-off lifted", line_changed=True)
    if state.quarantined_until is not None:
        if now < state.quarantined_until:
            return TurnDecision(Action.PASS, "quarantined", until=state.quarantined_until)
        return TurnDecision(Action.RUN, "probation run after quarantine cool-off")
    if state.backoff_until is not None and now < state.backoff_until:
        return TurnDecision(Action.PASS, "backing off", until=state.backoff_until)
    return TurnDecision(Action.RUN)


@dataclass(frozen=True)
class TurnInputs:
    """Everything the turn choice looks at."""
    roster: Sequence[Tuple[str, str]]        # (name, line) in ring order
    start: int                               # index of the agent whose turn it is
    states: Mapping[str, AgentState]         # every roster agent's (a lazy mapping in the driver)
    now: float
    limit: Optional[int] = None              # consider at most this many agents (``--once``)
    paused: FrozenSet[str] = frozenset()     # agents an operator paused (``ringd pause NAME``): passed over
    requested: Optional[str] = None          # ``ringd next NAME``: this agent's turn now, whatever its state
    # scheduled agents (SPEC "Scheduled agents"): name -> next due time (ringd.inputs.schedule);
    # they take no ordinary turn. ``ran_scheduled``: those already run at this hop
    # boundary (since the last ordinary turn: the round, :func:`round_after`), so each
    # due one runs once per boundary.
    scheduled: Mapping[str, float] = field(default_factory=dict)
    ran_scheduled: frozenset = frozenset()
    # the roster index of each scheduled agent (the driver's view keeps them, so a turn
    # looks at the scheduled agents only, never at the whole roster); None: found by a
    # pass over the roster
    scheduled_at: Optional[Mapping[str, int]] = None
    # shared quotas (ringd.core.quota.Gate): an agent whose pool holds it is passed over
    # like a paused one (no row) until the pool's reset; None: no agent draws on a pool
    quota: Optional["Gate"] = None


@dataclass(frozen=True)
class Plan:
    """What the driver does next: take ``index``'s turn (``decision``), or, when
    ``index`` is None, nothing is due: wait until ``until`` (None: until woken)."""
    index: Optional[int]
    decision: Optional[TurnDecision]
    passed: List[int] = field(default_factory=list)   # indexes passed over on the way
    until: Optional[float] = None
    forced: bool = False    # ``ringd next``: a turn out of order (the ring's place is kept)
    scheduled: bool = False      # ``index`` is a scheduled agent that is due (not an ordinary turn)
    again: bool = False          # ... due again with no ordinary turn since it ran: a new round of
                                 # scheduled runs, which a ring that fails at once waits before, like a lap


def plan_turn(inp: TurnInputs) -> Plan:
    """At a hop boundary: an operator's ``ringd next NAME`` first, out of order;
    then each scheduled agent that is due (roster order, once per boundary);
    then go round the ring from ``start``: the first ordinary agent that runs
    or is skipped takes the turn; agents that pass (their quota pool holding
    them too), that an operator paused, and scheduled ones are stepped over. A scheduled agent due again already
    (its run outlasted its period) waits for the ordinary turn, unless no
    ordinary agent wants it - and never under ``--once`` (a ``limit``): one lap
    runs each agent once, and a job due again forever would never end it."""
    n = len(inp.roster)
    if inp.requested is not None:
        names = [name for name, _ in inp.roster]
        if inp.requested in names:
            return Plan(names.index(inp.requested), TurnDecision(Action.RUN, "takes this turn (ringd next)"),
                        forced=True)
    again: Optional[Plan] = None
    dues: List[float] = []
    for i, name in _scheduled_in_order(inp):
        due, line = inp.scheduled.get(name), inp.roster[i][1]
        if due is None or name in inp.paused:
            continue
        if due > inp.now:
            dues.append(due)
            continue
        d = gated(inp, name, decide(inp.states.get(name) or AgentState(name=name), inp.now, line))
        if d.action is Action.PASS:
            if d.until is not None:
                dues.append(d.until)
        elif name not in inp.ran_scheduled:
            return Plan(i, d, [], scheduled=True)
        elif again is None:
            again = Plan(i, d, [], scheduled=True, again=True)
    passed: List[int] = []
    for k in range(n if inp.limit is None else min(n, inp.limit)):
        i = (inp.start + k) % n
        name, line = inp.roster[i]
        if name in inp.paused or name in inp.scheduled:   # paused: until ``ringd resume NAME``
            passed.append(i)
            continue
        d = gated(inp, name, decide(inp.states.get(name) or AgentState(name=name), inp.now, line))
        if d.action is not Action.PASS:
            return Plan(i, d, passed)
        passed.append(i)
        if d.until is not None:
            dues.append(d.until)
    if again is not None and inp.limit is None:
        return again
    return Plan(None, None, passed, min(dues) if dues else None)


def gated(inp: TurnInputs, name: str, d: TurnDecision) -> TurnDecision:
    """``d``, unless the agent would run and its quota pool holds it: then it
    passes until the pool's reset (a skip an operator asked for still happens:
    it spends nothing)."""
    if inp.quota is None or d.action is not Action.RUN:
        return d
    hold = inp.quota.hold(name)
    if hold is None:
        return d
    return TurnDecision(Action.PASS, hold.reason, until=hold.until)


def _scheduled_in_order(inp: TurnInputs) -> List[Tuple[int, str]]:
    """(roster index, name) of the scheduled agents on the roster, in roster order:
    from ``scheduled_at`` without a pass over the roster (a ring of 10,000 agents
    with one scheduled: 0.36 ms a turn, where the pass was)."""
    if not inp.scheduled:
        return []
    at = inp.scheduled_at
    if at is None:
        return [(i, name) for i, (name, _) in enumerate(inp.roster) if name in inp.scheduled]
    return sorted((i, name) for name, i in at.items() if name in inp.scheduled)


def round_after(ran: FrozenSet[str], plan: Optional[Plan], names: Sequence[str], *,
                ring_paused: bool = False, once: bool = False) -> FrozenSet[str]:
    """The round (``TurnInputs.ran_scheduled``) once the driver has carried out
    ``plan`` (None: a new lap is counted first, nothing taken): a scheduled
    run (or skip) joins it; an ordinary turn, a job due again (the driver ends
    the round, :meth:`Driver.end_round`), nothing due, and a pause end it (the
    round keeps a job outlasting its period from starving the ring; a pause
    starves nothing, and a job that came due again during it is due at resume
    like any other: SPEC, before the ordinary next agent). Under
    ``--once`` an ordinary turn does not: one lap runs each job once at most.
    ``ringd next`` is out of order and changes nothing. The driver keeps the
    round in the journal, so ``ringd status`` names the agent it will pick."""
    if ring_paused:
        return frozenset()
    if plan is None or plan.forced:
        return ran
    if plan.again or plan.index is None:
        return frozenset()
    if plan.scheduled:
        return ran | {names[plan.index]}
    return ran if once else frozenset()


# --- alerts -----------------------------------------------------------------------

from ringd.core.events import FAILURES as FAILURES_IN_A_ROW, QUARANTINED  # noqa: E402


def alerts_after(agent: str, status: str, source: str, settled: Settled,
                 failures_in_a_row: int) -> List[Tuple[str, str]]:
    """The alerts a closed run raises: [(kind, detail)]."""
    out: List[Tuple[str, str]] = []
    if settled.entered_quarantine:
        out.append((QUARANTINED, f"{agent} quarantined after {settled.state.bad_streak} bad endings in a row"))
    n = settled.state.consecutive_failures
    if counts_against(status, source)[0] and n and failures_in_a_row and n % failures_in_a_row == 0:
        out.append((FAILURES_IN_A_ROW, f"{agent} failed {n} times in a row (last: {status})"))
    return out


# --- a ring that fails at once must not spin ---------------------------------------

@dataclass(frozen=True)
class Spin:
    """Fast-fail laps: does the current lap consist only of runs that failed
    within ``fast_fail`` seconds (or could not start), and how long the driver
    waits after such a lap."""
    runs: int = 0            # runs in the current lap
    all_fast: bool = True    # every one of them failed fast
    delay: float = 0.0       # the current wait after a fast-fail lap (0: none)


def spin_after_run(spin: Spin, status: str, duration: float, fast_fail: float) -> Spin:
    fast = status == "error" or (status == "failed" and duration <= fast_fail)
    if status == "ok" or duration > fast_fail:
        return Spin(runs=spin.runs + 1, all_fast=False, delay=0.0)
    if status == "skipped":
        return spin
    return Spin(runs=spin.runs + 1, all_fast=spin.all_fast and fast, delay=spin.delay)


def spin_at_lap_end(spin: Spin, backoff_max: float) -> Spin:
    """At the end of a lap: the wait before the next one (``delay``; 0: none)
    and a fresh lap. The wait doubles from 1 s up to ``backoff_max``."""
    if spin.runs and spin.all_fast:
        delay = min(backoff_max, 1.0 if spin.delay <= 0 else spin.delay * 2)
        return Spin(delay=delay)
    return Spin(delay=0.0 if spin.runs else spin.delay)


# --- signals ------------------------------------------------------------------------

@dataclass(frozen=True)
class Requests:
    """What the signals a wait returned ask of the driver."""
    stop: bool = False       # SIGTERM, SIGINT
    reload: bool = False     # SIGHUP
    wake: bool = False       # SIGUSR1: an operator wrote a request to the journal
    children: bool = False   # SIGCHLD: reap exited helpers

    @property
    def any(self) -> bool:
        return self.stop or self.reload or self.wake


def wait_timeout(now: float, until: Optional[float], next_beat: float, roster_check: float) -> float:
    """How long an idle driver may sleep: until the thing it waits for, but never
    past its next heartbeat or its next look at the roster file."""
    candidates = [next_beat, roster_check] + ([until] if until is not None else [])
    return max(0.0, min(candidates) - now)
