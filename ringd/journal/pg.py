"""The journal in PostgreSQL (``ring.journal: "postgresql://..."``) and the SQL of
the lease: the ring that survives its box.

``PgJournal`` is the SQLite ``Journal`` with another connection under it: the
same transitions run as the same statements (translated at one choke point,
``_Con.execute``: ``?`` placeholders become ``%s``, an insert into ``runs`` or
``events`` returns its id), so the two backends cannot drift apart, and one
shared test suite holds both to the same behaviour. The schema is
``schema_pg``.

What PostgreSQL adds is the lease (decisions in ``lease``, pure): a leader's
every write transaction first checks, with the lease row share-locked, that the
lease is still its own, same epoch and not expired on the server's clock
(``Fenced`` otherwise). A standby taking over must lock that row for update,
so it waits for any such write in flight, and no write of the old epoch can
commit after the hand-over.

psycopg (v3) is imported here and nowhere else: ``import ringd`` and the
SQLite path never load it.
"""
from __future__ import annotations

import os
import re
import select
import sqlite3
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence

try:
    import psycopg
except ImportError:  # only this backend needs it: say how to get it, in one line
    psycopg = None

from ringd.core import lease as leaselib
from ringd.core.dsn import redact, scrub
from ringd.journal import pgcall
from ringd.journal import schema_pg
from ringd.host import sidethread
from ringd.journal.sqlite import Journal, JournalError
from ringd.journal.schema_pg import MIGRATION_LOCK, SCHEMA, SCHEMA_VERSION
from ringd.journal.schema_sqlite import too_new

# Client side: fail fast instead of hanging on a dead server or a partition
# (keepalives notice a silent peer, tcp_user_timeout unacknowledged data), and
# no call waits for an answer longer than its bound (``pgcall``: a stopped
# server process, a peer whose kernel still acknowledges, applies no timeout).
# Server side (per transaction, the same bound): no statement or lock wait of ours
# may outlast a fifth of the lease (one beat).
MAX_WAIT_MS = 2 ** 31 - 1
_BEGIN_RESULTS = 4   # what ``_Con._begin`` sends: BEGIN and three SET LOCALs, each with its result
_IDLE = 0            # libpq's PQTRANS_IDLE: no transaction open on the connection
CONNECT_ARGS = dict(keepalives=1, keepalives_idle=1, keepalives_interval=1, keepalives_count=2)


class PgJournalError(JournalError, sqlite3.OperationalError):
    """The database cannot be reached or refused a write: retrying later may work.
    ``sqlstate``: the server's error code, if it said one; ``dead``: the connection
    was lost with the call."""
    transient = True
    retry_until = "the database takes the write"
    sqlstate: Optional[str] = None
    dead = False


class PgIntegrityError(JournalError, sqlite3.IntegrityError):
    """A constraint of the schema refused a write (as sqlite3's would)."""
    transient = True


class Fenced(PgJournalError):
    """This driver's lease is gone (taken over, or expired): it records nothing more."""


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


_PLACEHOLDER = re.compile(r"\?")
_INSERT_WITH_ID = re.compile(r"^\s*INSERT\s+INTO\s+(runs|events)\b(?!.*\bRETURNING\b)", re.I | re.S)


def translate(sql: str) -> str:
    """sqlite3's dialect of our statements -> psycopg's (the only differences we use)."""
    sql = _PLACEHOLDER.sub("%s", sql.replace("%", "%%"))
    if _INSERT_WITH_ID.match(sql):
        sql += " RETURNING id"  # sqlite3's cursor.lastrowid
    return sql


class _Row:
    """A row that reads like ``sqlite3.Row``: by name, by index, ``keys()``, ``dict(row)``."""
    __slots__ = ("_names", "_values")

    def __init__(self, names: Sequence[str], values: Sequence[Any]):
        self._names, self._values = names, values

    def __getitem__(self, key):
        if isinstance(key, (int, slice)):
            return self._values[key]
        try:
            return self._values[self._names.index(key)]
        except ValueError:
            raise IndexError(f"no such column: {key}") from None

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def keys(self) -> List[str]:
        return list(self._names)


def _row_factory(cursor):
    names = [c.name for c in cursor.description or ()]
    return lambda values: _Row(names, values)


