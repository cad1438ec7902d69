"""The journal: one SQLite file that records every run truthfully.

This module is the only writer of the schema. The schema itself enforces the
SPEC's invariants (status set, terminal coherence, at most one ``running`` row)
with CHECK constraints and a partial unique index; triggers keep per-agent
counters in step with the runs so readers never scan history.

The interface is backend-neutral (a PostgreSQL journal offers the same): callers
see :class:`RunRow`/:class:`AgentState` values and one error type,
:class:`JournalError`, never a driver's own types. Writes happen in
``with journal.transaction() as tx:`` (``BEGIN IMMEDIATE``: the write lock is
taken up front), where callers read, decide (with :mod:`ringd.core.policy`) and
write in one atomic step; the journal itself decides nothing.
"""
from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import struct
import stat
import time
from collections.abc import Set
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ringd.host import safefile
from ringd.core import walfate
from ringd.core.quota import Exhausted, Use
from ringd.core.records import TERMINAL, AgentState, Controls, EventRow, RunRow, count, number, text
from ringd.journal.schema_sqlite import (ADDED_COLUMNS, BACKFILL_LAST_OK, SCHEMA, SCHEMA_OBJECTS, SCHEMA_VERSION,
                                         statements, too_new)

__all__ = ["Journal", "JournalError", "Tx", "RunRow", "AgentState", "TERMINAL", "journal_path"]

JOURNAL_FILE = "journal.db"
PAUSE_KEY = "paused"       # meta: "paused" pauses the ring, "paused:NAME" one agent
NEXT_KEY = "next"          # meta: the agent an operator asked to take the next turn
ALERTED_KEY = "alerted"    # meta: "alerted:silent:NAME" etc., the start of a silence or pause alerted on
EVENTS_PER_INSERT = 100    # rows per INSERT of a transaction's events (well under SQLite's variable limit)
PRUNE_BATCH = 500          # runs deleted per hop at most (benchmarks/bench_retention.py: a few ms)
BUSY_STEP = 0.1            # s; a writer that may give up waits for a busy write lock in steps this long
BUSY_TIMEOUT = 10.0        # s; a writer's wait for another process's write lock (Journal.open)
QUOTA_KEY = "quota:"       # meta: "quota:POOL" holds the pool's last exhausted report (JSON: at, until)
# The runs a retention batch deletes: the oldest finished ones before the first kept id,
# but for those whose use of a quota is still inside a window (spent after the second bound)
_PRUNED = ("SELECT id FROM runs WHERE id < ? AND status <> 'running'"
           " AND id NOT IN (SELECT run_id FROM quota_use WHERE at > ?) ORDER BY id LIMIT ?")
NO_USE_KEPT = 1e300        # (a bound no use is spent after: keep none for its quota)


def _at_once() -> bool:
    return True

class JournalError(Exception):
    """The journal cannot do what was asked. Message is one line.

    ``transient``: the journal is fine but could not be written now (state dir
    full or read-only, busy): retrying later may succeed. Otherwise the journal
    itself is unusable (damaged, not a database) and retrying is pointless.
    ``busy``: transient because another process holds the write lock, which it
    lets go of (a wait that ends by itself)."""

    transient = False
    busy = False

    def __init__(self, message: str, transient: Optional[bool] = None, busy: bool = False):
        super().__init__(message)
        if transient is not None:
            self.transient = transient
        self.busy = busy


def _wrap(path: Path, e: sqlite3.Error) -> JournalError:
    if isinstance(e, JournalError):   # a backend's own error (PostgreSQL) is already ours
        return e
    busy = _busy(path, e)
    if busy is not None:
        return busy
    transient = isinstance(e, (sqlite3.OperationalError, sqlite3.IntegrityError))
    return JournalError(f"{path}: {' '.join(str(e).split())[:200]}", transient=transient)


# SQLite's words for a journal that is fine but cannot be written now (retrying may succeed)
_BUSY = ("database is locked", "database is busy")
_NOT_NOW = ("database or disk is full", "attempt to write a readonly database", "unable to open database file",
            "disk I/O error")


def _busy(path: Path, e: sqlite3.Error) -> Optional[JournalError]:
    """Another process's write transaction outlasted the busy timeout: at an
    open or at a write, the same transient error, never a damaged journal."""
    text = str(e)
    if isinstance(e, sqlite3.OperationalError) and text.startswith(_BUSY):
        return JournalError(f"{path}: journal is busy: another process holds its write lock ({text}); "
                            f"try again", transient=True, busy=True)
    return None


def _unusable(path: Path, e: sqlite3.Error) -> JournalError:
    """Why a journal could not be opened: busy (another process's write
    transaction outlasted the busy timeout), or not writable now (state dir full
    or read-only) - both transient, no damage - or not usable."""
    text = str(e)
    busy = _busy(path, e)
    if busy is not None:
        return busy
    if isinstance(e, sqlite3.OperationalError) and text.startswith(_NOT_NOW):
        return JournalError(f"{path}: journal cannot be written now: {text}", transient=True)
    return JournalError(f"{path}: journal is not usable: {text}")


def journal_path(state_dir: Path) -> Path:
    return state_dir / JOURNAL_FILE


def _check_sqlite_header(path: Path) -> None:
    """Refuse a file that exists but is not SQLite: never recreate over it.
    A FIFO planted as the journal is refused, never waited on (an open of a FIFO
    blocks until a writer comes, and a signal does not end it: the driver and
    every operator command would hang deaf): safefile.open_regular."""
    try:
        with os.fdopen(safefile.open_regular(path), "rb") as f:
            head = f.read(100)
    except safefile.NotRegularFile as e:
        raise JournalError(f"{path}: journal is {e.strerror}; it was left in place: "
                           f"move it aside to start a new journal") from None
    except OSError as e:
        raise JournalError(f"{path}: cannot read journal: {e.strerror}") from None
    if head and (len(head) < 100 or not head.startswith(b"SQLite format 3\x00")):
        raise JournalError(f"{path}: journal is not a valid SQLite database (truncated or overwritten); "
                           f"it was left in place: move it aside to start a new journal")


def _check_companions(path: Path) -> None:
    """SQLite's -wal and -shm beside the journal, when there, must be regular
    files: a FIFO, a directory or a symbolic link there fails the journal's
    opens and writes as "disk I/O error" or "unable to open database file" -
    an outage's words (exit 69, the driver started again and again) for what
    no wait mends. Nor a hard link: SQLite run as root opens them by name,
    chowns them to the journal's owner and writes them, so one linked by the
    ring's user to a file of root's gave that file away to ``sudo ringd
    status``. Refused, naming the file, and left in place."""
    for suffix in ("-wal", "-shm"):
        name = f"{path}{suffix}"
        try:
            st = os.lstat(name)
        except OSError:
            continue
        mode = st.st_mode
        if not stat.S_ISREG(mode) or st.st_nlink != 1:
            what = ("a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode)
                    else "not a regular file" if not stat.S_ISREG(mode)
                    else f"a hard link ({st.st_nlink} links)")
            raise JournalError(f"{name}: the journal's {suffix[1:]} file is {what}; it was left in place: "
                               f"move it aside")


