"""The ring's records as plain typed values, shared by every journal backend
and its readers: run statuses and event sources, a run row, an agent's state.
No I/O here.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Optional

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
    phase: Optional[str] = None     # the agent's last STATUS= (ringd.notify)
    cpu_seconds: Optional[float] = None   # the run cgroup's CPU time (ringd.cgroup); None when unknown

    @classmethod
    def from_mapping(cls, row: Mapping[str, Any]) -> "RunRow":
        keys = set(row.keys())
        return cls(**{n: row[n] for n in _RUN_FIELDS if n in keys})


@dataclass(frozen=True)
class AgentState:
    """What the ring remembers about one agent between runs (the ``agents`` table).

    ``runs`` and ``last_run_id`` are kept by the journal itself as runs close;
    the rest is decided by :mod:`ringd.policy` and stored with :meth:`Tx.put_agent`.
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

    # the fields policy decides (the rest are counters the journal keeps)
    DECIDED = ("consecutive_failures", "consecutive_deferrals", "bad_streak", "backoff_until",
               "skip_requested", "quarantined_until", "quarantine_line")

    @classmethod
    def from_mapping(cls, row: Mapping[str, Any]) -> "AgentState":
        keys = set(row.keys())
        data = {n: row[n] for n in _AGENT_FIELDS if n in keys}
        for counter in ("runs", "consecutive_failures", "consecutive_deferrals", "bad_streak"):
            data[counter] = int(data.get(counter) or 0)
        data["skip_requested"] = bool(data.get("skip_requested"))
        return cls(**data)

    def decided(self) -> "dict[str, Any]":
        return {k: getattr(self, k) for k in self.DECIDED}

    def with_(self, **changes: Any) -> "AgentState":
        """This state with ``changes``: itself when they change nothing (an ok run
        of a healthy agent - most runs - leaves its state as it was, unwritten)."""
        mine = self.__dict__
        if all(k in mine and mine[k] == v for k, v in changes.items()):
            return self
        return replace(self, **changes)


_RUN_FIELDS = tuple(f.name for f in fields(RunRow))
_AGENT_FIELDS = tuple(f.name for f in fields(AgentState))


@dataclass(frozen=True)
class Controls:
    """The operator's controls as the journal holds them (``ringd pause``/``next``)."""
    ring_paused: bool = False
    paused: "frozenset[str]" = frozenset()   # agents paused one by one
    next: Optional[str] = None               # the agent asked to take the very next turn
