"""Shared quotas (SPEC "Agents on a shared quota"): what a pool has left, whether
an agent may take its turn, what its run is told, and what an agent's report
says. Pure: a pool's counted use, the reserves due, the clock and the
exhausted reports in; decisions out.

A pool's use is a list of ``(time, units)``: each run's last reported use for
the pool, at the time of its last report. A use counts while it is inside the
window (``time > now - window``). A reader may hand the use of a pool as one
``(oldest time, total)`` pair summed for the same ``now``: every answer at that
``now`` is the same.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Collection, Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

USED_KEY = "X_RING_USED"             # X_RING_USED=pool:N, the run's use so far (last value wins)
EXHAUSTED_KEY = "X_RING_EXHAUSTED"   # X_RING_EXHAUSTED=pool:SECONDS|ISO, refused until then
POOL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_UNITS = 10 ** 15                 # units a report or a limit may name (exact in a double)
MAX_HOLD = 366 * 86400.0             # s; an exhausted pool reopening later than this is not believed
_UNITS = re.compile(r"[0-9]{1,16}")
_SECONDS = re.compile(r"[0-9]{1,12}(?:\.[0-9]{1,9})?")
_MAX_VALUE = 100                     # characters of a report's value (pool, colon, number or ISO time)

Use = Tuple[float, int]


class _AnyPool:
    """Every pool name (``ringd notify`` checks a report's form, not the config)."""

    def __contains__(self, name: object) -> bool:
        return True


ANY_POOL = _AnyPool()


@dataclass(frozen=True)
class Pool:
    """One named pool of the config (``quotas.<name>``)."""
    name: str
    limit: int
    window: float
    reserve: Mapping[str, int] = field(default_factory=dict)   # scheduled agent -> units kept for it


@dataclass(frozen=True)
class Exhausted:
    """A report that the provider refuses the pool until ``until`` (epoch s),
    heard at ``at``."""
    at: float
    until: float


@dataclass(frozen=True)
class Hold:
    """Why an agent of the pool may not take its turn, and until when (None:
    not by itself - the reserve's agent must run first, or the limit is 0)."""
    pool: str
    until: Optional[float]
    reason: str


@dataclass(frozen=True)
class Standing:
    """A pool as it stands at ``now``."""
    pool: Pool
    now: float
    used: int                        # units counted in the window
    oldest: Optional[float]          # when the oldest counted use was spent (clamped to now)
    reserved: Mapping[str, int]      # reserves held now, by agent
    exhausted_until: Optional[float]  # reported refused until then (None: not, or over)

    @property
    def reserved_total(self) -> int:
        return sum(self.reserved.values())

    def left_for(self, agent: Optional[str] = None) -> int:
        """``RING_QUOTA_LEFT`` of ``agent`` (None: an agent with no reserve):
        the limit less the use in the window less what is reserved for others."""
        others = sum(units for name, units in self.reserved.items() if name != agent)
        return max(0, self.pool.limit - self.used - others)

    @property
    def reset_at(self) -> Optional[float]:
        """When the exhausted pool reopens, else when the oldest counted use
        leaves the window; None when nothing is counted."""
        if self.exhausted_until is not None:
            return self.exhausted_until
        return None if self.oldest is None else self.oldest + self.pool.window

    def hold(self, agent: Optional[str] = None) -> Optional[Hold]:
        """None when ``agent`` may take its turn; else why not and until when."""
        name = self.pool.name
        if self.exhausted_until is not None:
            return Hold(name, self.exhausted_until, f"quota {name} exhausted (reported)")
        if self.left_for(agent) > 0:
            return None
        until = None if self.oldest is None else self.oldest + self.pool.window
        what = "reserved" if self.used < self.pool.limit else "spent"
        return Hold(name, until, f"quota {name} {what}")


def reserves_held(pool: Pool, now: float, due: Mapping[str, float],
                  paused: Collection[str] = ()) -> Dict[str, int]:
    """The reserves held at ``now``: each one whose scheduled agent's next due
    time (``due``; absent: not on the roster) lies within the window from now.
    A paused agent runs at no due time: its reserve is not held meanwhile."""
    held = {}
    for agent, units in pool.reserve.items():
        at = due.get(agent)
        if at is not None and math.isfinite(at) and at <= now + pool.window and agent not in paused:
            held[agent] = units
    return held


def standing(pool: Pool, uses: Iterable[Use], now: float, *, due: Optional[Mapping[str, float]] = None,
             paused: Collection[str] = (), exhausted: Iterable[Exhausted] = ()) -> Standing:
    """The pool at ``now``. A use stamped after ``now`` (the clock was set back
    since) counts as spent now, so it leaves within one window of the new
    clock. Of the exhausted reports the latest heard counts; one heard after
    ``now`` (the clock set back) holds for no longer than it said."""
    cutoff = now - pool.window
    used, oldest = 0, None
    for at, units in uses:
        if at > cutoff and units > 0:
            used += units
            at = min(at, now)
            oldest = at if oldest is None else min(oldest, at)
    until = None
    latest = max(exhausted, key=lambda e: e.at, default=None)
    if latest is not None:
        end = latest.until if latest.at <= now else min(latest.until, now + max(0.0, latest.until - latest.at))
        until = end if end > now else None
    return Standing(pool, now, used, oldest, reserves_held(pool, now, due or {}, paused), until)


@dataclass(frozen=True)
class Read:
    """What the driver read of the pools (Tx.quota_use) at ``at``, kept across
    turns while it holds: the sums change only when a run records use (the
    driver then drops the read) or when a pool's oldest counted use leaves its
    window (:attr:`until`). A clock set back, or other windows, need a new read."""
    at: float
    windows: Tuple[Tuple[str, float], ...]
    uses: Mapping[str, Sequence[Use]]
    exhausted: Mapping[str, Sequence[Exhausted]]

    @property
    def until(self) -> float:
        window = dict(self.windows)
        return min((at + window[pool] for pool, uses in self.uses.items() if pool in window for at, _ in uses),
                   default=math.inf)

    def holds(self, windows: Tuple[Tuple[str, float], ...], now: float) -> bool:
        return windows == self.windows and self.at <= now < self.until


class Gate:
    """The quota side of one turn: every pool as it stands at ``now``, worked
    out the first time an agent of the pool is asked about. ``uses`` and
    ``exhausted``: by pool name, as the journal holds them."""

    def __init__(self, pools: Mapping[str, Pool], pool_of: Callable[[str], Optional[str]],
                 uses: Mapping[str, Sequence[Use]], now: float, *,
                 exhausted: Optional[Mapping[str, Sequence[Exhausted]]] = None,
                 due: Optional[Mapping[str, float]] = None, paused: Collection[str] = ()):
        self.pools, self.pool_of, self.uses, self.now = pools, pool_of, uses, now
        self.exhausted, self.due, self.paused = exhausted or {}, due or {}, paused
        self._standing: Dict[str, Standing] = {}

    def at(self, now: float) -> "Gate":
        """The same inputs at another clock (``ringd status`` looking ahead)."""
        return Gate(self.pools, self.pool_of, self.uses, now, exhausted=self.exhausted, due=self.due,
                    paused=self.paused)

    def standing(self, name: str) -> Standing:
        got = self._standing.get(name)
        if got is None:
            got = self._standing[name] = standing(self.pools[name], self.uses.get(name, ()), self.now,
                                                  due=self.due, paused=self.paused,
                                                  exhausted=self.exhausted.get(name, ()))
        return got

    def hold(self, agent: str) -> Optional[Hold]:
        """None when ``agent`` may take its turn (or has no pool)."""
        name = self.pool_of(agent)
        if name is None or name not in self.pools:
            return None
        return self.standing(name).hold(agent)

    def env(self, agent: str) -> Dict[str, str]:
        """``RING_QUOTA``, ``RING_QUOTA_LEFT`` and ``RING_QUOTA_RESET`` of a run of
        ``agent`` (nothing for an agent with no pool)."""
        name = self.pool_of(agent)
        if name is None or name not in self.pools:
            return {}
        st = self.standing(name)
        reset = st.reset_at
        return {"RING_QUOTA": name, "RING_QUOTA_LEFT": str(st.left_for(agent)),
                "RING_QUOTA_RESET": "" if reset is None else f"{reset:.3f}"}


# --- what an agent reports -------------------------------------------------------------

@dataclass(frozen=True)
class Used:
    pool: str
    units: int


@dataclass(frozen=True)
class Refused:
    pool: str
    until: float


class BadReport(ValueError):
    """A report that is not heard; ``kind`` says which sort (logged once a run each)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def parse_report(key: str, value: str, now: float, pools: Collection[str]) -> Union[Used, Refused]:
    """``X_RING_USED=pool:N`` -> :class:`Used`; ``X_RING_EXHAUSTED=pool:SECONDS``
    (from ``now``) or ``pool:ISO-TIME`` (a time without a zone is UTC) ->
    :class:`Refused`. Raises :class:`BadReport` for anything else: a value that
    does not parse, a pool not in ``pools``, a negative or absurd number."""
    if len(value) > _MAX_VALUE:
        raise BadReport("parse", f"{key}: a value of {len(value)} characters (at most {_MAX_VALUE})")
    pool, sep, rest = value.partition(":")
    pool, rest = pool.strip(), rest.strip()
    if not sep or not POOL_RE.fullmatch(pool):
        raise BadReport("parse", f"{key}={_quote(value)}: not POOL:VALUE")
    if pool not in pools:
        raise BadReport("pool", f"{key}: no pool named {_quote(pool)}")
    if key == USED_KEY:
        if not _UNITS.fullmatch(rest) or int(rest) > MAX_UNITS:
            raise BadReport("number", f"{key}={_quote(value)}: the use must be a whole number of units "
                                      f"from 0 to {MAX_UNITS}")
        return Used(pool, int(rest))
    if key == EXHAUSTED_KEY:
        return Refused(pool, _until(key, value, rest, now))
    raise BadReport("parse", f"{_quote(key)} is not a quota report")


def _until(key: str, value: str, rest: str, now: float) -> float:
    if _SECONDS.fullmatch(rest):
        seconds = float(rest)
        if seconds > MAX_HOLD:
            raise BadReport("number", f"{key}={_quote(value)}: more than {MAX_HOLD / 86400:g} days")
        return now + seconds
    try:
        when = datetime.fromisoformat(rest[:-1] + "+00:00" if rest.endswith(("Z", "z")) else rest)
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        until = when.timestamp()
    except (ValueError, OverflowError, OSError):
        raise BadReport("parse", f"{key}={_quote(value)}: neither seconds nor an ISO time") from None
    if until - now > MAX_HOLD:
        raise BadReport("number", f"{key}={_quote(value)}: more than {MAX_HOLD / 86400:g} days ahead")
    return until


def _quote(text: str, limit: int = 40) -> str:
    shown = "".join(c if c.isprintable() else " " for c in text)
    return repr(shown if len(shown) <= limit else shown[:limit] + "...")


@dataclass
class RunUse:
    """What one run reported, as it goes: the last use per pool (with the time
    it was reported) and the last exhausted report per pool. ``dirty``: not
    recorded in the journal since it changed."""
    used: Dict[str, Tuple[int, float]] = field(default_factory=dict)
    exhausted: Dict[str, Exhausted] = field(default_factory=dict)
    dirty: bool = False

    def take(self, report: Union[Used, Refused], now: float) -> None:
        if isinstance(report, Used):
            if self.used.get(report.pool, (None,))[0] != report.units:
                self.used[report.pool] = (report.units, now)
                self.dirty = True
        else:
            self.exhausted[report.pool] = Exhausted(now, report.until)
            self.dirty = True

    def exhausts(self, pool: Optional[str], now: float) -> bool:
        """Did the run report ``pool`` refused until a time still ahead?"""
        e = self.exhausted.get(pool) if pool is not None else None
        return e is not None and e.until > now