def _lock_table() -> Optional[str]:
    """The kernel's table of file locks (Linux), or None."""
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _lock_id(st: os.stat_result) -> Tuple[int, int, int]:
    """A file as /proc/locks names it: its device's major and minor, and its inode."""
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def _companions_unshared(path: Path) -> Optional[str]:
    """Why a connection opened now would not share the log of the processes that
    have the journal open (None: it would, or the lock table cannot tell).
    Every connection in WAL mode holds a read lock on the journal's shared
    range and on the dead-man byte of its -shm while open: one that holds the
    first but not the second at the path writes a log whose files were
    removed (``rm journal.db-wal journal.db-shm``). A connection opened then
    makes a new -wal and -shm - a second log: each one's commits unseen by the
    other (an operator's pause silently lost), and a checkpoint of one under
    the other's frames malforms journal.db. A reader makes them too, and
    leaves them, so the next writer would see nothing amiss. Read from
    /proc/locks, never by a lock call: closing a descriptor of the file would
    drop every lock this process's own connections hold on it."""
    try:
        db_id = _lock_id(os.stat(path, follow_symlinks=False))
    except OSError:
        return None
    table = _lock_table()
    if table is None:
        return None
    me = os.getpid()
    holders = walfate.lock_holders(table, db_id, SHARED_FIRST, SHARED_FIRST + SHARED_SIZE - 1)
    if not holders or holders == {me}:
        return None   # (the common case of a ring at rest, and a pid the table cannot name)
    have = [os.path.lexists(f"{path}{suffix}") for suffix in ("-wal", "-shm")]
    if not all(have):
        missing = " and ".join(s for s, h in zip(("-wal", "-shm"), have) if not h)
        return (f"{path}: its {missing} missing while another process has the journal open (removed under "
                f"the driver?); the driver takes the journal up again at its next beat: try again")
    try:
        shm_id = _lock_id(os.stat(f"{path}-shm", follow_symlinks=False))
    except OSError:
        return None
    others = walfate.strangers(holders, walfate.lock_holders(table, shm_id, SHM_DMS_BYTE, SHM_DMS_BYTE), [me])
    if not others:
        return None
    return (f"{path}: another process (pid {', '.join(str(p) for p in sorted(others))}) writes a -wal and -shm "
            f"no longer at the journal's path (removed under the driver?); the driver takes the journal up "
            f"again at its next beat: try again")


def _await_companions(path: Path, end: float, give_up: Optional[Callable[[], bool]],
                      nudge: Optional[Callable[[], object]]) -> None:
    """Wait, in short steps until ``end`` (monotonic) or ``give_up()``, for the
    journal's -wal and -shm at its path to be those its open connections share
    (:func:`_companions_unshared`); then refused as busy (transient) - never a
    connection that would begin a second log. ``nudge``: called once if it
    waits (an operator command wakes the driver, which then takes the journal
    up at once instead of at its next beat)."""
    reason = _companions_unshared(path)
    while reason is not None:
        if nudge is not None:
            with suppress(Exception):   # (best effort: the driver's next beat does it too)
                nudge()
            nudge = None
        if time.monotonic() >= end or (give_up is not None and give_up()):
            raise JournalError(reason, transient=True, busy=True)
        time.sleep(ORPHAN_WAIT_STEP)
        reason = _companions_unshared(path)


def no_schema_yet(path: Path) -> bool:
    """A journal with no table at all is one the first driver is creating (0
    bytes, then a header, then its schema in one transaction), or an empty file
    SQLite and the driver take as a new database: the ring never ran, not an
    unusable journal (``ringd status`` said exit 4 "no such table: runs"
    meanwhile). Read-only."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):   # (a FIFO is 0 bytes long too: refused, never opened)
            return False
        if st.st_size == 0:
            return True
        _check_companions(path)   # (SQLite opens them too)
        if _companions_unshared(path) is not None:
            return False   # (a reader now would begin a second log: _companions_unshared)
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1.0)
        try:
            return con.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0
        finally:
            con.close()
    except (OSError, sqlite3.Error, JournalError):
        return False


VERIFY_ALL_BYTES = 8 * 2 ** 20   # quick_check of this much takes ~0.1 s; beyond, start-up stays O(1)
# Above that size, the pages the driver reads first (and keeps reading) are read now.
_VERIFY_HOT = ("SELECT * FROM sqlite_master", "SELECT * FROM meta", "SELECT * FROM agents",
               "SELECT * FROM run_counts", "SELECT * FROM runs WHERE status = 'running'",
               "SELECT * FROM runs ORDER BY id DESC LIMIT 2000",
               "SELECT * FROM events ORDER BY id DESC LIMIT 4000")


def _verify(con: sqlite3.Connection, path: Path) -> None:
    """A valid header is not enough: a damaged page would only fail later, in the
    middle of the loop. quick_check reads every page of a journal up to
    VERIFY_ALL_BYTES; a larger one (ring.keep_runs: 0, or a backlog not yet
    pruned) has its hot pages read, so start-up stays fast whatever the size
    (benchmarks/bench_retention.py). Damage in old history then surfaces when
    retention reaches it, as a logged journal error, never a wrong run."""
    if path.stat().st_size <= VERIFY_ALL_BYTES:
        problems = [r[0] for r in con.execute("PRAGMA quick_check(3)").fetchall()]
    else:
        problems = ["ok"]
        try:
            for query in _VERIFY_HOT:
                con.execute(query).fetchall()
        except sqlite3.DatabaseError as e:
            problems = [str(e)]
    if problems != ["ok"]:
        con.close()
        first = " ".join(str(problems[0]).split())[:120] if problems else "no result"
        raise JournalError(f"{path}: journal is damaged ({first}); it was left in place: "
                           f"move it aside to start a new journal")


def _give_to_ring_owner(fd: int, path: Path) -> None:
    """A journal root made in another user's state dir (``sudo ringd pause`` on
    a ring that never ran) is that user's: root's, 0600, it locked the ring's
    own driver out of its journal. (SQLite run as root gives -wal and -shm the
    journal's owner.)"""
    if os.geteuid() != 0:
        return
    owner = os.stat(path.parent)
    if owner.st_uid != 0:
        os.fchown(fd, owner.st_uid, owner.st_gid)


WAL_HEADER, WAL_FRAME_HEADER = 32, 24   # bytes (SQLite's WAL file format)
# SQLite's lock bytes in the database file (its unix VFS): a connection takes a
# read lock on PENDING_BYTE to get its shared lock, then holds a read lock in
# the shared range for as long as it is open in WAL mode.
PENDING_BYTE = 0x40000000
SHARED_FIRST, SHARED_SIZE = PENDING_BYTE + 2, 510
ORPHAN_CLOSE_WAIT = 0.5   # s the close of an orphaned connection waits for other connections to end
ORPHAN_WAIT_STEP = 0.05   # s between two looks of an opener waiting for the journal's log to be whole again
SHM_DMS_BYTE = 128        # SQLite's unix VFS: the -shm's "dead-man switch", read-locked by every connection on it
WAL_SLACK_FRAMES = 16                    # the commit that crosses wal_autocheckpoint, and then some


def _extend_with_zeros(fd: int, size: int, chunk: int = 1 << 18) -> None:
    """Write zeros from the end of the regular file ``fd`` to ``size`` and
    fdatasync; on any error cut the file back to where it ended."""
    end = os.fstat(fd).st_size
    if end >= size:
        return
    zeros = bytes(min(chunk, size - end))
    try:
        at = end
        while at < size:
            at += os.pwrite(fd, zeros[:size - at], at)
        os.fdatasync(fd)
    except OSError:
        try:
            os.ftruncate(fd, end)
        except OSError:
            pass


def _connect(path: Path, readonly: bool, timeout: float) -> sqlite3.Connection:
    if readonly:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout,
                              isolation_level=None, check_same_thread=False)
    else:
        con = sqlite3.connect(str(path), timeout=timeout, isolation_level=None)
    con.row_factory = sqlite3.Row
    # A TEXT value as the UTF-8 it spells, a stray byte U+FFFD (records.text, the
    # rule for a blob too). SQLite stores what it is given (``CAST(X'ff' AS
    # TEXT)``, a reason written by another program): with sqlite3's strict
    # decoding one such byte in an old run's reason made every read of its row
    # fail - the driver exited 69 at start-up (and again at every restart),
    # ``status`` said 'unknown' and ``history`` nothing.
    con.text_factory = text
    return con


def _set_up(con: sqlite3.Connection) -> None:
    """A writer's settings: the write-ahead log, commits on disk, foreign keys."""
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=FULL")
    con.execute("PRAGMA foreign_keys=ON")


def _identities(paths) -> Dict[str, Tuple[int, int]]:
    """(device, inode) of each of ``paths`` that exists (a symlink's own)."""
    out = {}
    for name in paths:
        with suppress(OSError):
            st = os.stat(name, follow_symlinks=False)
            out[name] = (st.st_dev, st.st_ino)
    return out


