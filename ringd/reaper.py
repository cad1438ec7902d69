"""The reaper: close journal rows left ``running`` by a driver that died.

"Reap before you count": the driver calls it at start (holding the lock, so
every ``running`` row is an orphan), and status/history call it before reading
(then a row is an orphan when its driver - pid *and* start time - is gone).
A still-alive agent of an orphaned run is killed first: its process group if
the leader is still the process we started, and every process carrying the
run's environment key.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, List, Optional

from . import proctree
from .config import Config
from .procid import same_process
from .journal import Journal, RunRow
from .policy import after_run


def driver_alive(row: RunRow) -> bool:
    return same_process(row.driver_pid, row.driver_start)


def kill_orphan(state_dir: Path, row: RunRow) -> int:
    """Kill what is left of an orphaned run anywhere on the host. Returns count."""
    leader_ours = bool(row.pid) and same_process(row.pid, row.pid_start)
    pgid = row.pid if leader_ours else None  # a dead leader's pid may be recycled
    if leader_ours:
        proctree.signal_process(row.pid, row.pid_start, 9)
    return proctree.kill_run(str(state_dir), row.id, pgid, scope="host")


def reap(journal: Journal, state_dir: Path, config: Optional[Config] = None, *,
         lock_held: bool, log: Callable[[str], None] = lambda _m: None,
         on_reaped: Optional[Callable[[RunRow, dict], None]] = None) -> List[int]:
    """Close every orphaned ``running`` row as ``interrupted`` (source ``reaper``).
    Returns the ids reaped."""
    reaped: List[int] = []
    row = journal.running_row()
    if row is None:
        return reaped
    if row.driver_pid == os.getpid():
        return reaped  # our own run, in flight
    if not lock_held and driver_alive(row):
        return reaped
    killed = kill_orphan(state_dir, row)
    now = time.time()
    ring = config.ring if config is not None else None
    reason = f"driver (pid {row.driver_pid}) died while it ran"
    if killed:
        reason += f"; killed {killed} leftover process(es)"
    after = journal.close_run(row.id, "interrupted", source="reaper", reason=reason, now=now,
                              settle=(lambda state: after_run(state, "interrupted", now, ring))
                              if ring is not None else None)
    if after is not None:
        reaped.append(row.id)
        log(f"reaper: run {row.id} of {row.agent} closed as interrupted ({reason})")
        if on_reaped is not None:
            on_reaped(row, after)
    return reaped
