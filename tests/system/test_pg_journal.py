"""The PostgreSQL journal's own guarantees: the lease on the server's clock,
fenced writes, a hand-over that waits for a write in flight, outages, and
psycopg loaded only on this path. Against a real server (pgcluster)."""
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, wait_until

from ringd.core.lease import RENEW, TAKE, WAIT


@pytest.fixture
def pgj(pg_dsn):
    from ringd.journal.pg import PgJournal
    opened = []

    def open_():
        j = PgJournal.connect(pg_dsn)
        opened.append(j)
        return j
    yield open_
    for j in opened:
        j.close()


def test_one_leader_then_takeover_after_expiry_with_a_new_epoch(pgj):
    a, b = pgj(), pgj()
    assert a.acquire("A", 1.0).action == TAKE
    wait = b.acquire("B", 1.0)
    assert wait.action == WAIT and 0 < wait.retry_in <= 1.0
    assert a.acquire("A", 1.0).action == RENEW
    view = a.read_lease()
    assert view.holder == "A" and view.epoch == 1 and view.expires_at > view.server_now
    time.sleep(1.1)
    took = b.acquire("B", 1.0)
    assert (took.action, took.epoch, took.previous) == (TAKE, 2, "A")


def test_a_write_of_the_old_epoch_never_commits_after_the_hand_over(pgj):
    from ringd.journal.pg import Fenced
    a, b = pgj(), pgj()
    a.acquire("A", 0.5)
    a.set_meta("k", "A leads")
    time.sleep(0.6)
    with pytest.raises(Fenced):          # expired: refused even before anyone took over
        a.set_meta("k", "A after expiry")
    b.acquire("B", 5)
    with pytest.raises(Fenced):
        a.set_meta("k", "A after hand-over")
    assert b.meta("k") == "A leads"
    b.set_meta("k", "B leads")
    assert a.acquire("A", 5).action == WAIT and a.fence is None


def test_the_hand_over_waits_for_a_fenced_write_in_flight(pgj):
    a, b = pgj(), pgj()
    a.acquire("A", 1.0)
    result = {}
    with a.write() as con:               # fence checked: the lease row is share-locked
        con.execute("INSERT INTO meta(key, value) VALUES ('inflight', 'A')")
        time.sleep(1.1)                  # the lease expires while the write is open
        t = threading.Thread(target=lambda: result.update(d=b.acquire("B", 5)))
        t.start()
        time.sleep(0.3)
        assert t.is_alive(), "the hand-over must wait for the write in flight"
    t.join(5)
    assert result["d"].action == TAKE and result["d"].epoch == 2
    assert b.meta("inflight") == "A"     # committed before the hand-over, never after


def test_a_leader_frozen_inside_a_write_neither_holds_up_the_hand_over_nor_commits(pg_dsn):
    from ringd.journal.pg import PgJournal, PgJournalError
    a, b = PgJournal.connect(pg_dsn, ttl=1.0), PgJournal.connect(pg_dsn, ttl=1.0)
    try:
        a.acquire("A", 1.0)
        write = a.write()
        con = write.__enter__()          # the lease row is share-locked ...
        con.execute("INSERT INTO meta(key, value) VALUES ('frozen', 'A')")
        time.sleep(1.1)                  # ... and A freezes past its lease
        t0 = time.monotonic()
        d = b.acquire("B", 5)
        assert (d.action, d.epoch) == (TAKE, 2)
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(PgJournalError):
            write.__exit__(None, None, None)  # A thaws: its commit fails
        assert b.meta("frozen") is None  # rolled back with A's session, never committed
    finally:
        a.close()
        b.close()


def test_a_clean_release_hands_over_at_once(pgj):
    a, b = pgj(), pgj()
    a.acquire("A", 30)
    a.release()
    d = b.acquire("B", 30)
    assert (d.action, d.previous) == (TAKE, None)


