"""The ring's records as plain typed values, shared by every journal backend
and its readers: run statuses and event sources, a run row, an agent's state.
No I/O here.

A row is read as input, not trusted: any process of the ring's user can write
the journal, and SQLite keeps whatever type it is given (a duration 'abc', an
end time of 1e300, a blob for a reason pass every CHECK). ``from_mapping``
gives each field its type or None (:func:`_int`, :func:`number`, :func:`text`,
times by :func:`ringd.host.heartbeat.epoch`), so no reader - the driver, ``status``,
``history``, the metrics - meets a value it cannot compute with or show.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import AbstractSet, Any, Callable, Dict, Mapping, Optional

from ringd.core.timefmt import epoch

TERMINAL = ("ok", "failed", "deferred", "timeout", "stalled", "skipped", "interrupted", "error")
STATUSES = ("running",) + TERMINAL
SOURCES = ("driver", "reaper", "operator")


@dataclass(frozen=True)
class RunRow:
    id: int
    agent: str
    position: Optional[int]
    status: str
    started_at: float
    ended_at: Optional[float]
    duration: Optional[float]
    exit_code: Optional[int]
    signal: Optional[int]
    reason: Optional[str]
    pid: Optional[int]
    pid_start: Optional[float]
    run_budget: Optional[float]
    stall_threshold: Optional[float]
    log_path: Optional[str]
    driver_pid: Optional[int]
    driver_start: Optional[float]
    phase: Optional[str] = None     # the agent's last STATUS= (ringd.host.notify)
    cpu_seconds: Optional[float] = None   # the run cgroup's CPU time (ringd.host.cgroup); None when unknown
    used: Optional[Mapping[str, int]] = None   # what it spent, by quota pool (the quota_use table; None: not read)

    @classmethod
    def from_mapping(cls, row: Mapping[str, Any]) -> "RunRow":
        keys = set(row.keys())
        return cls(**{n: _RUN_TYPES[n](row[n]) for n in _RUN_FIELDS if n in keys})


@dataclass(frozen=True)
class AgentState:
    """What the ring remembers about one agent between runs (the ``agents`` table).

    ``runs`` and ``last_run_id`` are kept by the journal itself as runs close;
    the rest is decided by :mod:`ringd.core.policy` and stored with :meth:`Tx.put_agent`.
    """
    name: str
    runs: int = 0
    last_run_id: Optional[int] = None
    consecutive_failures: int = 0
    consecutive_deferrals: int = 0          # back-off streak: deferrals and runs that could not start
    bad_streak: int = 0                     # quarantine streak (see SPEC "Whose fault")
    backoff_until: Optional[float] = None
    skip_requested: bool = False            # skip this agent's next turn
    quarantined_until: Optional[float] = None
    quarantine_line: Optional[str] = None   # the roster line its back-off or quarantine began under
    last_ok_at: Optional[float] = None      # the end of its last ok run (kept by the journal)
    joined_at: Optional[float] = None       # since when the driver runs a roster holding it (None: not on it)

    # the fields policy decides (the rest are counters the journal keeps)
    DECIDED = ("consecutive_failures", "consecutive_deferrals", "bad_streak", "backoff_until",
               "skip_requested", "quarantined_until", "quarantine_line")

    @classmethod
    def from_mapping(cls, row: Mapping[str, Any]) -> "AgentState":
        keys = set(row.keys())
        return cls(**{n: _AGENT_TYPES[n](row[n]) for n in _AGENT_FIELDS if n in keys})

    def decided(self) -> "dict[str, Any]":
        return {k: getattr(self, k) for k in self.DECIDED}

    def with_(self, **changes: Any) -> "AgentState":
        """This state with ``changes``: itself when they change nothing (an ok run
        of a healthy agent - most runs - leaves its state as it was, unwritten)."""
        mine = self.__dict__
        if all(k in mine and mine[k] == v for k, v in changes.items()):
            return self
        return replace(self, **changes)


def _int(value: Any) -> Optional[int]:
    """An integer column's value, or None (text, a blob, a fraction, inf)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) else None


def count(value: Any) -> int:
    """A counter: a non-negative integer, else 0."""
    n = _int(value)
    return n if n is not None and n >= 0 else 0


def number(value: Any) -> Optional[float]:
    """A number read from a row or a state file as a finite float (a duration,
    start ticks); None for anything else. JSON reads a 400-digit number as an
    int that float() cannot take (OverflowError), 1e999 as inf and NaN as nan."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _duration(value: Any) -> Optional[float]:
    """Seconds: a finite number that is not negative, or None."""
    value = number(value)
    return value if value is not None and value >= 0 else None


def text(value: Any) -> Optional[str]:
    """Text: a blob as the UTF-8 it spells (a stray byte is U+FFFD), a number as written."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


_RUN_FIELDS = tuple(f.name for f in fields(RunRow))
_AGENT_FIELDS = tuple(f.name for f in fields(AgentState))
_RUN_TYPES: Dict[str, Callable[[Any], Any]] = {
    "id": _int, "agent": text, "position": _int, "status": text, "started_at": epoch, "ended_at": epoch,
    "duration": _duration, "exit_code": _int, "signal": _int, "reason": text, "pid": _int,
    "pid_start": number, "run_budget": _duration, "stall_threshold": _duration, "log_path": text,
    "driver_pid": _int, "driver_start": number, "phase": text, "cpu_seconds": _duration,
    "used": lambda v: None,   # (no column: read apart, Tx.used_by_runs)
}
_AGENT_TYPES: Dict[str, Callable[[Any], Any]] = {
    "name": text, "runs": count, "last_run_id": _int, "consecutive_failures": count,
    "consecutive_deferrals": count, "bad_streak": count, "backoff_until": epoch, "skip_requested": bool,
    "quarantined_until": epoch, "quarantine_line": text, "last_ok_at": epoch, "joined_at": epoch,
}
assert set(_RUN_TYPES) == set(_RUN_FIELDS) and set(_AGENT_TYPES) == set(_AGENT_FIELDS)


@dataclass(frozen=True)
class EventRow:
    """One event of the journal's trail (``ringd events``): what happened to which
    run or agent, who did it (``source``; an operator's ``actor`` and ``reason``)."""
    id: int
    at: Optional[float]
    run_id: Optional[int]
    agent: Optional[str]
    kind: str
    source: str
    detail: Optional[str]
    actor: Optional[Dict[str, Any]] = None
    reason: Optional[str] = None

    @classmethod
    def from_mapping(cls, row: Mapping[str, Any], actor: Optional[Dict[str, Any]] = None) -> "EventRow":
        detail = text(row["detail"])
        agent = text(row["agent"])
        if agent is None and detail and detail.startswith("agent="):   # an older ring's operator event
            agent = detail[6:].split(" ", 1)[0] or None
        return cls(id=_int(row["id"]) or 0, at=epoch(row["at"]), run_id=_int(row["run_id"]),
                   agent=agent, kind=text(row["kind"]) or "", source=text(row["source"]) or "",
                   detail=detail, actor=actor, reason=text(row["reason"]))


@dataclass(frozen=True)
class Controls:
    """The operator's controls as the journal holds them (``ringd pause``/``next``)."""
    ring_paused: bool = False
    # agents paused one by one (in a turn: looked up as it walks them, journal.PausedAgents)
    paused: "AbstractSet[str]" = frozenset()
    next: Optional[str] = None               # the agent asked to take the very next turn
