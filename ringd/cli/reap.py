"""Reap before you read: a command closes a dead driver's ``running`` row, raises
its alerts and rewrites the metrics, then reads (the status module only reads)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

from ringd.cli.status import open_reader
from ringd.host.heartbeat import recorded_alive
from ringd.inputs.config import Config
from ringd.journal.sqlite import Journal, JournalError, RunRow


def reap_before_reading(state_dir: Path, config: Config) -> Optional[str]:
    """Reap the journal of ``state_dir`` if its running row's driver is gone; a
    warning for the operator, or None. A journal that cannot be opened is left to
    the read that follows, which says why."""
    try:
        reader = open_reader(state_dir, config)
    except (JournalError, OSError):
        return None
    if reader is None:
        return None
    try:
        return reap_if_orphaned(state_dir, config, reader)[1]
    finally:
        reader.close()


def reap_if_orphaned(state_dir: Path, config: Config, reader: Journal) -> Tuple[List[int], Optional[str]]:
    """Reap before you count: if a ``running`` row's driver is gone, close it (a
    writer is opened only then). Returns (ids reaped, warning or None)."""
    if config.ring.journal:
        return [], None  # many hosts: the row's driver may live elsewhere; the next leader reaps
    row = reader.running_row()
    if row is None or recorded_alive(row.driver_pid, row.driver_start, state_dir):
        return [], None
    try:
        from ringd.loops.reaper import reap
        writer = Journal.open(state_dir, create=False)
        try:
            reaped = reap(writer, state_dir, config,
                          on_reaped=lambda row, closed: _alert_reaped(state_dir, config, row, closed))
            if reaped:   # its driver is dead: nobody else rewrites the metrics
                from ringd.loops.metrics import refresh_without_driver
                refresh_without_driver(state_dir, config, writer)
            return reaped, None
        finally:
            writer.close()
    except (JournalError, OSError) as e:
        return [], f"run {row.id} looks orphaned (its driver is gone) but could not be reaped: {e}"


def _alert_reaped(state_dir: Path, config: Config, row: RunRow, closed) -> None:
    """The alerts the driver would raise had it reaped this run itself."""
    if not config.alerts.command:
        return
    from ringd.host import alerts
    from ringd.core import events
    from ringd.loops.reaper import orphan_cause
    alerts.fire(config.alerts.command, events.RUN_REAPED, row.agent,
                f"run {row.id} of {row.agent} was left running ({orphan_cause(row)}); "
                f"closed as interrupted by an operator command", state_dir, {"run_id": row.id},
                timeout=config.alerts.timeout, reaped_by_caller=False)
    alert_closed(state_dir, config, closed)


def alert_closed(state_dir: Path, config: Config, closed) -> None:
    """Quarantine entered / N failures in a row, after an operator command closed a run."""
    if not config.alerts.command or closed is None:
        return
    from ringd.host import alerts
    from ringd.core.policy import alerts_after
    for kind, detail in alerts_after(closed.agent, closed.status, closed.source, closed.settled,
                                     config.alerts.failures_in_a_row):
        alerts.fire(config.alerts.command, kind, closed.agent, detail, state_dir, {"run_id": closed.run_id},
                    timeout=config.alerts.timeout, reaped_by_caller=False)