def test_an_outage_is_one_clear_error_and_the_journal_reconnects(pg_cluster, pgj):
    from ringd.journal.pg import PgJournalError
    j = pgj()
    j.set_meta("before", "1")
    pg_cluster.stop("immediate")
    try:
        with pytest.raises(PgJournalError) as e:
            j.set_meta("during", "1")
        assert "\n" not in str(e.value)
    finally:
        pg_cluster.start()
    wait_until(lambda: _ok(lambda: j.set_meta("after", "1")), timeout=10, message="reconnect")
    assert j.meta("before") == "1" and j.meta("during") is None and j.meta("after") == "1"


def _ok(fn):
    try:
        fn()
        return True
    except Exception:
        return False


def test_the_dsn_password_never_reaches_a_message():
    from ringd.core.dsn import redact
    assert "s3cret" not in redact("postgresql://ring:s3cret@db.example/ring")
    assert "s3cret" not in redact("host=db password=s3cret dbname=ring")


def test_ring_and_its_sqlite_path_never_import_psycopg(tmp_path):
    code = ("import sys, ringd, ringd.cli.commands, ringd.loops.driver, ringd.cli.status, ringd.journal.sqlite, ringd.core.lease, "
            "ringd.loops.watcher\n"
            "from ringd.journal.sqlite import Journal\n"
            "Journal.open(__import__('pathlib').Path(sys.argv[1])).close()\n"
            "assert not [m for m in sys.modules if m.startswith('psycopg')], 'psycopg imported'\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("doc, key", [
    ({"ring": {"journal": "mysql://x/y"}}, "ring.journal"),
    ({"ring": {"journal": 5}}, "ring.journal"),
    ({"ring": {"lease_ttl": 0}}, "ring.lease_ttl"),
    ({"ring": {"lease_ttl": -3}}, "ring.lease_ttl"),
    ({"ring": {"lease_ttl": 0.001}}, "ring.lease_ttl"),   # a beat every 0.25 ms: a spinning driver
])
def test_bad_journal_or_lease_ttl_names_the_key(doc, key):
    from ringd.inputs.config import ConfigError, parse_config
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    assert key in str(e.value) and "\n" not in str(e.value)


def test_journal_and_lease_ttl_defaults_and_values():
    from ringd.inputs.config import parse_config
    c = parse_config({"ring": {"journal": "postgresql://ring@db/ring", "lease_ttl": 3}})
    assert (c.ring.journal, c.ring.lease_ttl) == ("postgresql://ring@db/ring", 3)
    d = parse_config(None)
    assert (d.ring.journal, d.ring.lease_ttl) == (None, 30)


def test_the_version_is_decided_again_under_the_migration_lock(pgj, pg_dsn):
    """A writer's connect looks at the version, then upgrades under the
    migration lock. A newer ring that upgraded the journal between the two
    must find its mark kept: decided again under the lock, and refused."""
    import psycopg
    from ringd.journal.sqlite import JournalError
    from ringd.journal.pg import PgJournal
    from ringd.journal.schema_pg import MIGRATION_LOCK, SCHEMA_VERSION
    pgj()   # the schema, current
    newer = psycopg.connect(pg_dsn, autocommit=True)
    watcher = psycopg.connect(pg_dsn, autocommit=True)
    outcome = []

    def connect():
        try:
            PgJournal.connect(pg_dsn).close()
            outcome.append("connected")
        except JournalError as e:
            outcome.append(str(e))
    t = threading.Thread(target=connect)
    try:
        newer.execute("UPDATE meta SET value = %s WHERE key = 'schema_version'", (str(SCHEMA_VERSION - 1),))
        newer.execute("BEGIN")
        newer.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        newer.execute("UPDATE meta SET value = %s WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
        t.start()
        wait_until(lambda: watcher.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted").fetchone()[0] == 1,
            timeout=10, message="the connect waiting for the migration lock")
        newer.execute("COMMIT")   # the newer ring's upgrade lands while the connect waits for the lock
        t.join(15)
        assert not t.is_alive()
        assert len(outcome) == 1 and "newer ring" in outcome[0], outcome
        assert watcher.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] \
            == str(SCHEMA_VERSION + 1)
    finally:
        if newer.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            newer.execute("ROLLBACK")
        newer.close()
        if t.ident is not None:
            t.join(15)
        watcher.close()


