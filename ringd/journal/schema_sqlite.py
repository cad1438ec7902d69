"""The SQLite journal's schema: the SPEC's invariants enforced by the database.

Status set and terminal coherence by CHECK constraints, at most one ``running``
row by a partial unique index, final statuses final and per-agent counters by
triggers. ``schema_pg`` is the same schema for PostgreSQL.
"""
import re
import sqlite3
from typing import Iterator, Optional

from ringd.core.records import SOURCES, STATUSES  # noqa: F401 - the journal's vocabulary, whatever the backend

SCHEMA_VERSION = 5   # 2: runs.phase; 3: runs.cpu_seconds; 4: quota_use, quota_spent;
                     # 5: events.agent/actor/reason, agents.last_ok_at/joined_at


def too_new(found: Optional[str]) -> Optional[str]:
    """Why a journal whose ``meta.schema_version`` is ``found`` must not be written
    by this ring (one line), or None. A newer ring's journal may hold columns,
    statuses or triggers this code does not know: writing it would mark it
    with our older version and record runs the newer ring's rules never saw."""
    found = None if found is None else str(found)
    if found is None or found == str(SCHEMA_VERSION):
        return None
    if found.isdecimal() and int(found) < SCHEMA_VERSION:
        return None   # an older ring's: upgraded in place
    return (f"journal schema version {found} is not one this ring knows (it writes {SCHEMA_VERSION}): "
            f"it was written by a newer ring; left as it was: run that ring, or move the journal aside")

_STATUS_LIST = ", ".join(f"'{s}'" for s in STATUSES)
_SOURCE_LIST = ", ".join(f"'{s}'" for s in SOURCES)

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT
);
CREATE TABLE IF NOT EXISTS runs (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    agent        TEXT NOT NULL,
    position     INTEGER,
    status       TEXT NOT NULL CHECK (status IN ({_STATUS_LIST})),
    started_at   REAL NOT NULL,
    ended_at     REAL,
    duration     REAL,
    exit_code    INTEGER,
    signal       INTEGER,
    reason       TEXT,
    pid          INTEGER,
    pid_start    REAL,
    run_budget   REAL,
    stall_threshold REAL,
    log_path     TEXT,
    driver_pid   INTEGER,
    driver_start REAL,
    phase        TEXT,              -- the agent's last STATUS= (see ringd.host.notify)
    cpu_seconds  REAL,              -- CPU time of the run's cgroup (ringd.host.cgroup); NULL when unknown
    CHECK (
        (status = 'running' AND ended_at IS NULL AND exit_code IS NULL
                            AND signal IS NULL AND duration IS NULL)
     OR (status <> 'running' AND ended_at IS NOT NULL AND duration IS NOT NULL
                             AND duration >= 0 AND ended_at >= started_at)
    )
);
CREATE UNIQUE INDEX IF NOT EXISTS runs_one_running ON runs(status) WHERE status = 'running';
CREATE INDEX IF NOT EXISTS runs_by_agent ON runs(agent, id);

CREATE TABLE IF NOT EXISTS events (
    id     INTEGER PRIMARY KEY AUTOINCREMENT,
    at     REAL NOT NULL,
    run_id INTEGER REFERENCES runs(id),
    kind   TEXT NOT NULL,
    source TEXT NOT NULL CHECK (source IN ({_SOURCE_LIST})),
    detail TEXT,
    agent  TEXT,                    -- the agent it concerns (NULL: the whole ring)
    actor  TEXT,                    -- who asked (JSON: ringd.cli.actor.who), for an operator's event
    reason TEXT                     -- the operator's --reason
);
CREATE INDEX IF NOT EXISTS events_by_run ON events(run_id);

-- Per-agent state the driver decides with and status shows. Survives restarts.
CREATE TABLE IF NOT EXISTS agents (
    name                  TEXT PRIMARY KEY,
    runs                  INTEGER NOT NULL DEFAULT 0 CHECK (runs >= 0),
    last_run_id           INTEGER,
    consecutive_failures  INTEGER NOT NULL DEFAULT 0 CHECK (consecutive_failures >= 0),
    consecutive_deferrals INTEGER NOT NULL DEFAULT 0 CHECK (consecutive_deferrals >= 0),
    bad_streak            INTEGER NOT NULL DEFAULT 0 CHECK (bad_streak >= 0),
    backoff_until         REAL,
    skip_requested        INTEGER NOT NULL DEFAULT 0 CHECK (skip_requested IN (0, 1)),
    quarantined_until     REAL,
    quarantine_line       TEXT,
    last_ok_at            REAL,     -- the end of its last ok run (kept by triggers)
    joined_at             REAL      -- when the driver first ran a roster holding it (NULL: not on it)
);

-- Finished runs by agent and status (metrics); kept by triggers, never by hand.
CREATE TABLE IF NOT EXISTS run_counts (
    agent  TEXT NOT NULL,
    status TEXT NOT NULL,
    n      INTEGER NOT NULL CHECK (n >= 0),
    PRIMARY KEY (agent, status)
);

