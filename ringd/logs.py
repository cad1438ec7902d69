"""``ringd logs``: print a run's log, or follow the current run's log until it ends.

Logs live at ``<state>/logs/<agent>/<run_id>.log``; they are opened without
following symlinks and copied as bytes (an agent's output need not be UTF-8).
"""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import BinaryIO, Callable, Optional

from .config import Config
from .journal import Journal, JournalError, RunRow
from .status import OperatorError, known_names, open_reader, reap_if_orphaned, require_state_dir, unknown_agent

CHUNK = 64 * 1024
FOLLOW_INTERVAL = 0.1   # s between looks at a followed log (the CLI polls; the driver never does)


def log_file(state_dir: Path, row: RunRow) -> Path:
    return state_dir / "logs" / row.agent / f"{row.id}.log"


def find_run(state_dir: Path, config: Config, agent: str, run_id: Optional[int]) -> RunRow:
    """The run whose log to show: ``run_id`` (which must be ``agent``'s) or the
    agent's last run. Unknown agent or run -> OperatorError(2)."""
    require_state_dir(state_dir)
    try:
        reader = open_reader(state_dir, config)
        if reader is None:
            known = known_names(config, state_dir)
            if agent not in known:
                raise unknown_agent(agent, known)
            raise OperatorError(f"{agent} has no runs yet", 1)
        try:
            known = known_names(config, state_dir, reader, include_journal=True)
            if agent not in known:
                raise unknown_agent(agent, known)
            reap_if_orphaned(state_dir, config, reader)
            if run_id is None:
                row = reader.last_run_of(agent)
                if row is None:
                    raise OperatorError(f"{agent} has no runs yet", 1)
            else:
                row = reader.run(run_id)
                if row is None or row.agent != agent:
                    raise OperatorError(f"no run {run_id} of {agent} (see ringd history {agent})", 2)
            return row
        finally:
            reader.close()
    except JournalError as e:
        raise OperatorError(str(e)) from None


def _open_log(path: Path) -> Optional[int]:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OperatorError(f"{path}: log is a symbolic link; refusing to follow it") from None
        raise OperatorError(f"{path}: cannot read log: {e.strerror}") from None


def _copy(fd: int, out: BinaryIO) -> int:
    n = 0
    while True:
        chunk = os.read(fd, CHUNK)
        if not chunk:
            return n
        out.write(chunk)
        n += len(chunk)


def _no_log(row: RunRow, config: Config) -> OperatorError:
    if row.status == "skipped" and row.pid is None:
        why = "it was skipped without starting"
    elif row.status == "running":
        why = "it is starting"
    else:
        why = f"it was pruned (keep_logs: {config.ring.keep_logs}) or never written"
    return OperatorError(f"run {row.id} of {row.agent} ({row.status}) has no log: {why}", 1)


def show_log(state_dir: Path, config: Config, row: RunRow, out: BinaryIO) -> None:
    fd = _open_log(log_file(state_dir, row))
    if fd is None:
        raise _no_log(row, config)
    try:
        _copy(fd, out)
    finally:
        os.close(fd)
    out.flush()


def follow_log(state_dir: Path, config: Config, row: RunRow, out: BinaryIO,
               interval: float = FOLLOW_INTERVAL, sleep: Callable[[float], None] = time.sleep) -> str:
    """Print the log and keep printing what is appended until the run leaves
    ``running`` (an orphaned run - its driver gone - is reaped, which ends it).
    Returns the run's final status."""
    path = log_file(state_dir, row)
    if row.status != "running":
        show_log(state_dir, config, row, out)
        return row.status
    reader = Journal.open_readonly(state_dir)
    fd: Optional[int] = None
    status = row.status
    last_reap_check = 0.0
    try:
        while True:
            if fd is None:
                fd = _open_log(path)
            if fd is not None and _copy(fd, out):
                out.flush()
            current = reader.run(row.id)
            status = current.status if current else "unknown"
            if status != "running":
                if fd is None:
                    fd = _open_log(path)
                if fd is not None:
                    _copy(fd, out)  # the last words written before the run ended
                out.flush()
                return status
            now = time.monotonic()
            if now - last_reap_check >= 1.0:
                last_reap_check = now
                reap_if_orphaned(state_dir, config, reader)
            sleep(interval)
    finally:
        if fd is not None:
            os.close(fd)
        reader.close()
