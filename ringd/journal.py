"""The journal: one SQLite file that records every run truthfully.

This module is the only writer of the schema. The schema itself enforces the
SPEC's invariants (status set, terminal coherence, at most one ``running`` row)
with CHECK constraints and a partial unique index; triggers keep per-agent
counters in step with the runs so readers never scan history. Writers use
``BEGIN IMMEDIATE``; readers open the file read-only.
"""
from __future__ import annotations

import os
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from datetime import datetime, timezone
from typing import Any, Callable, Dict, Iterator, List, Optional

from .schema_sqlite import SCHEMA, SCHEMA_VERSION, SOURCES, STATUSES, TERMINAL  # noqa: F401

JOURNAL_FILE = "journal.db"


class JournalError(Exception):
    """The journal cannot be used (corrupt, unwritable, ...). Message is one line."""


@dataclass
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

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> "RunRow":
        return cls(**{k: row[k] for k in row.keys()})


def journal_path(state_dir: Path) -> Path:
    return state_dir / JOURNAL_FILE


def _check_sqlite_header(path: Path) -> None:
    """Refuse a file that exists but is not SQLite: never recreate over it."""
    try:
        with open(path, "rb") as f:
            head = f.read(100)
    except OSError as e:
        raise JournalError(f"{path}: cannot read journal: {e.strerror}") from None
    if head and (len(head) < 100 or not head.startswith(b"SQLite format 3\x00")):
        raise JournalError(f"{path}: journal is not a valid SQLite database (truncated or overwritten); "
                           f"it was left in place: move it aside to start a new journal")


def _verify(con: sqlite3.Connection, path: Path) -> None:
    """A valid header is not enough: a damaged page would only fail later, in the
    middle of the loop. quick_check reads every page (O(size), once at start-up)."""
    problems = [r[0] for r in con.execute("PRAGMA quick_check(3)").fetchall()]
    if problems != ["ok"]:
        con.close()
        first = " ".join(str(problems[0]).split())[:120] if problems else "no result"
        raise JournalError(f"{path}: journal is damaged ({first}); it was left in place: "
                           f"move it aside to start a new journal")


def _connect(path: Path, readonly: bool, timeout: float) -> sqlite3.Connection:
    if readonly:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout,
                              isolation_level=None, check_same_thread=False)
    else:
        con = sqlite3.connect(str(path), timeout=timeout, isolation_level=None)
    con.row_factory = sqlite3.Row
    return con