CREATE TRIGGER IF NOT EXISTS runs_closed AFTER UPDATE OF status ON runs
WHEN OLD.status = 'running' AND NEW.status <> 'running'
BEGIN
    INSERT INTO run_counts(agent, status, n) VALUES (NEW.agent, NEW.status, 1)
        ON CONFLICT(agent, status) DO UPDATE SET n = n + 1;
    INSERT INTO agents(name, runs, last_run_id) VALUES (NEW.agent, 1, NEW.id)
        ON CONFLICT(name) DO UPDATE SET runs = runs + 1, last_run_id = NEW.id;
END;

CREATE TRIGGER IF NOT EXISTS runs_inserted_closed AFTER INSERT ON runs
WHEN NEW.status <> 'running'
BEGIN
    INSERT INTO run_counts(agent, status, n) VALUES (NEW.agent, NEW.status, 1)
        ON CONFLICT(agent, status) DO UPDATE SET n = n + 1;
    INSERT INTO agents(name, runs, last_run_id) VALUES (NEW.agent, 1, NEW.id)
        ON CONFLICT(name) DO UPDATE SET runs = runs + 1, last_run_id = NEW.id;
END;

-- What each run spent of each quota pool (its last report: units, and when),
-- kept with the run; retention keeps a run whose use is still inside a window.
CREATE TABLE IF NOT EXISTS quota_use (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    pool   TEXT NOT NULL,
    agent  TEXT NOT NULL,
    units  INTEGER NOT NULL CHECK (units >= 0),
    at     REAL NOT NULL,
    PRIMARY KEY (run_id, pool)
);
CREATE INDEX IF NOT EXISTS quota_use_by_pool ON quota_use(pool, at, units);
CREATE INDEX IF NOT EXISTS quota_use_by_time ON quota_use(at);

-- Units spent by pool and agent over the ring's life (metrics); kept by triggers.
CREATE TABLE IF NOT EXISTS quota_spent (
    pool  TEXT NOT NULL,
    agent TEXT NOT NULL,
    units INTEGER NOT NULL CHECK (units >= 0),
    PRIMARY KEY (pool, agent)
);

CREATE TRIGGER IF NOT EXISTS quota_use_added AFTER INSERT ON quota_use
BEGIN
    INSERT INTO quota_spent(pool, agent, units) VALUES (NEW.pool, NEW.agent, NEW.units)
        ON CONFLICT(pool, agent) DO UPDATE SET units = units + NEW.units;
END;

CREATE TRIGGER IF NOT EXISTS quota_use_changed AFTER UPDATE OF units ON quota_use
BEGIN
    UPDATE quota_spent SET units = max(0, units + NEW.units - OLD.units)
        WHERE pool = NEW.pool AND agent = NEW.agent;
END;

-- The end of each agent's last ok run (silence: ringd.core.silence), never scanned for.
CREATE TRIGGER IF NOT EXISTS runs_closed_ok AFTER UPDATE OF status ON runs
WHEN OLD.status = 'running' AND NEW.status = 'ok'
BEGIN
    INSERT INTO agents(name, last_ok_at) VALUES (NEW.agent, NEW.ended_at)
        ON CONFLICT(name) DO UPDATE SET last_ok_at = NEW.ended_at;
END;

CREATE TRIGGER IF NOT EXISTS runs_inserted_ok AFTER INSERT ON runs
WHEN NEW.status = 'ok'
BEGIN
    INSERT INTO agents(name, last_ok_at) VALUES (NEW.agent, NEW.ended_at)
        ON CONFLICT(name) DO UPDATE SET last_ok_at = NEW.ended_at;
END;

-- A terminal row never changes status again (a guarded close cannot clobber).
CREATE TRIGGER IF NOT EXISTS runs_terminal_is_final BEFORE UPDATE OF status ON runs
WHEN OLD.status <> 'running'
BEGIN
    SELECT RAISE(ABORT, 'a finished run cannot change status');
END;
"""

# Columns added after a journal may have been created: (table, column, type).
ADDED_COLUMNS = (("runs", "phase", "TEXT"), ("runs", "cpu_seconds", "REAL"),
                 ("events", "agent", "TEXT"), ("events", "actor", "TEXT"), ("events", "reason", "TEXT"),
                 ("agents", "last_ok_at", "REAL"), ("agents", "joined_at", "REAL"))

# Run once, when ``agents.last_ok_at`` is added to an older journal: each agent's
# last ok run as its history still holds it, and (it was on the roster then) its
# join, so a silence is counted from that ok run, not from the upgrade.
BACKFILL_LAST_OK = ("UPDATE agents SET last_ok_at = (SELECT max(ended_at) FROM runs"
                    " WHERE runs.agent = agents.name AND runs.status = 'ok');"
                    "UPDATE agents SET joined_at = last_ok_at;")

# Every table, index and trigger SCHEMA makes: a journal missing one (an older
# ring's, or one whose guard someone dropped) gets SCHEMA again.
SCHEMA_OBJECTS = frozenset(re.findall(r"CREATE (?:UNIQUE )?(?:TABLE|INDEX|TRIGGER) IF NOT EXISTS (\w+)", SCHEMA))


def statements(script: str) -> Iterator[str]:
    """The statements of a script one by one, for a transaction the caller holds
    (``executescript`` would commit it first). A trigger's body holds semicolons:
    SQLite itself says where a statement is complete."""
    pending = ""
    for piece in script.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \n;"):
                yield pending
            pending = ""