def _lock_range(fd: int, cmd: int, kind: int, start: int, length: int) -> int:
    """fcntl(2) lock call on a range of ``fd``; returns the l_type it reports."""
    flock = struct.pack("hhqqi", kind, os.SEEK_SET, start, length, 0)
    return struct.unpack("hhqqi", fcntl.fcntl(fd, cmd, flock))[0]


def _hold_pending(fd: int, deadline: float) -> Optional[bool]:
    """Hold SQLite's pending byte of the database ``fd`` with an open file
    description lock (it conflicts with the POSIX locks SQLite takes, this
    process's too, so no connection starts while it is held), at a moment no
    other process has the database open, waiting for one until ``deadline`` in
    short steps. True: held, no other connection; False: held, another
    connection open all along; None: not held (or no such locks here)."""
    ofd_setlk = getattr(fcntl, "F_OFD_SETLK", None)
    if ofd_setlk is None:
        return None
    while True:
        try:
            _lock_range(fd, ofd_setlk, fcntl.F_WRLCK, PENDING_BYTE, 1)
            got = True
        except OSError:
            got = False   # (a connection is taking its shared lock right now)
        if got and _lock_range(fd, fcntl.F_GETLK, fcntl.F_WRLCK, SHARED_FIRST, SHARED_SIZE) == fcntl.F_UNLCK:
            return True   # (F_GETLK reports other processes' locks only)
        if time.monotonic() >= deadline:
            return False if got else None
        if got:
            _lock_range(fd, ofd_setlk, fcntl.F_UNLCK, PENDING_BYTE, 1)
        time.sleep(0.01)


def _new_log_has_commits(path: Path, ours: Dict[str, Tuple[int, int]]) -> bool:
    """Is there a -wal at ``path``'s name, not ``ours``, longer than its header:
    begun by another process after ours was removed (a shorter one holds no
    frame)? A new -shm is no matter: the next first connection builds the
    index again."""
    name = f"{path}-wal"
    try:
        st = os.stat(name, follow_symlinks=False)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return (st.st_dev, st.st_ino) != ours.get(name) and st.st_size > WAL_HEADER


def _new_files(path: Path, ours: Dict[str, Tuple[int, int]]) -> bool:
    """Is a -wal or -shm at ``path``'s name not ``ours`` (another process began
    a log there, or left the files of one)?"""
    now = _identities(f"{path}{suffix}" for suffix in ("-wal", "-shm"))
    return any(identity != ours.get(name) for name, identity in now.items())


def _closed() -> sqlite3.Connection:
    """A closed connection: what a Journal holds after a failed reconnect (its
    next read or write connects again first: Journal.take_up_companions)."""
    con = sqlite3.connect(":memory:")
    con.close()
    return con


def actor_of(value: Any) -> Optional[dict]:
    """An event's ``actor`` column as the mapping written (ringd.cli.actor.who);
    None for none, or for anything that is not a JSON object."""
    value = text(value)
    if not value:
        return None
    try:
        actor = json.loads(value)
    except ValueError:
        return None
    return actor if isinstance(actor, dict) else None


def _float_or(value: Any, default: float) -> float:
    """A time kept in ``meta`` as text (``repr`` of epoch seconds), else ``default``."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        return default
    return f if f == f and abs(f) != float("inf") else default


def pause_key(name: Optional[str]) -> str:
    """The ``meta`` key of an operator's pause: the ring's (None) or one agent's."""
    return PAUSE_KEY if name is None else f"{PAUSE_KEY}:{name}"


def _units(value) -> int:
    """Units read from the journal: a whole number that is not negative, else 0
    (PostgreSQL's sums are numeric)."""
    try:
        n = int(value) if value is not None and not isinstance(value, (bool, str, bytes)) else 0
    except (ValueError, OverflowError, TypeError):
        return 0
    return n if n >= 0 else 0


def _exhausted(value) -> Optional[Exhausted]:
    """A pool's exhausted report as ``meta`` keeps it (JSON: at, until), or None."""
    import json
    try:
        data = json.loads(text(value) or "")
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    at, until = number(data.get("at")), number(data.get("until"))
    return None if at is None or until is None else Exhausted(at, until)


class PausedAgents(Set):
    """The agents an operator paused (``ringd pause NAME``), as a turn reads them
    inside its transaction: each agent looked up (one index search of ``meta``)
    the first time the turn asks about it, so a turn costs the agents it walks,
    never one read of every paused agent. Iterated, it reads them all."""

    def __init__(self, tx: "Tx", known: Dict[str, bool]):
        self._tx, self._known = tx, known
        self._all: Optional[frozenset] = None

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        found = self._known.get(name)
        if found is None:
            found = self._known[name] = self._tx.meta(pause_key(name)) is not None
        return found

    def _every(self) -> frozenset:
        if self._all is None:
            self._all = self._tx.controls().paused
        return self._all

    def __iter__(self) -> Iterator[str]:
        return iter(self._every())

    def __len__(self) -> int:
        return len(self._every())


