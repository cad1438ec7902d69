"""The settings dataclasses a loaded config is made of (defaults as in config/ring.yaml)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ringd.core.errors import EX_TEMPFAIL


@dataclass(frozen=True)
class AgentOverride:
    run_budget: Optional[float] = None
    stall_threshold: Optional[float] = None
    cwd: Optional[str] = None
    watchdog: Optional[float] = None       # s without WATCHDOG=1 before the run is ended; 0: off (null)
    schedule: Optional[str] = None         # five-field cron (local time): a scheduled agent
    every: Optional[float] = None          # s between starts: a scheduled agent
    quota: Optional[str] = None            # the pool (``quotas.<name>``) its runs draw on


@dataclass(frozen=True)
class RingSettings:
    run_budget: float = 3600
    stall_threshold: float = 4200
    heartbeat_interval: float = 10
    lap_pause: float = 0
    tempfail_exit_code: int = EX_TEMPFAIL   # an agent's "not now": sysexits' 75
    backoff_initial: float = 60
    backoff_max: float = 3600
    keep_logs: int = 50
    keep_runs: int = 100000      # runs kept in the journal; 0 keeps all
    quarantine_after: int = 3
    quarantine_cooloff: float = 86400
    fast_fail: float = 1.0      # s; a lap whose every run failed within this is a spinning lap
    roster: Optional[str] = None
    state_dir: Optional[str] = None    # None: ./STATE (unless --state or RING_STATE); relative to the config's folder
    watchdog: Optional[float] = None   # default agent watchdog (s); None: off
    journal: Optional[str] = None      # None: SQLite in the state dir; "postgresql://...": a many-host ring
    lease_ttl: float = 30              # s; a many-host ring's leadership lease


@dataclass(frozen=True)
class WatchSettings:
    poll_interval: float = 300
    stale_after: float = 300
    restart_sec: float = 5
    start_limit_burst: int = 5
    start_limit_interval: float = 600
    restart_command: Optional[Tuple[str, ...]] = None


@dataclass(frozen=True)
class AlertSettings:
    command: Optional[Tuple[str, ...]] = None
    failures_in_a_row: int = 5
    timeout: float = 30
    silent_after: Optional[float] = None        # s with no ok run before an agent is silent (None: off)
    paused_longer_than: Optional[float] = None  # s a pause may last before it alerts (None: off)


@dataclass(frozen=True)
class Limits:
    """The effective budget/threshold of one agent after overrides."""
    run_budget: float
    stall_threshold: float