def test_a_lease_row_deleted_by_hand_is_made_again_held_for_one_ttl(pgj, pg_dsn):
    """The lease row deleted (an operator's DELETE, a bad restore): a beat
    crashed the driver (TypeError on the missing row), every restart alike. It
    must come back - held by nobody for one TTL. The leader whose lease is still
    good on the server's clock takes it at once (a new epoch: nobody else can
    have led meanwhile); every other driver waits out that TTL."""
    import psycopg
    from ringd.journal.pg import Fenced
    a, b = pgj(), pgj()
    assert a.acquire("A", 30).action == TAKE
    with psycopg.connect(pg_dsn, autocommit=True) as con:
        con.execute("DELETE FROM lease")
    assert b.acquire("B", 0.5).action == WAIT       # made again: nobody's to take yet
    d = a.acquire("A", 5)
    assert (d.action, d.epoch) == (TAKE, 2)         # the leader's own, at once
    a.set_meta("k", "A goes on")
    assert b.acquire("B", 5).action == WAIT
    # a leader whose own lease has lapsed when the row goes is fenced, and waits
    assert a.acquire("A", 0.3).action == RENEW
    time.sleep(0.4)
    with psycopg.connect(pg_dsn, autocommit=True) as con:
        con.execute("DELETE FROM lease")
    assert a.acquire("A", 0.5).action == WAIT
    with pytest.raises(Fenced):
        a.set_meta("k", "A after the row went")
    d = wait_until(lambda: (d := b.acquire("B", 5)).action == TAKE and d, timeout=5,
                   message="the recreated lease lapsing")
    assert d.epoch == 1
    b.set_meta("k", "B leads")
    assert a.acquire("A", 5).action == WAIT


@pytest.mark.parametrize("dsn, secret", [
    # libpq quotes the bad token of a URL, the password itself here
    ("postgresql://ring:s3cr%ZZet@/ring?host=/nonexistent", "s3cr"),
    ("postgresql://ring@/ring?host=/nonexistent&password=s3cr%ZZet", "s3cr"),
    # a quoted password with a space: redact stopped at the space
    ("host=/nonexistent password='s3cr et' dbname=ring", "et'"),
    ("host=/nonexistent password = s3cret dbname=ring junk", "s3cret"),
])
def test_a_journal_url_that_cannot_be_used_never_prints_its_password(dsn, secret):
    pytest.importorskip("psycopg")
    from ringd.journal.sqlite import JournalError
    from ringd.core.dsn import redact
    from ringd.journal.pg import PgJournal
    assert secret not in redact(dsn)
    with pytest.raises(JournalError) as e:
        PgJournal.connect(dsn)
    assert secret not in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_longest_lease_ttl_the_config_allows_still_connects(pg_dsn):
    """ring.lease_ttl is accepted up to 10 years, and a fifth of it bounds every
    wait on the server: past ~99 days that is no int of milliseconds, and every
    connect failed ("Value exceeds integer range") - a driver exiting 69 forever."""
    from ringd.inputs.config import MAX_DURATION, parse_config
    from ringd.journal.pg import PgJournal
    ttl = parse_config({"ring": {"journal": pg_dsn, "lease_ttl": MAX_DURATION}}).ring.lease_ttl
    j = PgJournal.connect(pg_dsn, ttl=ttl)
    try:
        assert j.acquire("A", ttl).action == TAKE
        assert j.read_lease().expires_at > time.time() + MAX_DURATION / 2
    finally:
        j.close()


@pytest.mark.parametrize("expires, action", [("infinity", WAIT), ("-infinity", TAKE),
                                             ("200000-01-01 UTC", WAIT)])