class _Cursor:
    def __init__(self, rows: List[_Row], lastrowid: Optional[int], rowcount: int):
        # sqlite3's cursor attributes (rowcount: batch deletes know when they are done)
        self._rows, self.lastrowid, self.rowcount = rows, lastrowid, rowcount

    def fetchone(self) -> Optional[_Row]:
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> List[_Row]:
        rows, self._rows = self._rows, []
        return rows

    def __iter__(self):
        return iter(self.fetchall())


if psycopg is not None:
    class _BoundConnection(psycopg.Connection):
        """psycopg's connection, but every wait for the server's answer is
        ``pgcall.wait``: bounded, and ended by a stop signal of the driver's."""
        ring_bound = float(MAX_WAIT_MS // 1000)   # (set by _Con.connect)
        ring_tap: Optional[pgcall.SignalTap] = None
        ring_stopping: Callable[[], bool] = staticmethod(lambda: False)

        def wait(self, gen, *args, **kwargs):   # (psycopg's own takes a poll interval and a timeout)
            return pgcall.wait(gen, self.pgconn.socket, self.ring_bound, self.ring_tap,
                               stopping=self.ring_stopping())


def _readable():
    """A wait (``pgcall.wait``) for its socket to be readable, and no more."""
    yield pgcall.READ


class _Connecting:
    """A new connection, made on a thread of its own. psycopg's connect waits in
    its own loop: each host, and each address of one, for libpq's
    connect_timeout, and the name lookups before (getaddrinfo) for as long as
    the resolver takes. No stop signal ends that wait, and a server that takes
    the connection but never answers held a reconnecting driver that long: no
    beat, no SIGTERM heard. Here the driver waits for the thread as for any
    call (``pgcall.wait`` on a pipe the thread writes to when done): within the
    call's bound, and a stop signal ends the wait. A connect that outlasts it
    goes on (at most one per ``_Con``) and the next call takes its result; one
    nobody wants any more (``abandon``) is closed by its thread once made, or
    by ``abandon`` itself if it was made already."""

    def __init__(self, dsn: str, kwargs: dict):
        self._r, self._w = os.pipe()   # (not inherited: an agent never gets them)
        self._lock = threading.Lock()
        self._result: Any = None       # the connection, or what psycopg raised
        self._finished = self._abandoned = False
        try:
            sidethread.start(self._connect, dsn, kwargs, name="pg-connect")
        except RuntimeError as e:   # no thread to be had (a process or memory limit): an outage
            os.close(self._r)
            os.close(self._w)
            raise psycopg.OperationalError(f"no thread to connect on: {e}") from None

    def fileno(self) -> int:
        return self._r

    def _connect(self, dsn: str, kwargs: dict) -> None:
        try:
            result: Any = _BoundConnection.connect(dsn, **kwargs)
        except BaseException as e:
            result = e
        with self._lock:
            self._result, self._finished = result, True
            if self._abandoned:
                self._dispose()
            else:
                os.write(self._w, b"!")

    def take(self):
        """The connection made (raises what psycopg raised). After the pipe said so."""
        with self._lock:
            os.close(self._r)
            os.close(self._w)
            if isinstance(self._result, BaseException):
                raise self._result
            return self._result

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            if self._finished:
                self._dispose()

    def _dispose(self) -> None:
        if isinstance(self._result, psycopg.Connection):
            self._result.close()
        os.close(self._r)
        os.close(self._w)


class _Con:
    """The slice of ``sqlite3.Connection`` the journal and its readers use, on psycopg.
    Autocommit: a statement outside ``write()`` is its own transaction. ``tap``:
    the driver's wake-up pipe, whose stop signals end a call in flight."""

    def __init__(self, dsn: str, readonly: bool, wait_limit: float, tap: Optional[pgcall.SignalTap] = None):
        self.dsn, self.readonly, self.tap = dsn, readonly, tap
        # (PostgreSQL's timeouts, and libpq's tcp_user_timeout, are ints of milliseconds)
        self.wait_ms = min(max(100, int(wait_limit * 1000)), MAX_WAIT_MS)
        self.pg = None
        self._connecting: Optional[_Connecting] = None   # a new connection still being made
        self.stopping: Callable[[], bool] = lambda: False   # is the driver stopping? (PgJournal.wait_busy_unless)
        try:
            self.connect()
        except BaseException:
            self.close()   # a connect still going on is nobody's else: its thread closes it
            raise

    def connect(self) -> None:
        try:
            if self._connecting is None:
                self._connecting = _Connecting(self.dsn, dict(
                    autocommit=True, row_factory=_row_factory,
                    connect_timeout=max(2, round(self.wait_ms / 1000)),
                    tcp_user_timeout=self.wait_ms,
                    application_name=f"ringd pid={os.getpid()}",  # which driver, in pg_stat_activity
                    **CONNECT_ARGS))
            # waited for like any call (bound, stop signal); one not made yet
            # goes on, and the next call takes it up
            pgcall.wait(_readable(), self._connecting.fileno(), self.wait_ms / 1000, self.tap,
                        stopping=self.stopping())
            connecting, self._connecting = self._connecting, None
            self.pg = connecting.take()
            self.pg.ring_bound, self.pg.ring_tap, self.pg.ring_stopping = self.wait_ms / 1000, self.tap, self.stopping
        except (psycopg.Error, pgcall.Abandoned) as e:
            self._drop()
            raise PgJournalError(f"{redact(self.dsn)}: cannot connect: {self._say(e)}") from None

    def _begin(self) -> str:
        """BEGIN with our settings scoped to its transaction: no session SET, which
        a transaction-mode pooler (pgbouncer) leaves on the server connection for
        its next client (a reader's read-only made the driver's writes fail).
        idle_in_transaction too: a leader frozen inside a transaction (SIGSTOP, a
        paused VM) holds the lease row's lock; the server ends its session, rolling
        the write back, so a hand-over is never held up past the TTL."""
        ms = self.wait_ms
        return (f"BEGIN{' READ ONLY' if self.readonly else ''}; SET LOCAL statement_timeout = {ms}; "
                f"SET LOCAL lock_timeout = {ms}; SET LOCAL idle_in_transaction_session_timeout = {ms}")

    def _trusted(self) -> bool:
        """Whether the idle connection may carry the next statement: one the
        server closed (idle_session_timeout, pg_terminate_backend, a restart)
        has said goodbye on its socket, which nothing else writes to while no
        statement of ours is in flight."""
        pg = self.pg
        if pg is None or pg.closed or pg.broken:
            return False
        poll = select.poll()
        poll.register(pg.pgconn.socket, select.POLLIN)
        return not poll.poll(0)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> _Cursor:
        word = sql.strip().upper()
        if word in ("COMMIT", "ROLLBACK"):
            if self.pg is None or self.pg.closed or self.pg.broken:
                self._drop()
                raise PgJournalError(f"{redact(self.dsn)}: connection lost in a transaction")
            return self._call(lambda: self._statement(word, ()))
        if self.pg is not None and not self.pg.closed and not self.pg.broken \
                and self.pg.pgconn.transaction_status != _IDLE:
            return self._call(lambda: self._statement(sql, params))
        # The start of a transaction, or a statement that is one: nothing of it has
        # run yet. A connection the server may have closed is checked first, and
        # one that dies at this first statement all the same is made again and the
        # statement sent once more: a dead connection is no verdict on anything.
        run = self._begin_now if word == "BEGIN" else (lambda: self._alone(sql, params))
        for attempt in (1, 2):
            if not self._trusted():
                self._drop()
                self.connect()
            try:
                return self._call(run)
            except PgJournalError as e:
                if attempt == 2 or not e.dead:
                    raise
        raise AssertionError("unreachable")

    def _begin_now(self) -> _Cursor:
        self.pg.execute(self._begin())
        return _Cursor([], None, -1)

    def _statement(self, sql: str, params: Sequence[Any]) -> _Cursor:
        cur = self.pg.execute(translate(sql), tuple(params), prepare=False)
        rows = cur.fetchall() if cur.description is not None else []
        lastrowid = rows[0][0] if rows and _INSERT_WITH_ID.match(sql) else None
        return _Cursor(rows, lastrowid, cur.rowcount)

    def _alone(self, sql: str, params: Sequence[Any]) -> _Cursor:
        """A statement outside ``write()``: its own transaction with our settings,
        in one round trip (the parameters bound on our side: psycopg's
        ClientCursor, so several statements go in one simple query)."""
        cur = psycopg.ClientCursor(self.pg)
        try:
            cur.execute(f"{self._begin()}; {cur.mogrify(translate(sql), tuple(params))}; COMMIT")
        except psycopg.Error:
            if not (self.pg.closed or self.pg.broken) and self.pg.pgconn.transaction_status != _IDLE:
                try:
                    self.pg.execute("ROLLBACK")   # the statement failed, the transaction it was in with it
                except psycopg.Error:
                    pass   # (the connection died: so did the transaction)
            raise
        for _ in range(_BEGIN_RESULTS):
            cur.nextset()
        rows = cur.fetchall() if cur.description is not None else []
        return _Cursor(rows, None, cur.rowcount)

    def _call(self, fn: Callable[[], _Cursor]) -> _Cursor:
        """``fn()`` with psycopg's failures as ours (``dead``: the connection went with it)."""
        try:
            return fn()
        except psycopg.IntegrityError as e:
            raise PgIntegrityError(self._say(e)) from None
        except psycopg.Error as e:
            err = PgJournalError(f"{redact(self.dsn)}: {self._say(e)}")
            err.sqlstate = e.sqlstate
            err.dead = self.pg is None or self.pg.closed or self.pg.broken
            raise err from None
        except pgcall.Abandoned as e:
            self._drop()   # its state is unknown: a new one for the next call
            raise PgJournalError(f"{redact(self.dsn)}: {e}") from None

    def script(self, sql: str) -> None:
        """Statements as written (no placeholders: the schema's DDL), in a transaction."""
        def run() -> _Cursor:
            self.pg.execute(sql)
            return _Cursor([], None, -1)
        self._call(run)

    def _drop(self) -> None:
        """Close the connection without a word to the server (libpq's goodbye is
        non-blocking: psycopg's connections are)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            pg.close()

    def close(self) -> None:
        if self._connecting is not None:
            self._connecting.abandon()
            self._connecting = None
        if self.pg is not None:
            self.pg.close()

    def _say(self, e: BaseException) -> str:
        """An error of psycopg's in one line, never with our password in it."""
        return scrub(_one_line(e), self.dsn)


# The lease's expiry as epoch seconds a date can hold: a row edited by hand may
# say 'infinity' or a year past 9999 (still the future) or '-infinity' (the past).
_EXPIRES_AT = ("extract(epoch FROM greatest(least(expires_at, '9999-12-31 UTC'::timestamptz),"
               " '1970-01-01 UTC'::timestamptz))::float8")


@dataclass
class Fence:
    """The lease this driver holds: checked by every one of its writes."""
    holder: str
    epoch: int
    expires_at: Optional[float] = None   # server epoch seconds, as its last take or renewal set it


# The server's words for a statement that names what the schema lacks (a table,
# a function dropped by hand): undefined_table, undefined_function, undefined_object.
MISSING_OBJECT = frozenset({"42P01", "42883", "42704"})


@dataclass(frozen=True)
class LeaseView:
    holder: Optional[str]
    epoch: int
    expires_at: Optional[float]   # server epoch seconds
    server_now: float


class PgJournal(Journal):
    """The journal on PostgreSQL. ``fence`` (set by ``acquire``) makes every write
    of this connection a fenced one."""

    def __init__(self, con: _Con, dsn: str):
        super().__init__(con, redact(dsn))  # type: ignore[arg-type]
        self.fence: Optional[Fence] = None
        self.recording = True   # False: a driver that is not (or no longer) the leader
        self.repaired: List[str] = []   # what of the schema a migration made again, not yet said
        self.ttl: Optional[float] = None   # the lease's (a writer's: it repairs the schema)
        self._repairing = False

    def wait_busy_unless(self, give_up) -> None:
        """Every call is bounded already, and a stop signal ends one in flight
        (pgcall's tap); once ``give_up()`` says the driver is stopping, each call
        has the stop's grace only (``pgcall.wait``'s ``stopping``)."""
        self.con.stopping = give_up
        if self.con.pg is not None:
            self.con.pg.ring_stopping = give_up

    def stop_recording(self) -> None:
        """Refuse every write from now on, before even asking the server, until
        this connection takes the lease again."""
        self.recording = False
        self.fence = None

    @classmethod
    def connect(cls, dsn: str, *, readonly: bool = False, ttl: float = 30,
                tap: Optional[pgcall.SignalTap] = None) -> "PgJournal":
        """``ttl`` (the lease's) bounds every wait on the server, on both sides
        (``pgcall.call_bound``): a leader blocked in a query must still reach its
        half-TTL switch in time, and beat. ``tap``: the driver's wake-up pipe
        (a stop signal ends a call in flight)."""
        if psycopg is None:
            raise JournalError("ring.journal names PostgreSQL, but psycopg is not installed: "
                               "pip install 'ring[pg]' (or psycopg[binary])")
        j = cls(_Con(dsn, readonly, wait_limit=pgcall.call_bound(ttl), tap=tap), dsn)
        if not readonly:
            j.ttl = ttl
            try:
                j._migrate(ttl)
            except JournalError:
                j.close()
                raise
        return j

    def _migrate(self, ttl: float) -> None:
        # Only when needed: the DDL (CREATE OR REPLACE TRIGGER) locks the runs
        # table, and a standby starting up must not stall the leader's writes.
        # Decided again under the migration lock: another ring may have upgraded
        # in between, and a newer ring's mark must never be overwritten with ours.
        if not self._schema_missing():
            return
        with self._transaction():
            self.con.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK,))
            missing = self._schema_missing()
            if not missing:
                return
            fresh = schema_pg.OBJECTS <= missing
            self.con.script(SCHEMA)
            if "lease" in missing and not fresh:
                # The lease table dropped under a ring: whoever led may still run its
                # agent (its renewals fail; it stops at its half-TTL switch). Made
                # again as the deleted row is (acquire): held by nobody for one TTL.
                self.con.execute("UPDATE lease SET holder = ?, expires_at = clock_timestamp()"
                                 " + make_interval(secs => ?) WHERE id = 1 AND holder IS NULL",
                                 (leaselib.NOBODY, ttl))
        if not fresh:   # (a new journal is no news)
            self.repaired = sorted(set(self.repaired) | (missing - {"version"}))

    def take_repaired(self) -> List[str]:
        """What of the schema was made again since last asked (to be said once)."""
        repaired, self.repaired = self.repaired, []
        return repaired

    def _repair_after(self, e: BaseException) -> None:
        """A statement failed on what the schema lacks (a table dropped under a
        running ring): make it again now, as at start-up (a writer only)."""
        if self.ttl is None or self._repairing or getattr(e, "sqlstate", None) not in MISSING_OBJECT:
            return
        self._repairing = True
        try:
            self._migrate(self.ttl)
        except JournalError:
            pass   # (the next failure tries again)
        finally:
            self._repairing = False

    def _schema_missing(self) -> frozenset:
        """What of this ring's schema the journal lacks ("version": its mark is
        not this ring's); raises for a newer ring's. (Asked without an error
        before the schema exists: one would abort the transaction it is asked in.)"""
        version = None
        if self.con.execute("SELECT to_regclass('meta') IS NOT NULL").fetchone()[0]:
            row = self.con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            version = None if row is None else str(row[0])
        reason = too_new(version)
        if reason:
            raise JournalError(f"{self.path}: {reason}")
        present = [r[0] for r in self.con.execute(schema_pg.PRESENT, schema_pg.PRESENT_PARAMS)]
        return schema_pg.missing(present) | (frozenset() if version == str(SCHEMA_VERSION) else {"version"})

    def close(self) -> None:
        self.con.close()

    def knows_quotas(self) -> bool:
        if self._knows_quotas is None:
            row = self.con.execute("SELECT to_regclass('quota_use') IS NOT NULL").fetchone()
            self._knows_quotas = bool(row[0])
        return self._knows_quotas

    def _columns(self, table: str) -> frozenset:
        """The columns ``table`` has, as its schema on search_path shows them."""
        return frozenset(r[0] for r in self.con.execute(
            "SELECT column_name::text FROM information_schema.columns"
            " WHERE table_schema = current_schema() AND table_name = ?", (table,)))

    @contextmanager
    def _transaction(self) -> Iterator[_Con]:
        self.con.execute("BEGIN")
        try:
            yield self.con
        except BaseException as e:
            try:
                self.con.execute("ROLLBACK")
            except JournalError:
                pass  # the connection died: so did the transaction
            self._repair_after(e)   # the caller tries again, as after any outage
            raise
        else:
            self.con.execute("COMMIT")

    @contextmanager
    def write(self, patient: bool = True) -> Iterator[_Con]:
        """One write transaction; a leader's is fenced by its lease. (``patient``:
        every call is bounded already, by pgcall.)"""
        if not self.recording:
            raise Fenced("not the leader: not recording")
        with self._transaction() as con:
            if self.fence is not None:
                row = con.execute(
                    "SELECT holder, epoch, expires_at > clock_timestamp() AS valid FROM lease WHERE id = 1"
                    " FOR SHARE").fetchone()
                if row is None or row["holder"] != self.fence.holder or row["epoch"] != self.fence.epoch \
                        or not row["valid"]:
                    raise Fenced(f"lease lost (epoch {self.fence.epoch} is no longer current): "
                                 f"not recording")
            yield con

    # --- the lease -------------------------------------------------------------------
    def read_lease(self) -> LeaseView:
        row = self.con.execute(
            f"SELECT holder, epoch, {_EXPIRES_AT} AS expires_at,"
            " extract(epoch FROM clock_timestamp())::float8 AS server_now FROM lease WHERE id = 1").fetchone()
        if row is None:
            now = self.con.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()[0]
            return LeaseView(None, 0, None, now)
        return LeaseView(row["holder"], row["epoch"], row["expires_at"], row["server_now"])

    def acquire(self, me: str, ttl: float) -> leaselib.Decision:
        """One beat of leadership: take, renew or wait (``lease.decide``), in one
        transaction holding the lease row. On TAKE or RENEW this connection's
        writes are fenced with the new epoch; on WAIT they are not fenced (a
        standby writes nothing of the ring). Raises on a database failure."""
        try:
            return self._acquire(me, ttl)
        except PgJournalError as e:
            if e.sqlstate not in MISSING_OBJECT:
                raise
        return self._acquire(me, ttl)   # the lease table was dropped: made again (_transaction), once more

    def _acquire(self, me: str, ttl: float) -> leaselib.Decision:
        mine = self.fence if self.fence is not None and self.fence.holder == me else None
        lock = (f"SELECT holder, epoch, {_EXPIRES_AT} AS expires_at,"
                " extract(epoch FROM clock_timestamp())::float8 AS server_now FROM lease WHERE id = 1"
                " FOR UPDATE")
        with self._transaction() as con:
            row = con.execute(lock).fetchone()
            if row is None:
                # Deleted by hand: whoever led may still run its agent. Made again as
                # held by nobody for one TTL: that leader, its lease still good on the
                # server's clock, takes it at once (lease.decide); any other driver
                # waits out the TTL, so no two lead.
                con.execute("INSERT INTO lease (id, holder, epoch, expires_at) VALUES"
                            " (1, ?, 0, clock_timestamp() + make_interval(secs => ?)) ON CONFLICT (id) DO NOTHING",
                            (leaselib.NOBODY, ttl))
                row = con.execute(lock).fetchone()
            now = row["server_now"]
            d = leaselib.decide(leaselib.LeaseRow(row["holder"], row["epoch"], row["expires_at"]),
                                me, mine.epoch if mine else None, now, mine.expires_at if mine else None)
            expires = None
            if d.action == leaselib.TAKE:
                expires = con.execute(
                    "UPDATE lease SET holder = ?, epoch = ?, acquired_at = clock_timestamp(),"
                    f" expires_at = clock_timestamp() + make_interval(secs => ?) WHERE id = 1 RETURNING {_EXPIRES_AT}",
                    (me, d.epoch, ttl)).fetchone()[0]
            elif d.action == leaselib.RENEW:
                expires = con.execute(
                    "UPDATE lease SET expires_at = clock_timestamp() + make_interval(secs => ?)"
                    f" WHERE id = 1 RETURNING {_EXPIRES_AT}", (ttl,)).fetchone()[0]
        if d.action == leaselib.WAIT:
            self.stop_recording()
        else:
            self.fence, self.recording = Fence(me, d.epoch, expires), True
        return d

    def release(self) -> None:
        """A clean stop hands the lease on at once (a standby need not wait for it
        to expire). Only our own epoch is released."""
        if self.fence is None:
            return
        with self._transaction() as con:
            con.execute("UPDATE lease SET holder = NULL, expires_at = clock_timestamp() "
                        "WHERE id = 1 AND holder = ? AND epoch = ?", (self.fence.holder, self.fence.epoch))
        self.fence = None