class Journal:
    """A connection to the journal plus the transitions the ring makes."""

    def __init__(self, con: sqlite3.Connection, path: Path):
        self.con = con
        self.path = path

    # --- opening -------------------------------------------------------------
    @classmethod
    def open(cls, state_dir: Path, *, create: bool = True, busy_timeout: float = 10.0,
             verify: bool = False) -> "Journal":
        """Open for writing (the driver, the reaper, operator commands). ``verify``
        (the driver at start-up): refuse a damaged database (``PRAGMA quick_check``)
        before writing anything to it."""
        path = journal_path(state_dir)
        if path.exists() or path.is_symlink():
            if path.is_symlink():
                raise JournalError(f"{path}: journal is a symbolic link; refusing to follow it")
            _check_sqlite_header(path)
        elif not create:
            raise JournalError(f"{path}: no journal (has the driver ever run here?)")
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.fchmod(fd, 0o600)
            os.close(fd)
        try:
            con = _connect(path, readonly=False, timeout=busy_timeout)
            if verify:
                _verify(con, path)
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=FULL")
            con.execute("PRAGMA foreign_keys=ON")
            j = cls(con, path)
            j._migrate()
        except sqlite3.DatabaseError as e:
            raise JournalError(f"{path}: journal is not usable: {e}") from None
        for suffix in ("-wal", "-shm"):
            try:
                os.chmod(f"{path}{suffix}", 0o600)
            except OSError:
                pass
        return j

    @classmethod
    def open_readonly(cls, state_dir: Path, busy_timeout: float = 5.0) -> "Journal":
        """Open for reading only (status, history): never creates anything."""
        path = journal_path(state_dir)
        if not path.exists():
            raise JournalError(f"{path}: no journal (has the driver ever run here?)")
        _check_sqlite_header(path)
        try:
            con = _connect(path, readonly=True, timeout=busy_timeout)
            con.execute("SELECT 1 FROM runs LIMIT 1").fetchall()
        except sqlite3.DatabaseError as e:
            raise JournalError(f"{path}: journal is not usable: {e}") from None
        return cls(con, path)

    def _migrate(self) -> None:
        # executescript commits any open transaction first, so the script carries its own.
        self.con.executescript(
            "BEGIN IMMEDIATE;" + SCHEMA +
            f"INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', '{SCHEMA_VERSION}');"
            "COMMIT;")

    def close(self) -> None:
        self.con.close()

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One short write transaction (BEGIN IMMEDIATE takes the write lock up front,
        so a busy database waits here instead of failing half-way)."""
        self.con.execute("BEGIN IMMEDIATE")
        try:
            yield self.con
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        else:
            self.con.execute("COMMIT")

    # --- events ----------------------------------------------------------------
    def _event(self, run_id: Optional[int], kind: str, source: str, detail: str = "",
               at: Optional[float] = None) -> None:
        self.con.execute("INSERT INTO events(at, run_id, kind, source, detail) VALUES (?, ?, ?, ?, ?)",
                         (at if at is not None else time.time(), run_id, kind, source, detail))

    def event(self, run_id: Optional[int], kind: str, source: str, detail: str = "") -> None:
        with self.write():
            self._event(run_id, kind, source, detail)

    # --- transitions -----------------------------------------------------------
    def start_run(self, agent: str, position: int, *, run_budget: float, stall_threshold: float,
                  driver_pid: int, driver_start: float, now: Optional[float] = None) -> int:
        """Write the ``running`` row before the process exists."""
        now = time.time() if now is None else now
        with self.write():
            cur = self.con.execute(
                "INSERT INTO runs(agent, position, status, started_at, run_budget, stall_threshold,"
                " driver_pid, driver_start) VALUES (?, ?, 'running', ?, ?, ?, ?, ?)",
                (agent, position, now, run_budget, stall_threshold, driver_pid, driver_start))
            run_id = cur.lastrowid
            self._event(run_id, "started", "driver", f"agent={agent}", at=now)
        return run_id

    def set_process(self, run_id: int, pid: int, pid_start: Optional[float], log_path: str) -> None:
        with self.write():
            self.con.execute("UPDATE runs SET pid = ?, pid_start = ?, log_path = ? WHERE id = ?",
                             (pid, pid_start, log_path, run_id))

    def set_log_path(self, run_id: int, log_path: str) -> None:
        with self.write():
            self.con.execute("UPDATE runs SET log_path = ? WHERE id = ?", (log_path, run_id))

    def close_run(self, run_id: int, status: str, *, source: str, exit_code: Optional[int] = None,
                  signal: Optional[int] = None, reason: Optional[str] = None,
                  now: Optional[float] = None,
                  settle: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None
                  ) -> Optional[Dict[str, Any]]:
        """Close a running row. Guarded: only if it is still ``running`` (a row an
        operator or the reaper closed meanwhile is never clobbered).

        ``settle(agent_state) -> fields`` computes the agent's new per-agent state;
        it is applied in the same transaction. Returns the agent's state after the
        close (with ``entered_quarantine``), or None if this call closed nothing."""
        assert status in TERMINAL, status
        now = time.time() if now is None else now
        with self.write():
            row = self.con.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None or row["status"] != "running":
                return None
            ended = max(now, row["started_at"])
            self.con.execute(
                "UPDATE runs SET status = ?, ended_at = ?, duration = ?, exit_code = ?, signal = ?,"
                " reason = ? WHERE id = ? AND status = 'running'",
                (status, ended, ended - row["started_at"], exit_code, signal, reason, run_id))
            detail = f"from=running to={status}"
            if reason:
                detail += f" reason={reason}"
            self._event(run_id, status, source, detail, at=ended)
            state = self.agent_state(row["agent"])
            fields = settle(state) if settle is not None else {}
            return self._settle(row["agent"], row["position"], state, fields, source, ended)

    def _settle(self, agent: str, position: Optional[int], before: Dict[str, Any],
                fields: Dict[str, Any], source: str, now: float) -> Dict[str, Any]:
        """Store new per-agent fields; an agent entering quarantine gets its one
        ``skipped`` row saying so (call inside a write transaction)."""
        self.update_agent(self.con, agent, **fields)
        after = {**before, **fields, "entered_quarantine": False}
        if fields.get("quarantined_until") is not None:
            until = datetime.fromtimestamp(fields["quarantined_until"], tz=timezone.utc).isoformat()
            reason = (f"quarantined until {until} after {after.get('bad_streak')} runs in a row "
                      f"ended stalled, timeout or interrupted")
            cur = self.con.execute(
                "INSERT INTO runs(agent, position, status, started_at, ended_at, duration, reason)"
                " VALUES (?, ?, 'skipped', ?, ?, 0, ?)", (agent, position, now, now, reason))
            self._event(cur.lastrowid, "quarantined", source, f"agent={agent} reason={reason}", at=now)
            after["entered_quarantine"] = True
        return after

    def record_skip(self, agent: str, position: int, reason: str, source: str,
                    now: Optional[float] = None, clear_skip_request: bool = False) -> int:
        """A turn not taken: a ``skipped`` row that never started a process."""
        now = time.time() if now is None else now
        with self.write():
            cur = self.con.execute(
                "INSERT INTO runs(agent, position, status, started_at, ended_at, duration, reason)"
                " VALUES (?, ?, 'skipped', ?, ?, 0, ?)", (agent, position, now, now, reason))
            run_id = cur.lastrowid
            self._event(run_id, "skipped", source, f"reason={reason}", at=now)
            if clear_skip_request:
                self.update_agent(self.con, agent, skip_requested=0)
        return run_id

    # --- reads -------------------------------------------------------------------
    def running_row(self) -> Optional[RunRow]:
        row = self.con.execute("SELECT * FROM runs WHERE status = 'running'").fetchone()
        return RunRow.from_row(row) if row else None

    def last_run(self) -> Optional[RunRow]:
        row = self.con.execute("SELECT * FROM runs ORDER BY id DESC LIMIT 1").fetchone()
        return RunRow.from_row(row) if row else None

    def run(self, run_id: int) -> Optional[RunRow]:
        row = self.con.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        return RunRow.from_row(row) if row else None

    def history(self, agent: Optional[str] = None, limit: int = 20) -> List[RunRow]:
        if agent is None:
            rows = self.con.execute("SELECT * FROM runs ORDER BY id DESC LIMIT ?", (limit,))
        else:
            rows = self.con.execute("SELECT * FROM runs WHERE agent = ? ORDER BY id DESC LIMIT ?",
                                    (agent, limit))
        return [RunRow.from_row(r) for r in rows.fetchall()]

    def last_run_of(self, agent: str) -> Optional[RunRow]:
        row = self.con.execute("SELECT * FROM runs WHERE agent = ? ORDER BY id DESC LIMIT 1",
                               (agent,)).fetchone()
        return RunRow.from_row(row) if row else None

    def agent_states(self) -> Dict[str, Dict[str, Any]]:
        return {r["name"]: dict(r) for r in self.con.execute("SELECT * FROM agents").fetchall()}

    def agent_state(self, name: str) -> Dict[str, Any]:
        row = self.con.execute("SELECT * FROM agents WHERE name = ?", (name,)).fetchone()
        if row:
            return dict(row)
        return {"name": name, "runs": 0, "last_run_id": None, "consecutive_failures": 0,
                "consecutive_deferrals": 0, "bad_streak": 0, "backoff_until": None,
                "skip_requested": 0, "quarantined_until": None, "quarantine_line": None}

    def run_counts(self) -> Dict[str, Dict[str, int]]:
        out: Dict[str, Dict[str, int]] = {}
        for r in self.con.execute("SELECT agent, status, n FROM run_counts"):
            out.setdefault(r["agent"], {})[r["status"]] = r["n"]
        return out

    def meta(self, key: str) -> Optional[str]:
        row = self.con.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row["value"] if row else None

    def start_ids_after(self, run_id: int) -> None:
        """Make the next run id greater than ``run_id`` (SQLite's AUTOINCREMENT
        counter): a journal started anew beside old run logs never reuses their ids."""
        try:
            with self.write():
                row = self.con.execute("SELECT seq FROM sqlite_sequence WHERE name = 'runs'").fetchone()
                if row is None:
                    self.con.execute("INSERT INTO sqlite_sequence(name, seq) VALUES ('runs', ?)", (run_id,))
                elif row[0] < run_id:
                    self.con.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'runs'", (run_id,))
        except sqlite3.DatabaseError as e:
            raise JournalError(f"{self.path}: journal is not usable: {e}") from None

    def set_meta(self, key: str, value: Optional[str]) -> None:
        with self.write():
            if value is None:
                self.con.execute("DELETE FROM meta WHERE key = ?", (key,))
            else:
                self.con.execute("INSERT INTO meta(key, value) VALUES (?, ?) "
                                 "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, value))

    # --- per-agent state -----------------------------------------------------------
    def update_agent(self, con: sqlite3.Connection, name: str, **fields: Any) -> None:
        """Upsert per-agent fields (call inside a write transaction)."""
        con.execute("INSERT INTO agents(name) VALUES (?) ON CONFLICT(name) DO NOTHING", (name,))
        if fields:
            sets = ", ".join(f"{k} = ?" for k in fields)
            con.execute(f"UPDATE agents SET {sets} WHERE name = ?", (*fields.values(), name))

    def set_agent(self, name: str, **fields: Any) -> None:
        with self.write():
            self.update_agent(self.con, name, **fields)

    def request_skip(self, name: str) -> None:
        """Operator: skip this agent's current run, or its next turn."""
        with self.write():
            self.update_agent(self.con, name, skip_requested=1)
            self._event(None, "skip-requested", "operator", f"agent={name}")
