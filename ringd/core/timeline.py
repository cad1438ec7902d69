"""The picture of a ring as data: lanes, bars, laps, due times and quota use over a window (pure).

``build_timeline`` turns run records into what ``ringd report`` draws; it reads
no clock and no file. A run is in the window when it started in it (SPEC "A
picture of the ring"); its bar goes from its start to its end (a run still in
flight: to ``now``), so it may reach past the window's end.

The journal does not record the lap of each run: a lap boundary is where an
ordinary (unscheduled) agent's turn comes at or before the roster position of
the ordinary turn before it - the ring wrapped, as the driver counts laps.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import AbstractSet, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ringd.core.records import STATUSES, RunRow


@dataclass(frozen=True)
class Lane:
    """One agent's row of the chart."""
    index: int
    name: str
    on_roster: bool
    scheduled: bool
    runs: int = 0


@dataclass(frozen=True)
class Bar:
    """One run, from its start to its end (``running``: to the picture's ``now``)."""
    run_id: int
    lane: int
    agent: str
    status: str
    start: float
    end: float
    duration: Optional[float]
    exit_code: Optional[int]
    signal: Optional[int]
    phase: Optional[str]
    reason: Optional[str]

    @property
    def running(self) -> bool:
        return self.status == "running"


@dataclass(frozen=True)
class Lap:
    """A lap began at ``at`` (``number`` when known)."""
    at: float
    number: Optional[int]


@dataclass(frozen=True)
class Due:
    """A scheduled agent was (or will be) due at ``at``."""
    lane: int
    agent: str
    at: float


@dataclass(frozen=True)
class PoolUse:
    """A quota pool's use in its rolling window, as steps ``(time, used)`` over the picture."""
    name: str
    limit: float
    window: float
    steps: Tuple[Tuple[float, float], ...]


@dataclass(frozen=True)
class Timeline:
    """What the report draws. ``since``/``until``: the window runs were taken
    from; ``start``/``end``: the span the chart shows (fitted to the runs when
    asked, never shorter than the bars). ``pools`` is None when the ring's
    status says nothing of quota pools (none configured, or a ring without them)."""
    since: float
    until: float
    start: float
    end: float
    now: float
    lanes: Tuple[Lane, ...]
    bars: Tuple[Bar, ...]
    laps: Tuple[Lap, ...]
    dues: Tuple[Due, ...]
    counts: Mapping[str, int] = field(default_factory=dict)
    pools: Optional[Tuple[PoolUse, ...]] = None


def build_timeline(runs: Iterable[RunRow], *, since: float, until: float, now: float,
                   roster: Sequence[str] = (), scheduled: AbstractSet[str] = frozenset(),
                   dues: Optional[Mapping[str, Sequence[float]]] = None, lap: Optional[int] = None,
                   pools: Optional[Sequence[PoolUse]] = None, fit: bool = False) -> Timeline:
    """The timeline of ``runs`` that started in ``[since, until)``.

    ``roster``: lane order (every roster agent gets a lane, runs or not; an
    agent that ran but has left the roster gets one after them). ``scheduled``:
    agents whose runs are not turns (no lap boundary). ``dues``: per agent, the
    times it was due. ``lap``: the lap of the newest ordinary run, to number
    the laps (None: unnumbered). ``fit``: show only the span the runs cover
    (plus a margin) instead of the whole window."""
    picked = sorted((r for r in runs if r.started_at is not None and since <= r.started_at < until),
                    key=lambda r: r.id)
    names = list(dict.fromkeys(roster))
    extra = [n for n in dict.fromkeys(r.agent for r in picked) if n not in set(names)]
    order = {n: i for i, n in enumerate(names + extra)}
    bars = tuple(_bar(r, order[r.agent], now) for r in picked)
    per_lane = Counter(b.lane for b in bars)
    lanes = tuple(Lane(i, n, i < len(names), n in scheduled, per_lane.get(i, 0)) for n, i in order.items())
    start, end = _span(bars, since, until, fit)
    marks = tuple(sorted((Due(order[a], a, t) for a, times in (dues or {}).items() if a in order
                          for t in times if start <= t <= end), key=lambda d: (d.at, d.lane)))
    return Timeline(since=since, until=until, start=start, end=end, now=now, lanes=lanes, bars=bars,
                    laps=laps_of(picked, scheduled, lap), dues=marks,
                    counts=dict(Counter(b.status for b in bars)),
                    pools=None if pools is None else tuple(pools))


def _bar(r: RunRow, lane: int, now: float) -> Bar:
    if r.status == "running":
        end = max(r.started_at, now)
    elif r.ended_at is not None:
        end = max(r.started_at, r.ended_at)
    else:
        end = r.started_at + (r.duration or 0.0)
    return Bar(r.id, lane, r.agent, r.status if r.status in STATUSES else "error", r.started_at, end,
               r.duration, r.exit_code, r.signal, r.phase, r.reason)


def _span(bars: Sequence[Bar], since: float, until: float, fit: bool) -> Tuple[float, float]:
    lo, hi = since, until
    if bars:
        first, last = min(b.start for b in bars), max(b.end for b in bars)
        if fit:
            pad = max(1.0, (last - first) * 0.02)
            lo, hi = max(since, first - pad), min(until, last + pad)
        hi = max(hi, last)   # a run that started in the window is drawn whole
    if hi <= lo:
        hi = lo + 1.0
    return lo, hi


def laps_of(runs: Sequence[RunRow], scheduled: AbstractSet[str], lap: Optional[int] = None) -> Tuple[Lap, ...]:
    """Lap boundaries in ``runs`` (oldest first): an ordinary turn at or before
    the previous ordinary turn's roster position. Numbered back from ``lap``
    (the newest ordinary run's lap) when it is given."""
    times: List[float] = []
    previous: Optional[int] = None
    for r in runs:
        if r.agent in scheduled or r.position is None:
            continue
        if previous is not None and r.position <= previous:
            times.append(r.started_at)
        previous = r.position
    out = []
    for k, t in enumerate(times):
        number = None if lap is None else lap - (len(times) - 1 - k)
        out.append(Lap(t, number if number is not None and number >= 1 else None))
    return tuple(out)


def pool_use(uses: Iterable[Tuple[float, float]], window: float, start: float, end: float) -> Tuple[
        Tuple[float, float], ...]:
    """A pool's use in its rolling ``window`` as steps over ``[start, end]``:
    each ``(time, units)`` counts from its time until ``window`` later. The
    first step is the use at ``start`` (uses from before it still in the
    window count), the last one holds until ``end``."""
    changes: Dict[float, float] = {}
    level = 0.0
    for t, units in uses:
        if units <= 0 or t + window <= start or t > end:
            continue
        if t <= start:
            level += units
        else:
            changes[t] = changes.get(t, 0.0) + units
        if t + window <= end:
            changes[t + window] = changes.get(t + window, 0.0) - units
    steps = [(start, max(0.0, level))]
    for t in sorted(changes):
        level += changes[t]
        if t > start:
            steps.append((t, max(0.0, round(level, 9))))
    if steps[-1][0] < end:
        steps.append((end, steps[-1][1]))
    return tuple(steps)