def test_a_lease_expiry_edited_beyond_any_date_still_reads(pgj, pg_dsn, expires, action):
    """A lease row pinned by hand ('infinity', a year past 9999): its expiry read
    as a float no date can hold, and `ringd status` died of an OverflowError
    (and a standby wrote Infinity into its heartbeat's JSON)."""
    import math
    import psycopg
    from ringd.core.timefmt import iso
    a = pgj()
    with psycopg.connect(pg_dsn, autocommit=True) as con:
        con.execute("UPDATE lease SET holder = 'X pid=1 start=1', epoch = 7, expires_at = %s", (expires,))
    view = a.read_lease()
    assert math.isfinite(view.expires_at) and iso(view.expires_at)
    assert a.acquire("A", 5).action == action


@pytest.fixture
def silent_server():
    """A PostgreSQL port that takes the connection (the kernel's handshake) and
    never says a word: a hung server, a proxy whose backend is gone."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield s.getsockname()[1]
    s.close()


def test_a_new_connection_to_a_server_that_never_answers_ends_on_a_stop_signal(silent_server):
    """A reconnect (after a cut) went through psycopg's own wait: a SIGTERM was
    heard only after libpq's connect_timeout, 8 s at the default lease_ttl (and
    one per address tried): far past the SPEC's 1 s."""
    import signal
    pytest.importorskip("psycopg")
    from taps import Tap
    from ringd.journal.pg import PgJournalError, _Con
    tap = Tap()
    try:
        tap.send(signal.SIGTERM)
        t0 = time.monotonic()
        with pytest.raises(PgJournalError, match="stopping"):
            _Con(f"postgresql://ring@127.0.0.1:{silent_server}/ring", False, wait_limit=7.5, tap=tap)
        took = time.monotonic() - t0
        assert took < 1.0, took
        assert tap.drain() == {signal.SIGTERM}   # the driver's loop hears it next
    finally:
        tap.close()


def test_a_new_connection_is_bounded_by_one_call_bound_whatever_the_hosts_tried(silent_server):
    """psycopg gives each host (and each address of one) its own connect_timeout:
    a DSN naming three was three bounds - a driver silent past its lease's switch."""
    pytest.importorskip("psycopg")
    from ringd.journal.pg import PgJournalError, _Con
    hosts = ",".join(["127.0.0.1"] * 3)
    ports = ",".join([str(silent_server)] * 3)
    t0 = time.monotonic()
    with pytest.raises(PgJournalError, match="cannot connect"):
        _Con(f"host={hosts} port={ports} user=ring dbname=ring", False, wait_limit=2.0)
    took = time.monotonic() - t0
    assert took < 5.0, took   # (one bound, 2 s: three were 6)


def test_a_connection_made_after_the_first_connect_gave_up_is_closed(pg_dsn, monkeypatch, request):
    """A driver's first connect that outlasts its bound raises; the connect goes
    on on its thread. Nobody would ever take up what it makes: it is closed as
    soon as it is made, not held open against the server's connection limit."""
    import psycopg
    from ringd.journal import pg as journal_pg
    go, made = threading.Event(), []
    request.addfinalizer(lambda: [c.close() for c in made])   # (after go.set: finalisers run last first)
    request.addfinalizer(go.set)   # a _Con that did not raise: its thread ends all the same

    def slow_connect(dsn, **kwargs):
        go.wait(20)
        made.append(psycopg.connect(pg_dsn))
        return made[-1]
    monkeypatch.setattr(journal_pg._BoundConnection, "connect", slow_connect)
    # (pytest.raises keeps the failed _Con referenced, through the traceback: no
    # garbage collection closes the late connection for it)
    with pytest.raises(journal_pg.PgJournalError, match="cannot connect: no answer"):
        journal_pg._Con(pg_dsn, False, wait_limit=0.1)
    go.set()
    wait_until(lambda: made and made[0].closed, 20, message="the late connection closed")