class Tx:
    """One transaction on the journal: reads and writes that commit together."""

    def __init__(self, con: sqlite3.Connection):
        self.con = con
        self._events: List[tuple] = []   # written together as the transaction ends (flush_events)

    def _x(self, sql: str, params: tuple = ()) -> sqlite3.Cursor:
        return self.con.execute(sql, params)

    # --- reads ---------------------------------------------------------------
    def running_row(self) -> Optional[RunRow]:
        row = self._x("SELECT * FROM runs WHERE status = 'running'").fetchone()
        return RunRow.from_mapping(row) if row else None

    def run(self, run_id: int) -> Optional[RunRow]:
        row = self._x("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        return RunRow.from_mapping(row) if row else None

    def last_run(self) -> Optional[RunRow]:
        row = self._x("SELECT * FROM runs ORDER BY id DESC LIMIT 1").fetchone()
        return RunRow.from_mapping(row) if row else None

    def agent(self, name: str) -> AgentState:
        row = self._x("SELECT * FROM agents WHERE name = ?", (name,)).fetchone()
        return AgentState.from_mapping(row) if row else AgentState(name=name)

    def agents(self) -> Dict[str, AgentState]:
        return {r["name"]: AgentState.from_mapping(r) for r in self._x("SELECT * FROM agents")}

    def meta(self, key: str) -> Optional[str]:
        row = self._x("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row["value"] if row else None

    def controls(self, first: Optional[str] = None) -> Controls:
        """The operator's controls, in one read (the driver reads them every turn).
        ``first`` (the driver: the agent whose turn it is): the agents an operator
        paused are looked up one by one as the turn asks (:class:`PausedAgents`),
        ``first`` in this read - never every paused agent at every turn (5,000
        of them cost each turn 5 ms)."""
        if first is not None:
            key = pause_key(first)
            rows = self._x("SELECT key, value FROM meta WHERE key IN (?, ?, ?)",
                           (PAUSE_KEY, NEXT_KEY, key)).fetchall()
            keys = {r["key"]: r["value"] for r in rows}
            return Controls(ring_paused=PAUSE_KEY in keys, paused=PausedAgents(self, {first: key in keys}),
                            next=keys.get(NEXT_KEY))
        # "paused:NAME" keys as a range of the primary key (':' + 1 is ';'): an
        # index search, where LIKE scanned the table, case-insensitively
        rows = self._x("SELECT key, value FROM meta WHERE key = ? OR key = ? OR (key > ? AND key < ?)",
                       (PAUSE_KEY, NEXT_KEY, PAUSE_KEY + ":", PAUSE_KEY + ";")).fetchall()
        keys = {r["key"]: r["value"] for r in rows}
        return Controls(ring_paused=PAUSE_KEY in keys,
                        paused=frozenset(k.split(":", 1)[1] for k in keys if k.startswith(PAUSE_KEY + ":")),
                        next=keys.get(NEXT_KEY))

    # --- quotas (SPEC "Agents on a shared quota") ---------------------------------------
    def quota_use(self, windows: Mapping[str, float], now: float
                  ) -> Tuple[Dict[str, List[Use]], Dict[str, List[Exhausted]]]:
        """In one statement: each pool's use inside its window (``windows``: pool
        -> seconds) as one ``(oldest, total)`` pair (ringd.core.quota takes it
        so), and every pool's last exhausted report."""
        where = " OR ".join("(pool = ? AND at > ?)" for _ in windows)
        args: List[object] = [v for pool, window in windows.items() for v in (pool, now - window)]
        sql = (f"SELECT pool AS k, min(at) AS a, CAST(sum(units) AS BIGINT) AS u, NULL AS v FROM quota_use"
               f" WHERE {where} GROUP BY pool UNION ALL " if windows else "")
        sql += "SELECT key, NULL, NULL, value FROM meta WHERE key > ? AND key < ?"
        args += [QUOTA_KEY, QUOTA_KEY[:-1] + ";"]
        uses: Dict[str, List[Use]] = {}
        exhausted: Dict[str, List[Exhausted]] = {}
        for k, at, units, value in self._x(sql, tuple(args)).fetchall():
            k = text(k) or ""
            if k.startswith(QUOTA_KEY):
                e = _exhausted(value)
                if e is not None:
                    exhausted[k[len(QUOTA_KEY):]] = [e]
            elif number(at) is not None:
                uses[k] = [(number(at), _units(units))]
        return uses, exhausted

    def put_use(self, run_id: int, pool: str, agent: str, units: int, at: float) -> None:
        """A run's use of ``pool`` so far (its last report wins)."""
        self._x("INSERT INTO quota_use(run_id, pool, agent, units, at) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT(run_id, pool) DO UPDATE SET units = excluded.units, at = excluded.at",
                (run_id, pool, agent, units, at))

    def set_exhausted(self, pool: str, report: Exhausted) -> None:
        """``pool`` refused until ``report.until`` (the latest report wins)."""
        import json
        self.set_meta(QUOTA_KEY + pool, json.dumps({"at": report.at, "until": report.until}))

    def used_by_runs(self, run_ids: Sequence[int]) -> Dict[int, Dict[str, int]]:
        """What each of ``run_ids`` spent, by pool (``used`` in ``history --json``)."""
        out: Dict[int, Dict[str, int]] = {}
        ids = [i for i in run_ids if isinstance(i, int)]
        for start in range(0, len(ids), EVENTS_PER_INSERT * 5):
            chunk = ids[start:start + EVENTS_PER_INSERT * 5]
            rows = self._x(f"SELECT run_id, pool, units FROM quota_use WHERE run_id IN "
                           f"({', '.join('?' for _ in chunk)})", tuple(chunk)).fetchall()
            for run_id, pool, units in rows:
                out.setdefault(run_id, {})[text(pool)] = _units(units)
        return out

    def quota_spent(self) -> Dict[Tuple[str, str], int]:
        """Units spent over the ring's life, by (pool, agent)."""
        return {(text(p), text(a)): _units(u)
                for p, a, u in self._x("SELECT pool, agent, units FROM quota_spent").fetchall()}

    def asked_by(self, run_id: Optional[int], agent: str) -> "tuple[Optional[dict], Optional[str]]":
        """(actor, reason) of the operator's latest skip request for run ``run_id``
        (None: for ``agent``'s next turn), or (None, None). Looked up only as a
        skipped run is recorded, by the events' run index."""
        if run_id is None:
            row = self._x("SELECT actor, reason FROM events WHERE run_id IS NULL AND agent = ?"
                          " AND kind = 'skip-requested' ORDER BY id DESC LIMIT 1", (agent,)).fetchone()
        else:
            row = self._x("SELECT actor, reason FROM events WHERE run_id = ? AND kind = 'skip-requested'"
                          " ORDER BY id DESC LIMIT 1", (run_id,)).fetchone()
        if row is None:
            return None, None
        return actor_of(row["actor"]), text(row["reason"])

    def pauses(self) -> Dict[str, float]:
        """When each pause began: "" (the ring's, silence.RING) or an agent's name ->
        epoch seconds (a pause whose time cannot be read counts from now: never
        older than it is)."""
        rows = self._x("SELECT key, value FROM meta WHERE key = ? OR (key > ? AND key < ?)",
                       (PAUSE_KEY, PAUSE_KEY + ":", PAUSE_KEY + ";")).fetchall()
        out: Dict[str, float] = {}
        for r in rows:
            who = "" if r["key"] == PAUSE_KEY else r["key"].split(":", 1)[1]
            out[who] = _float_or(r["value"], time.time())
        return out

    def alert_marks(self) -> Dict[str, float]:
        """The silences and pauses already alerted on (ringd.core.silence.alerts_due)."""
        rows = self._x("SELECT key, value FROM meta WHERE key > ? AND key < ?",
                       (ALERTED_KEY + ":", ALERTED_KEY + ";")).fetchall()
        return {r["key"].split(":", 1)[1]: _float_or(r["value"], float("nan")) for r in rows}

    def set_alert_marks(self, before: Mapping[str, float], after: Mapping[str, float]) -> None:
        for key in set(before) - set(after):
            self.set_meta(f"{ALERTED_KEY}:{key}", None)
        for key, since in after.items():
            if before.get(key) != since:
                self.set_meta(f"{ALERTED_KEY}:{key}", repr(since))

    def note_roster(self, names: Sequence[str], now: float) -> None:
        """The roster the driver runs now: an agent new to it joins at ``now``
        (``agents.joined_at``), one no longer on it leaves (NULL): silence counts
        from a join (ringd.core.silence)."""
        on = set(names)
        joined = {r["name"]: r["joined_at"] for r in self._x("SELECT name, joined_at FROM agents")}
        for name in names:
            if joined.get(name) is None:
                self._x("INSERT INTO agents(name, joined_at) VALUES (?, ?) ON CONFLICT(name) DO UPDATE"
                        " SET joined_at = excluded.joined_at WHERE agents.joined_at IS NULL", (name, now))
        for name, at in joined.items():
            if at is not None and name not in on:
                self._x("UPDATE agents SET joined_at = NULL WHERE name = ?", (name,))

    # --- writes --------------------------------------------------------------
    def take_next(self, controls: Controls) -> Optional[str]:
        """The agent an operator asked to run next (read in ``controls``), the request used up."""
        if controls.next is not None:
            self.set_meta(NEXT_KEY, None)
        return controls.next

    def event(self, run_id: Optional[int], kind: str, source: str, detail: str, at: float, *,
              agent: Optional[str] = None, actor: Optional[Mapping[str, Any]] = None,
              reason: Optional[str] = None) -> None:
        """An event, written as the transaction ends. ``agent``: the agent it
        concerns (None: the ring); ``actor`` (an operator's: ringd.cli.actor.who)
        and ``reason`` (their ``--reason``) say who asked and why."""
        actor_text = None if actor is None else json.dumps(dict(actor), separators=(",", ":"), sort_keys=True)
        self._events.append((at, run_id, kind, source, detail, agent, actor_text, reason))

    def flush_events(self) -> None:
        """The transaction's events in one statement, in the order they happened
        (an ordinary hop writes two: the last run's end and the next one's start)."""
        while self._events:
            batch, self._events = self._events[:EVENTS_PER_INSERT], self._events[EVENTS_PER_INSERT:]
            self._x("INSERT INTO events(at, run_id, kind, source, detail, agent, actor, reason) VALUES "
                    + ", ".join("(?, ?, ?, ?, ?, ?, ?, ?)" for _ in batch), tuple(v for e in batch for v in e))

    def start_run(self, agent: str, position: int, *, now: float, run_budget: float,
                  stall_threshold: float, driver_pid: int, driver_start: Optional[float],
                  pid: Optional[int] = None, pid_start: Optional[float] = None,
                  log_path: Optional[str] = None) -> int:
        """A ``running`` row (and its ``started`` event). Fails (transient) if one
        is running already."""
        cur = self._x(
            "INSERT INTO runs(agent, position, status, started_at, run_budget, stall_threshold,"
            " driver_pid, driver_start, pid, pid_start, log_path)"
            " VALUES (?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?)",
            (agent, position, now, run_budget, stall_threshold, driver_pid, driver_start,
             pid, pid_start, log_path))
        run_id = cur.lastrowid
        self.event(run_id, "started", "driver", f"agent={agent}", now, agent=agent)
        return run_id

    def set_process(self, run_id: int, pid: int, pid_start: Optional[float], log_path: str) -> None:
        self._x("UPDATE runs SET pid = ?, pid_start = ?, log_path = ? WHERE id = ?",
                (pid, pid_start, log_path, run_id))

    def close_run(self, run_id: int, status: str, *, source: str, now: float,
                  exit_code: Optional[int] = None, signal: Optional[int] = None,
                  reason: Optional[str] = None, log_path: Optional[str] = None,
                  pid: Optional[int] = None, pid_start: Optional[float] = None,
                  phase: Optional[str] = None, cpu_seconds: Optional[float] = None,
                  agent: Optional[str] = None, actor: Optional[Mapping[str, Any]] = None,
                  operator_reason: Optional[str] = None) -> bool:
        """Close a ``running`` row. Guarded: a row someone else closed meanwhile (an
        operator, the reaper) is never clobbered; then nothing happens and False
        is returned. The end is never before the start. ``agent``, ``actor`` and
        ``operator_reason`` go with its event (:meth:`event`)."""
        assert status in TERMINAL, status
        cur = self._x(
            "UPDATE runs SET status = ?,"
            " ended_at = CASE WHEN ? > started_at THEN ? ELSE started_at END,"
            " duration = CASE WHEN ? > started_at THEN ? - started_at ELSE 0 END,"
            " exit_code = ?, signal = ?, reason = ?, log_path = COALESCE(?, log_path),"
            " pid = COALESCE(?, pid), pid_start = COALESCE(?, pid_start), phase = COALESCE(?, phase),"
            " cpu_seconds = ? WHERE id = ? AND status = 'running'",
            (status, now, now, now, now, exit_code, signal, reason, log_path, pid, pid_start, phase,
             cpu_seconds, run_id))
        if cur.rowcount != 1:
            return False
        detail = f"from=running to={status}"
        if reason:
            detail += f" reason={reason}"
        self.event(run_id, status, source, detail, now, agent=agent, actor=actor, reason=operator_reason)
        return True

    def add_skipped(self, agent: str, position: Optional[int], reason: str, source: str, now: float,
                    kind: str = "skipped", actor: Optional[Mapping[str, Any]] = None,
                    operator_reason: Optional[str] = None) -> int:
        """A turn not taken: a ``skipped`` row that never started a process."""
        cur = self._x("INSERT INTO runs(agent, position, status, started_at, ended_at, duration, reason)"
                      " VALUES (?, ?, 'skipped', ?, ?, 0, ?)", (agent, position, now, now, reason))
        run_id = cur.lastrowid
        self.event(run_id, kind, source, f"agent={agent} reason={reason}", now, agent=agent, actor=actor,
                   reason=operator_reason)
        return run_id

    def put_agent(self, state: AgentState) -> None:
        """Store an agent's decided fields (its counters are the journal's own)."""
        values = state.decided()
        values["skip_requested"] = int(values["skip_requested"])
        cols = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        sets = ", ".join(f"{k} = excluded.{k}" for k in values)
        self._x(f"INSERT INTO agents(name, {cols}) VALUES (?, {marks}) ON CONFLICT(name) DO UPDATE SET {sets}",
                (state.name, *values.values()))

    def set_meta(self, key: str, value: Optional[str]) -> None:
        if value is None:
            self._x("DELETE FROM meta WHERE key = ?", (key,))
        else:
            self._x("INSERT INTO meta(key, value) VALUES (?, ?) "
                    "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, value))


class Journal:
    """A connection to the journal. Writes go through :meth:`transaction`; the
    one-line read helpers below each run one short query."""

    def __init__(self, con: sqlite3.Connection, path: Path):
        self.con = con
        self.path = path
        self._identity: Optional[Tuple[int, int]] = None   # (device, inode) of the file opened
        self._wal_files: Dict[str, Tuple[int, int]] = {}    # its -wal and -shm: path -> (device, inode)
        self._busy_timeout = 10.0
        self._give_up: Optional[Callable[[], bool]] = None
        self._knows_quotas: Optional[bool] = None
        self._reconnect_due = False   # its -wal or -shm went, its log was settled, no new connection yet
        self._orphan_fd: Optional[int] = None   # journal.db, open while a log waits to be settled (_settle)
        # told (what was removed, "saved" / "lost" / "waiting") when that is taken up (take_up_companions)
        self.on_taken_up: Optional[Callable[[str, str], None]] = None

    def wait_busy_unless(self, give_up: Callable[[], bool]) -> None:
        """Wait for a write lock another process holds (an operator command, a
        ``sqlite3`` shell's ``BEGIN EXCLUSIVE``) in steps of BUSY_STEP, up to the
        busy timeout, and stop waiting (busy: transient) once ``give_up()`` says
        so - the driver, told to stop: SQLite's own wait is deaf to signals, and
        SIGTERM must be acted on within 1 s (SPEC)."""
        self._give_up = give_up
        self.con.execute(f"PRAGMA busy_timeout = {int(BUSY_STEP * 1000)}")

    def _begin(self, patient: bool = True) -> None:
        give_up = self._give_up if patient or self._give_up is None else _at_once
        if give_up is None:
            self.con.execute("BEGIN IMMEDIATE")
            return
        end = None   # (read only once the lock was found busy: an ordinary hop pays nothing)
        while True:
            try:
                self.con.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as e:
                now = time.monotonic()
                end = now + self._busy_timeout - BUSY_STEP if end is None else end
                if _busy(self.path, e) is None or now >= end or give_up():
                    raise

    def moved(self) -> bool:
        """Was the journal file removed or replaced since it was opened (``rm
        journal.db`` to start afresh, a backup copied over it)? Its connection
        then writes where no reader looks. (False for a journal not opened from
        a file of the state dir.)"""
        identity = getattr(self, "_identity", None)
        if identity is None:
            return False
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return (st.st_dev, st.st_ino) != identity

    def companions_replaced(self) -> Optional[str]:
        """The path of this connection's -wal or -shm if it was removed or
        replaced there since the journal was opened (``rm journal.db-wal``), else
        None. The connection then writes a log no other process reads, and
        another process that opens the journal starts a new one: operator
        commands and the driver stop seeing each other's writes."""
        known = getattr(self, "_wal_files", None)
        if not known:
            return None
        now = _identities(known)
        return next((name for name, identity in known.items() if now.get(name) != identity), None)

    def replaced(self) -> Optional[str]:
        """What of the journal's files (itself, its -wal, its -shm) was removed or
        replaced under this connection, or None: one stat each, for the driver's
        look at every beat and before every turn."""
        return str(self.path) if self.moved() else self.companions_replaced()

    # --- opening -------------------------------------------------------------
    @classmethod
    def open(cls, state_dir: Path, *, create: bool = True, busy_timeout: float = BUSY_TIMEOUT,
             verify: bool = False, give_up: Optional[Callable[[], bool]] = None,
             nudge: Optional[Callable[[], object]] = None) -> "Journal":
        """Open for writing (the driver, the reaper, operator commands). ``verify``
        (the driver at start-up): refuse a damaged database (``PRAGMA quick_check``)
        before writing anything to it. ``give_up``: from the open's own writes on,
        waits for another process's write lock as :meth:`wait_busy_unless` - a
        driver starting on a journal an operator's ``sqlite3`` shell holds heard
        its SIGTERM only once the busy timeout (10 s) ran out. A journal whose
        -wal and -shm were removed under another process is waited for until
        that process takes it up again (:func:`_await_companions`, ``nudge``)."""
        path = journal_path(state_dir)
        _check_companions(path)
        if path.exists() or path.is_symlink():
            if path.is_symlink():
                raise JournalError(f"{path}: journal is a symbolic link; refusing to follow it")
            _check_sqlite_header(path)
        elif not create:
            raise JournalError(f"{path}: no journal (has the driver ever run here?)")
        else:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    os.fchmod(fd, 0o600)
                    _give_to_ring_owner(fd, path)
                finally:
                    os.close(fd)   # (before SQLite opens it: no lock of its to drop)
            except OSError as e:
                raise JournalError(f"{path}: cannot create journal: {e.strerror}", transient=True) from None
        end = time.monotonic() + busy_timeout
        while True:
            _await_companions(path, end, give_up, nudge)
            j = cls._open_file(path, busy_timeout, verify, give_up)
            # Looked at again once open: a removal between the look and the open
            # would have made this connection a second log's first.
            if _companions_unshared(path) is None:
                break
            j.con.close()
            nudge = None
        # 0600 (SPEC), also a journal.db that was there before ring wrote it (an empty
        # one made 0644 kept its mode once filled; SQLite gives -wal and -shm the
        # journal's mode).
        for name in (str(path), f"{path}-wal", f"{path}-shm"):
            safefile.chmod_regular(name, 0o600)
        return j

    @classmethod
    def _open_file(cls, path: Path, busy_timeout: float, verify: bool,
                   give_up: Optional[Callable[[], bool]]) -> "Journal":
        try:
            con = _connect(path, readonly=False, timeout=busy_timeout)
            if verify:
                _verify(con, path)
            _set_up(con)
            j = cls(con, path)
            j._busy_timeout = busy_timeout
            if give_up is not None:
                j.wait_busy_unless(give_up)
            with suppress(OSError):   # (see moved)
                st = os.stat(path, follow_symlinks=False)
                j._identity = (st.st_dev, st.st_ino)
            j._migrate()
            j._wal_files = _identities(f"{path}{suffix}" for suffix in ("-wal", "-shm"))
        except JournalError:
            con.close()
            raise
        except sqlite3.DatabaseError as e:
            raise _unusable(path, e) from None
        return j

    def preallocate_wal(self) -> None:
        """Make the write-ahead log as long as it will grow, with zeros, once.

        SQLite deletes its log at the last close and grows it again from nothing:
        each commit that lengthens the file also makes its fdatasync write the
        file's size and new blocks, 0.15-0.2 ms more a commit here for the first
        ~150 commits of a driver (until the first checkpoint lets the log start
        over at its beginning). Written once at start-up, the log's blocks exist
        and those commits only overwrite. Zeros are never a valid frame (a frame
        carries the log header's salts and a checksum), so SQLite ignores them as
        it ignores the stale frames past the end of any log it restarted; they
        are written past the end of the file, under SQLite's write lock (no
        other writer is appending meanwhile). Best effort: a full disk leaves the
        log as it was."""
        con = self.con
        try:
            page = con.execute("PRAGMA page_size").fetchone()[0]
            pages = con.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
            con.execute("BEGIN IMMEDIATE")
        except sqlite3.Error:
            return
        try:   # only a regular file is extended (a FIFO planted there is never waited on)
            fd = safefile.open_regular(f"{self.path}-wal", os.O_WRONLY | os.O_NOFOLLOW)
        except OSError:
            fd = None
        try:
            if fd is not None:
                _extend_with_zeros(fd, WAL_HEADER + (pages + WAL_SLACK_FRAMES) * (WAL_FRAME_HEADER + page))
        finally:
            if fd is not None:
                os.close(fd)
            try:
                con.execute("ROLLBACK")
            except sqlite3.Error:
                pass

    @classmethod
    def open_readonly(cls, state_dir: Path, busy_timeout: float = 5.0) -> "Journal":
        """Open for reading only (status, history): never creates anything."""
        path = journal_path(state_dir)
        if not path.exists():
            raise JournalError(f"{path}: no journal (has the driver ever run here?)")
        _check_sqlite_header(path)
        _check_companions(path)
        end = time.monotonic() + busy_timeout
        while True:
            _await_companions(path, end, None, None)   # (a reader would begin a second log too)
            try:
                con = _connect(path, readonly=True, timeout=busy_timeout)
                con.execute("SELECT 1 FROM runs LIMIT 1").fetchall()
            except sqlite3.DatabaseError as e:
                raise _unusable(path, e) from None
            if _companions_unshared(path) is None:
                return cls(con, path)
            con.close()

    def _migrate(self) -> None:
        """Bring an older journal to this ring's schema; refuse a newer one.

        Looked at first, written only when something is missing: a current
        journal costs a writer's open no commit (every operator command opens
        one). What to write is decided again under the write lock: another ring
        (a newer one, or this one upgrading too) may have written between the two
        looks, and a newer ring's mark must never be overwritten with ours."""
        if self._upgrade() is None:
            return
        with self.write() as con:
            for statement in statements(self._upgrade() or ""):
                con.execute(statement)

    def _upgrade(self) -> Optional[str]:
        """What brings the journal to this ring's schema (None: it is there);
        raises for a journal a newer ring wrote."""
        con = self.con
        present = {r[0] for r in con.execute("SELECT name FROM sqlite_master")}
        version = None
        if "meta" in present:
            row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            version = None if row is None else str(row[0])
            reason = too_new(version)
            if reason:
                raise JournalError(f"{self.path}: {reason}")
        have = {(t, r[1]) for t in {t for t, _, _ in ADDED_COLUMNS}
                for r in con.execute(f"PRAGMA table_info({t})")}
        added = "".join(f"ALTER TABLE {t} ADD COLUMN {c} {kind};" for t, c, kind in ADDED_COLUMNS
                        if t in present and (t, c) not in have)   # a new table gets them from SCHEMA
        if version == str(SCHEMA_VERSION) and SCHEMA_OBJECTS <= present and not added:
            return None
        # (columns first: SCHEMA's triggers name them)
        backfill = BACKFILL_LAST_OK if "agents" in present and ("agents", "last_ok_at") not in have else ""
        return (added + SCHEMA + backfill +
                f"INSERT INTO meta(key, value) VALUES ('schema_version', '{SCHEMA_VERSION}')"
                " ON CONFLICT(key) DO UPDATE SET value = excluded.value;")

    def close(self) -> Optional[str]:
        """Close the connection. SQLite removes the -wal and -shm at the last close,
        but not of a journal moved or removed since it was opened: left at the
        path, a journal put there (a backup restored) would take them up as its
        own - the old journal's pages read as the new one's. Ours are removed.
        A connection whose -wal or -shm went is closed by :meth:`_settle`;
        returns what became of its writes then ("saved" or "lost"), else None."""
        if not self.moved() and self.companions_replaced() is not None:
            ours, self._wal_files = self._wal_files, {}
            return self._settle(ours, final=True)
        stale, self._wal_files = (self._wal_files if self.moved() else {}), {}   # (closed twice: once)
        self.con.close()
        fd, self._orphan_fd = self._orphan_fd, None
        if fd is not None:
            os.close(fd)
        for name, identity in _identities(stale).items():
            if identity == stale[name]:   # (never one a journal at the path made since)
                with suppress(OSError):
                    os.unlink(name)
        return None

    def take_up_companions(self) -> Optional[str]:
        """This connection's -wal or -shm was removed at the path, journal.db
        itself still there: settle the orphaned log (:meth:`_settle`) and
        connect again to the journal's files now at the path, in place - every
        holder of this Journal goes on with it. Returns "saved" (nothing lost),
        "lost" (another log had begun at the path: ours since its last
        checkpoint dropped) or "waiting" (tried again at the next look), and
        tells :attr:`on_taken_up`; None when nothing was amiss. Never inside a
        transaction. The driver calls it at each beat and each operator's wake;
        every write transaction calls it first."""
        if self._reconnect_due:
            self._reconnect()   # (a reconnect that failed: raises again while it cannot)
            return None
        what = self.companions_replaced() if self._wal_files else None
        if what is None or self.con.in_transaction or self.moved():
            return None
        fate = self._settle(self._wal_files, final=False)
        try:
            if fate != "waiting":
                self._reconnect_due = True
                self._reconnect()
        finally:
            if self.on_taken_up is not None:
                self.on_taken_up(what, fate)
        return fate

    def _settle(self, ours: Dict[str, Tuple[int, int]], final: bool) -> str:
        """Settle a connection whose -wal or -shm was removed at the path
        (:func:`ringd.core.walfate.orphaned_log` decides, with SQLite's pending
        byte held: no connection can start meanwhile). Saved: its log is
        checkpointed into journal.db and the connection closed. Lost: another
        log at the path holds commits - ours checkpointed under its frames would
        malform journal.db - so the connection is closed without one. Waiting
        (not ``final``): the connection stays, and never checkpoints by itself
        meanwhile. The close itself neither checkpoints nor deletes anything by
        name: its exclusive lock fails against the held byte."""
        with suppress(sqlite3.Error):   # (its automatic checkpoint, from now on: never)
            self.con.execute("PRAGMA wal_autocheckpoint = 0")
        fd, self._orphan_fd = self._orphan_fd, None
        if fd is None:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                if final:
                    self.con.close()
                return "lost" if final else "waiting"
        what = walfate.WAIT
        try:
            pending = _hold_pending(fd, time.monotonic() + (ORPHAN_CLOSE_WAIT if final else 0.0))
            what = walfate.orphaned_log(pending=pending, new_log_commits=_new_log_has_commits(self.path, ours),
                                        new_files=_new_files(self.path, ours), final=final)
            if what == walfate.SAVE and not self._checkpoint_all():
                what = walfate.DROP if final else walfate.WAIT
            if what != walfate.WAIT:
                self.con.close()
        finally:
            if what == walfate.WAIT:
                # the connection stays: the byte let go, the descriptor kept (closing
                # it would drop every POSIX lock this process's connection holds)
                with suppress(OSError, TypeError):
                    _lock_range(fd, getattr(fcntl, "F_OFD_SETLK", None), fcntl.F_UNLCK, PENDING_BYTE, 1)
                self._orphan_fd = fd
            else:
                os.close(fd)   # only now that it is closed: this drops its POSIX locks on the file
        return {walfate.SAVE: "saved", walfate.DROP: "lost"}.get(what, "waiting")

    def _checkpoint_all(self) -> bool:
        """Every frame of this connection's log into journal.db (PASSIVE: a
        reader's snapshot on the same log holds frames back; tried again in
        short steps for ORPHAN_CLOSE_WAIT at most)."""
        end = time.monotonic() + ORPHAN_CLOSE_WAIT
        while True:
            try:
                busy, log, done = self.con.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            except sqlite3.Error:
                return False
            if busy == 0 and log == done:
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.01)

    def _reconnect(self) -> None:
        """A new connection to the journal at the path, as this one was set up."""
        con = _connect(self.path, readonly=False, timeout=self._busy_timeout)
        try:
            _set_up(con)
            if self._give_up is not None:
                con.execute(f"PRAGMA busy_timeout = {int(BUSY_STEP * 1000)}")
        except sqlite3.Error as e:
            con.close()
            self.con = _closed()   # (every use fails, transient, until a reconnect works)
            raise _unusable(self.path, e) from None
        self.con, self._reconnect_due = con, False
        self._wal_files = _identities(f"{self.path}{suffix}" for suffix in ("-wal", "-shm"))
        for name in (f"{self.path}-wal", f"{self.path}-shm"):
            safefile.chmod_regular(name, 0o600)

    # --- transactions ------------------------------------------------------------
    @contextmanager
    def write(self, patient: bool = True) -> Iterator[sqlite3.Connection]:
        """The backend's write transaction (BEGIN IMMEDIATE takes SQLite's write lock
        up front, so a busy database waits here instead of failing half-way).
        ``patient=False``: on a connection that waits in steps
        (:meth:`wait_busy_unless`), wait one step at most. A connection whose
        -wal or -shm went takes the journal up first: it never commits to a log
        it knows no other process reads (two stats)."""
        if self._wal_files or self._reconnect_due:
            self.take_up_companions()
        self._begin(patient)
        try:
            yield self.con
        except BaseException:
            try:
                self.con.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise
        try:
            self.con.execute("COMMIT")
        except sqlite3.Error:
            try:   # a failed COMMIT (disk full) leaves the transaction open
                self.con.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise

    @contextmanager
    def transaction(self, patient: bool = True) -> Iterator[Tx]:
        """One write transaction; everything inside commits together or not at all.
        Any failure of the database surfaces as :class:`JournalError`.
        ``patient=False``: a write lock another process holds fails it (busy:
        transient) after BUSY_STEP, for a write the caller tries again later."""
        try:
            with self.write(patient) as con:
                tx = Tx(con)
                yield tx
                tx.flush_events()
        except sqlite3.Error as e:
            raise _wrap(self.path, e) from None

    @contextmanager
    def snapshot(self) -> Iterator[Tx]:
        """One read transaction: every read inside sees the same journal."""
        if self._reconnect_due:
            self.take_up_companions()
        try:
            self.con.execute("BEGIN")
            try:
                yield Tx(self.con)
            finally:
                self.con.execute("COMMIT")
        except sqlite3.Error as e:
            raise _wrap(self.path, e) from None

    def _read(self, fn):
        if self._reconnect_due:
            self.take_up_companions()
        try:
            return fn(Tx(self.con))
        except sqlite3.Error as e:
            raise _wrap(self.path, e) from None

    # --- one-shot reads ------------------------------------------------------------
    def running_row(self) -> Optional[RunRow]:
        return self._read(lambda tx: tx.running_row())

    def last_run(self) -> Optional[RunRow]:
        return self._read(lambda tx: tx.last_run())

    def run(self, run_id: int) -> Optional[RunRow]:
        return self._read(lambda tx: tx.run(run_id))

    def agent_state(self, name: str) -> AgentState:
        return self._read(lambda tx: tx.agent(name))

    def agent_states(self) -> Dict[str, AgentState]:
        return self._read(lambda tx: tx.agents())

    def meta(self, key: str) -> Optional[str]:
        return self._read(lambda tx: tx.meta(key))

    def history(self, agent: Optional[str] = None, limit: int = 20) -> List[RunRow]:
        def q(_tx: Tx) -> List[RunRow]:
            if agent is None:
                rows = self.con.execute("SELECT * FROM runs ORDER BY id DESC LIMIT ?", (limit,))
            else:
                rows = self.con.execute("SELECT * FROM runs WHERE agent = ? ORDER BY id DESC LIMIT ?",
                                         (agent, limit))
            return [RunRow.from_mapping(r) for r in rows.fetchall()]
        return self._read(q)

    def last_run_of(self, agent: str) -> Optional[RunRow]:
        def q(_tx: Tx) -> Optional[RunRow]:
            row = self.con.execute("SELECT * FROM runs WHERE agent = ? ORDER BY id DESC LIMIT 1",
                                    (agent,)).fetchone()
            return RunRow.from_mapping(row) if row else None
        return self._read(q)

    def controls(self) -> Controls:
        return self._read(lambda tx: tx.controls())

    def knows_quotas(self) -> bool:
        """Has the journal the quota tables? A reader may open one that an older
        driver still writes (the ring upgraded, its driver not yet restarted)."""
        if self._knows_quotas is None:
            self._knows_quotas = self._read(lambda tx: tx._x(
                "SELECT count(*) FROM sqlite_master WHERE name = 'quota_use'").fetchone()[0] > 0)
        return self._knows_quotas

    def quota_use(self, windows: Mapping[str, float], now: float
                  ) -> Tuple[Dict[str, List[Use]], Dict[str, List[Exhausted]]]:
        return self._read(lambda tx: tx.quota_use(windows, now))

    def used_by_runs(self, run_ids: Sequence[int]) -> Dict[int, Dict[str, int]]:
        return self._read(lambda tx: tx.used_by_runs(run_ids))

    def quota_spent(self) -> Dict[Tuple[str, str], int]:
        return self._read(lambda tx: tx.quota_spent())

    def agent_names(self) -> List[str]:
        return self._read(lambda _tx: [r[0] for r in self.con.execute("SELECT name FROM agents ORDER BY name")])

    def run_counts(self) -> Dict[str, Dict[str, int]]:
        def q(_tx: Tx) -> Dict[str, Dict[str, int]]:
            out: Dict[str, Dict[str, int]] = {}
            for r in self.con.execute("SELECT agent, status, n FROM run_counts"):
                out.setdefault(text(r["agent"]), {})[text(r["status"])] = count(r["n"])
            return out
        return self._read(q)

    # --- the event trail (``ringd events``, history's actors) ---------------------------
    def _columns(self, table: str) -> frozenset:
        """The columns ``table`` has (a reader never migrates: an older ring's
        journal lacks the newest ones until its driver opens it)."""
        return frozenset(r[1] for r in self.con.execute(f"PRAGMA table_info({table})"))

    def _event_select(self) -> str:
        have = self._columns("events")
        agent = "COALESCE(e.agent, r.agent)" if "agent" in have else "r.agent"
        extra = "".join(f", e.{c}" if c in have else f", NULL AS {c}" for c in ("actor", "reason"))
        return (f"SELECT e.id, e.at, e.run_id, e.kind, e.source, e.detail, {agent} AS agent{extra}"
                f" FROM events e LEFT JOIN runs r ON r.id = e.run_id")

    def events_before(self, below: Optional[int], agent: Optional[str], batch: int) -> List[EventRow]:
        """Up to ``batch`` events older than id ``below`` (None: the newest), newest
        first; ``agent``: only those concerning it (an older ring's operator
        events, which name no agent, by their detail)."""
        def q(_tx: Tx) -> List[EventRow]:
            sql, args = self._event_select() + " WHERE e.id < ?", [below if below is not None else 1 << 62]
            if agent is not None:
                has_agent = "agent" in self._columns("events")
                sql += (" AND (e.agent = ? OR (e.agent IS NULL AND (r.agent = ? OR e.detail = ?)))" if has_agent
                        else " AND (r.agent = ? OR e.detail = ?)")
                args += ([agent] if has_agent else []) + [agent, f"agent={agent}"]
            rows = self.con.execute(sql + f" ORDER BY e.id DESC LIMIT {int(batch)}", args).fetchall()
            return [EventRow.from_mapping(r, actor_of(r["actor"])) for r in rows]
        return self._read(q)

    def closing_actors(self, run_ids: Sequence[int]) -> Dict[int, dict]:
        """Who closed each of ``run_ids`` (an operator's close or skip; the
        closing event's actor), by run id: runs no operator closed are absent."""
        if not run_ids or "actor" not in self._columns("events"):
            return {}
        out: Dict[int, dict] = {}

        def q(_tx: Tx) -> None:
            for k in range(0, len(run_ids), 500):
                chunk = list(run_ids[k:k + 500])
                marks = ", ".join("?" for _ in chunk)
                for r in self.con.execute(
                        f"SELECT run_id, actor FROM events WHERE run_id IN ({marks}) AND actor IS NOT NULL"
                        f" AND kind NOT IN ('started', 'skip-requested') ORDER BY id", chunk):
                    actor = actor_of(r["actor"])
                    if actor is not None:
                        out[r["run_id"]] = actor
        self._read(q)
        return out

    def last_runs(self) -> Dict[str, RunRow]:
        """Each agent's last finished (or skipped) run, by agent name."""
        return self._read(lambda _tx: {r["agent"]: RunRow.from_mapping(r) for r in self.con.execute(
            "SELECT r.* FROM agents a JOIN runs r ON r.id = a.last_run_id")})

    # --- one-shot writes -------------------------------------------------------------
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
        except sqlite3.Error as e:
            raise _wrap(self.path, e) from None

    def set_meta(self, key: str, value: Optional[str]) -> None:
        with self.transaction() as tx:
            tx.set_meta(key, value)

    # --- operator controls: pause, resume, next -------------------------------------
    # Kept in ``meta`` (both backends, no schema change); every change is an event.

    def set_paused(self, name: Optional[str], paused: bool, now: Optional[float] = None, *,
                   actor: Optional[Mapping[str, Any]] = None, reason: Optional[str] = None) -> bool:
        """Pause (or lift the pause of) the ring (``name`` None) or one agent.
        Returns True when that changed anything."""
        key = pause_key(name)
        now = time.time() if now is None else now
        with self.transaction() as tx:
            if (tx.meta(key) is not None) == paused:
                return False
            tx.set_meta(key, repr(now) if paused else None)
            tx.event(None, "paused" if paused else "unpaused", "operator",
                     "ring" if name is None else f"agent={name}", now, agent=name, actor=actor, reason=reason)
        return True

    def request_next(self, name: str, *, actor: Optional[Mapping[str, Any]] = None,
                     reason: Optional[str] = None) -> Optional[str]:
        """Operator: ``name`` takes the very next turn, once. Returns the request it replaced."""
        with self.transaction() as tx:
            before = tx.meta(NEXT_KEY)
            tx.set_meta(NEXT_KEY, name)
            tx.event(None, "next-requested", "operator", f"agent={name}", time.time(), agent=name,
                     actor=actor, reason=reason)
        return before

    def note_event(self, kind: str, detail: str, now: Optional[float] = None, *,
                   actor: Optional[Mapping[str, Any]] = None, reason: Optional[str] = None) -> None:
        """Operator: an event about the whole ring (a reload asked for, and its answer)."""
        with self.transaction() as tx:
            tx.event(None, kind, "operator", detail, time.time() if now is None else now,
                     actor=actor, reason=reason)

    # --- retention ----------------------------------------------------------------------
    def prune(self, keep: int, batch: int = PRUNE_BATCH, logged: Optional[List[Tuple[int, str]]] = None,
              keep_use_after: Optional[float] = None) -> int:
        """Delete up to ``batch`` of the oldest runs beyond the newest ``keep``
        (and their events and quota use) in one short transaction; returns how
        many runs went. Called after each hop, so a large backlog goes in small
        steps as the ring turns. The counters (``agents.runs``, ``run_counts``,
        ``quota_spent``) are kept by triggers on insert and update, so deleting
        history never changes them. ``keep_use_after``: a run whose quota use
        was reported after it is kept (it is inside a pool's window).
        ``logged``: gets (run id, agent) of each run deleted that had a log."""
        if keep <= 0:
            return 0
        with self.transaction() as tx:
            top = tx._x("SELECT max(id) AS m FROM runs").fetchone()["m"]
            if top is None:
                return 0
            first_kept = top - keep + 1   # ids only grow: the newest ``keep`` ids (or fewer rows)
            bounds = (first_kept, NO_USE_KEPT if keep_use_after is None else keep_use_after, batch)
            if logged is not None:
                logged.extend((r["id"], r["agent"]) for r in tx._x(
                    f"SELECT id, agent FROM runs WHERE id IN ({_PRUNED}) AND log_path IS NOT NULL",
                    bounds).fetchall())
            tx._x(f"DELETE FROM events WHERE run_id IN ({_PRUNED})", bounds)
            tx._x(f"DELETE FROM quota_use WHERE run_id IN ({_PRUNED})", bounds)
            gone = tx._x(f"DELETE FROM runs WHERE id IN ({_PRUNED})", bounds).rowcount
            if gone:
                # operator events (no run) older than the oldest run kept go with them
                oldest = tx._x("SELECT started_at FROM runs ORDER BY id LIMIT 1").fetchone()
                if oldest is not None:
                    tx._x("DELETE FROM events WHERE id IN (SELECT id FROM events WHERE run_id IS NULL "
                          "AND at < ? ORDER BY id LIMIT ?)", (oldest["started_at"], batch))
        return gone