def test_no_thread_to_connect_on_is_a_journal_error_and_leaks_no_descriptor(pg_dsn, monkeypatch):
    import os
    from ringd.journal import pg as journal_pg

    def no_thread(*args, **kwargs):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(journal_pg.sidethread, "start", no_thread)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(journal_pg.PgJournalError, match="cannot connect: no thread to connect on"):
        journal_pg._Con(pg_dsn, False, wait_limit=1.0)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_side_thread_is_born_with_every_signal_blocked():
    """The driver's signals are its main thread's to hear: a side thread (a
    new connection's) got them too, its system calls cut short (EINTR)."""
    import signal
    from ringd.host import sidethread
    blocked = []

    def record():
        with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
            blocked.extend(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    sidethread.start(record, name="probe").join(10)
    assert blocked and all(blocked[0] >> (sig - 1) & 1 for sig in
                           (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGCHLD))
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & {signal.SIGTERM}   # the caller's mask is back


def test_the_schema_objects_are_named_from_the_schema_itself():
    from ringd.journal import schema_pg
    assert {"lease", "runs", "meta", "run_counts", "runs_one_running"} <= schema_pg.RELATIONS
    assert schema_pg.TRIGGERS == {"runs_closed", "runs_inserted_closed", "runs_terminal_is_final",
                                  "quota_use_added", "quota_use_changed"}
    assert schema_pg.FUNCTIONS == {"ring_count_closed_run", "ring_terminal_is_final", "ring_count_quota_use"}
    assert schema_pg.missing(schema_pg.OBJECTS) == frozenset()
    assert schema_pg.missing(schema_pg.OBJECTS - {"lease", "runs_closed"}) == {"lease", "runs_closed"}


@pytest.mark.parametrize("damage, named", [
    ("DROP TABLE lease", ["lease"]),
    ("DROP TRIGGER runs_closed ON runs", ["runs_closed"]),
    ("ALTER TABLE runs DISABLE TRIGGER runs_terminal_is_final", ["runs_terminal_is_final"]),
    ("DROP FUNCTION ring_count_closed_run() CASCADE", ["ring_count_closed_run", "runs_closed",
                                                       "runs_inserted_closed"]),
    ("DROP TABLE run_counts", ["run_counts"]),
    ("DROP INDEX runs_one_running", ["runs_one_running"]),
    ("DROP TRIGGER quota_use_changed ON quota_use", ["quota_use_changed"]),
    ("DELETE FROM meta WHERE key = 'schema_version'", []),
])
def test_a_schema_object_dropped_by_hand_is_made_again_at_connect(pgj, pg_dsn, damage, named):
    """The journal's version mark alone decided whether the schema was there:
    a lease table dropped by hand kept every driver standing by for good ("cannot
    reach the journal"), a dropped trigger silently stopped the counters or let a
    final status change, a dropped run_counts failed every run's end. What is
    missing is made again under the migration lock (as SQLite's journal does),
    and named; the guarantees hold again."""
    import psycopg
    first = pgj()
    assert first.repaired == []                    # a new journal is no news
    with psycopg.connect(pg_dsn, autocommit=True) as con:
        con.execute(damage)
    j = pgj()
    assert j.repaired == named
    with psycopg.connect(pg_dsn, autocommit=True) as con:
        con.execute("INSERT INTO runs (agent, status, started_at, ended_at, duration)"
                    " VALUES ('x', 'ok', 0, 1, 1)")
        assert con.execute("SELECT n FROM run_counts WHERE agent = 'x'").fetchone() == (1,)
        with pytest.raises(psycopg.errors.IntegrityConstraintViolation):
            con.execute("UPDATE runs SET status = 'failed' WHERE agent = 'x'")
        con.execute("INSERT INTO runs (agent, status, started_at) VALUES ('y', 'running', 0)")
        with pytest.raises(psycopg.errors.UniqueViolation):
            con.execute("INSERT INTO runs (agent, status, started_at) VALUES ('z', 'running', 0)")
    assert pgj().repaired == []                     # made once: the next connect finds it all


def test_a_lease_table_dropped_under_a_leader_is_made_again_held_for_one_ttl(pgj, pg_dsn):
    """Made again free, the lease would go to the next driver at once while the
    one that led may still run its agent (until its half-TTL switch): it is
    held by nobody for one TTL, as a deleted row is."""
    import psycopg
    from ringd.journal.pg import Fenced
    a = pgj()
    assert a.acquire("A", 30).action == TAKE
    with psycopg.connect(pg_dsn, autocommit=True) as con:
        con.execute("DROP TABLE lease")
    from ringd.journal.pg import PgJournal
    b = PgJournal.connect(pg_dsn, ttl=5.0)   # (held by nobody 5 s: room for a loaded box to ask)
    try:
        assert b.repaired == ["lease"]
        assert b.acquire("B", 5.0).action == WAIT       # nobody's to take yet
        with pytest.raises(Fenced):
            a.set_meta("k", "A after its lease went")
        d = wait_until(lambda: (d := b.acquire("B", 5)).action == TAKE and d, timeout=20,
                       message="the remade lease lapsing")
        assert d.previous is not None and "nobody" in d.previous
        b.set_meta("k", "B leads")
    finally:
        b.close()


@pytest.mark.parametrize("dsn, fine", [
    ("postgresql://ring:p%40ss@db.example/ring", True),                   # an '@' encoded
    ("postgresql://ring@/ring?host=/var/run/postgresql", True),           # a unix socket
    ("postgresql://%2Fvar%2Frun%2Fpostgresql/ring", True),
    ("postgresql://db1:5432,db2:5433/ring?target_session_attrs=read-write", True),   # several hosts
    ("postgresql://db/ring?options=-c%20statement_timeout%3D0", True),
    ("postgresql://db/ring?options=-c statement_timeout=0", False),       # '=' and space as written
    ("postgresql://db/ring?bogus=1", False),
    ("postgresql://ring:p@ss@db.example/ring", False),                    # libpq: host 'ss@db.example'
    ("postgresql://ring:s3cr%ZZet@db/ring", False),
])
def test_a_journal_uri_libpq_cannot_use_is_a_configuration_error(dsn, fine):
    """`ringd check` said ok and every `ringd run` exited 69 (an outage: restarted
    for ever) on a URI libpq refuses to read; now both say so, 78, one line,
    never the password."""
    pytest.importorskip("psycopg")
    from ringd.inputs.config import ConfigError, dsn_problem, parse_config
    assert (dsn_problem(dsn) is None) == fine, dsn_problem(dsn)
    if not fine:
        with pytest.raises(ConfigError) as e:
            parse_config({"ring": {"journal": dsn}})
        said = str(e.value)
        assert said.startswith("ring.journal: ") and "\n" not in said
        for secret in ("p@ss", "ss@", "s3cr"):
            assert secret not in said, said


def test_a_password_with_an_unencoded_at_is_never_shown_in_part():
    from ringd.core.dsn import redact
    assert redact("postgresql://ring:p@ss@db.example/ring") == "postgresql://ring:***@db.example/ring"
    assert redact("postgresql://ring:pw@db1:5432,db2/ring") == "postgresql://ring:***@db1:5432,db2/ring"
    assert redact("postgresql://db1:5432,db2:5433/ring") == "postgresql://db1:5432,db2:5433/ring"


def test_check_and_run_refuse_a_journal_uri_libpq_cannot_read(tmp_path):
    pytest.importorskip("psycopg")
    from conftest import Ring
    r = Ring(tmp_path)
    try:
        r.write_config(ring={"journal": "postgresql://db/ring?options=-c statement_timeout=0"})
        r.roster("a /bin/true")
        for args in (("check",), ("run", "--once")):
            res = r.cli(*args, timeout=60)
            assert res.returncode == 78, (args, res.returncode, res.stderr)
            assert "ring.journal" in res.stderr and "Traceback" not in res.stderr, res.stderr
    finally:
        r.cleanup()


# --- the second round: sessions a pooler shares, connections the server closed, tables dropped while running ---

def _setting(raw, name):
    return raw.execute(f"SHOW {name}").fetchone()[0]


def test_no_session_setting_outlives_a_transaction(pg_dsn):
    """Behind a transaction-mode pooler (pgbouncer) a session SET stays on the
    server connection for the next client: a reader's read-only made the
    driver's writes fail. Every setting of ours is scoped to its transaction
    (BEGIN READ ONLY, SET LOCAL), and the session keeps the server's defaults."""
    from ringd.journal.pg import PgJournal
    from ringd.journal.pgcall import call_bound
    w = PgJournal.connect(pg_dsn, ttl=30)
    r = PgJournal.connect(pg_dsn, readonly=True, ttl=30)
    try:
        w.acquire("A", 30)
        w.set_meta("k", "v")
        assert r.meta("k") == "v" and r.history() == [] and r.running_row() is None
        with r.snapshot() as tx:
            assert _setting(tx.con, "transaction_read_only") == "on"
        with w.transaction() as tx:
            assert _setting(tx.con, "transaction_read_only") == "off"
            assert _setting(tx.con, "statement_timeout") == f"{call_bound(30):g}s"
        for j in (w, r):
            raw = j.con.pg   # the session itself, past every transaction of ours
            assert _setting(raw, "default_transaction_read_only") == "off"
            for name in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout"):
                assert _setting(raw, name) == "0", name
        assert _setting(r.con, "transaction_read_only") == "on"   # a reader's statement alone, too
    finally:
        w.close()
        r.close()


def test_a_connection_the_server_closed_while_idle_is_no_verdict(pgj, pg_dsn):
    """pg_terminate_backend, or the server's idle_session_timeout, closes the
    connection between two beats: the next renewal failed ("cannot reach the
    journal") though the server answered at once. A connection the server may
    have closed is checked before it is trusted, and made again."""
    import psycopg
    a = pgj()
    assert a.acquire("A", 30).action == TAKE

    def backend():
        return a.con.pg.execute("SELECT pg_backend_pid()").fetchone()[0]

    def gone(pid):
        with psycopg.connect(pg_dsn, autocommit=True) as con:
            return not con.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    old = backend()
    with psycopg.connect(pg_dsn, autocommit=True) as con:
        con.execute("SELECT pg_terminate_backend(%s)", (old,))
    wait_until(lambda: gone(old), timeout=5, message="the terminated server process gone")
    assert a.acquire("A", 30).action == RENEW
    old = backend()
    a.con.pg.execute("SET idle_session_timeout = 100")   # (the server's, on this session only)
    wait_until(lambda: gone(old), timeout=5, message="the idle session closed by the server")
    assert a.acquire("A", 30).action == RENEW
    a.set_meta("k", "still leading")
    assert a.meta("k") == "still leading"


def test_a_lease_table_dropped_under_a_running_leader_is_made_again_and_it_goes_on(pg_dsn):
    """DROP TABLE lease while a driver leads: every beat failed on the missing
    table ("cannot reach the journal"); the leader stopped at its switch and
    stood by for good. The beat makes the table again; the leader, its own
    lease still good on the server's clock, takes the new row at once."""
    from ringd.journal.pg import PgJournal
    import psycopg
    a = PgJournal.connect(pg_dsn, ttl=30)
    b = PgJournal.connect(pg_dsn, ttl=30)
    try:
        assert a.acquire("A", 30).action == TAKE
        with psycopg.connect(pg_dsn, autocommit=True) as con:
            con.execute("DROP TABLE lease")
        d = a.acquire("A", 30)
        assert (d.action, d.epoch) == (TAKE, 2) and a.take_repaired() == ["lease"]
        a.set_meta("k", "A goes on")
        assert b.acquire("B", 30).action == WAIT
    finally:
        a.close()
        b.close()


def test_a_table_dropped_under_a_running_driver_is_made_again_at_the_write_that_meets_it(pg_dsn):
    """Only start-up looked for missing tables: one dropped under a running
    driver failed every write that needed it for as long as the driver lived.
    The write that meets the hole makes it again; the next one works."""
    from ringd.journal.pg import PgJournal
    from ringd.journal.sqlite import JournalError
    import psycopg
    a = PgJournal.connect(pg_dsn, ttl=30)
    try:
        assert a.acquire("A", 30).action == TAKE
        with psycopg.connect(pg_dsn, autocommit=True) as con:
            con.execute("DROP TABLE meta")
        with pytest.raises(JournalError):
            a.set_meta("k", "v")
        assert a.take_repaired() == ["meta"]
        a.set_meta("k", "v")
        assert a.meta("k") == "v"
    finally:
        a.close()
