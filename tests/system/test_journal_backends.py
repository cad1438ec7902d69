"""One journal test suite, two backends: SQLite (the embedded default) and
PostgreSQL (a real server, see pgcluster). The schema itself enforces the
SPEC's invariants; the transitions behave alike on both."""
import sqlite3
import time

import pytest

from ringd.journal.sqlite import Journal, JournalError


class Backend:
    """An opened journal plus a second, raw connection that bypasses it."""

    def __init__(self, name, journal, raw_exec, integrity_error, reopen):
        self.name, self.journal = name, journal
        self.raw_exec, self.integrity_error = raw_exec, integrity_error
        self.reopen = reopen   # a writer's open of the same journal, as the next driver's


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request, tmp_path):
    if request.param == "sqlite":
        j = Journal.open(tmp_path)
        con = sqlite3.connect(tmp_path / "journal.db", isolation_level=None)
        yield Backend("sqlite", j, lambda sql, params=(): con.execute(sql, params).fetchall(),
                      sqlite3.IntegrityError, lambda: Journal.open(tmp_path))
        con.close()
        j.close()
    else:
        import psycopg
        from ringd.journal.pg import PgJournal
        dsn = request.getfixturevalue("pg_cluster").fresh_dsn()
        j = PgJournal.connect(dsn)
        con = psycopg.connect(dsn, autocommit=True)

        def raw_exec(sql, params=()):
            cur = con.execute(sql.replace("?", "%s"), params)
            return cur.fetchall() if cur.description else []
        yield Backend("postgresql", j, raw_exec, psycopg.IntegrityError, lambda: PgJournal.connect(dsn))
        con.close()
        j.close()


def start(j, agent="a", position=0):
    with j.transaction() as tx:
        return tx.start_run(agent, position, now=time.time(), run_budget=1, stall_threshold=2,
                            driver_pid=1, driver_start=1.0)


def close(j, rid, status, source="driver", **kw):
    with j.transaction() as tx:
        return tx.close_run(rid, status, source=source, now=time.time(), **kw)


@pytest.mark.parametrize("sql", [
    # unknown status
    "INSERT INTO runs(agent, status, started_at) VALUES ('a', 'bogus', 1)",
    # NULL status
    "INSERT INTO runs(agent, status, started_at) VALUES ('a', NULL, 1)",
    # running with an end time / exit code / duration
    "INSERT INTO runs(agent, status, started_at, ended_at) VALUES ('a', 'running', 1, 2)",
    "INSERT INTO runs(agent, status, started_at, exit_code) VALUES ('a', 'running', 1, 0)",
    "INSERT INTO runs(agent, status, started_at, duration) VALUES ('a', 'running', 1, 0)",
    # terminal without end time or duration, or with a negative duration
    "INSERT INTO runs(agent, status, started_at, duration) VALUES ('a', 'ok', 1, 1)",
    "INSERT INTO runs(agent, status, started_at, ended_at) VALUES ('a', 'ok', 1, 2)",
    "INSERT INTO runs(agent, status, started_at, ended_at, duration) VALUES ('a', 'ok', 1, 2, -1)",
    "INSERT INTO runs(agent, status, started_at, ended_at, duration) VALUES ('a', 'ok', 5, 2, 0)",
    # an event with an unknown source
    "INSERT INTO events(at, kind, source) VALUES (1, 'x', 'cron')",
    # counters never negative
    "INSERT INTO agents(name, runs) VALUES ('a', -1)",
])
def test_incoherent_rows_are_refused(backend, sql):
    with pytest.raises(backend.integrity_error):
        backend.raw_exec(sql)


def test_at_most_one_running_row(backend):
    backend.raw_exec("INSERT INTO runs(agent, status, started_at) VALUES ('a', 'running', 1)")
    with pytest.raises(backend.integrity_error):
        backend.raw_exec("INSERT INTO runs(agent, status, started_at) VALUES ('b', 'running', 2)")


def test_a_second_start_is_refused_through_the_journal_too(backend):
    start(backend.journal, "a")
    with pytest.raises(JournalError) as e:   # one error type, whatever the backend
        start(backend.journal, "b")
    assert e.value.transient
    assert backend.journal.running_row().agent == "a"


def test_guarded_close_never_clobbers(backend):
    j = backend.journal
    rid = start(j)
    assert close(j, rid, "interrupted", source="operator", reason="stuck")
    assert not close(j, rid, "ok", exit_code=0)
    row = j.run(rid)
    assert row.status == "interrupted" and row.exit_code is None and row.reason == "stuck"
    kinds = [(r[0], r[1]) for r in j.con.execute("SELECT kind, source FROM events ORDER BY id")]
    assert kinds == [("started", "driver"), ("interrupted", "operator")]


@pytest.mark.parametrize("new", ["ok", "running", "interrupted"])
def test_final_statuses_are_final_whoever_writes(backend, new):
    rid = start(backend.journal)
    close(backend.journal, rid, "failed", exit_code=3)
    with pytest.raises(Exception) as e:
        backend.raw_exec("UPDATE runs SET status = ? WHERE id = ?", (new, rid))
    assert "cannot change status" in str(e.value)
    assert backend.journal.run(rid).status == "failed"


def test_counters_follow_runs(backend):
    j = backend.journal
    for status in ("ok", "ok", "failed"):
        close(j, start(j), status)
    with j.transaction() as tx:
        tx.add_skipped("a", 0, "operator requested skip", "operator", time.time())
    assert j.run_counts() == {"a": {"ok": 2, "failed": 1, "skipped": 1}}
    assert j.agent_state("a").runs == 4
    assert j.agent_state("a").last_run_id == j.last_run().id


def test_counters_are_kept_by_the_database_not_the_journal_code(backend):
    backend.raw_exec("INSERT INTO runs(agent, status, started_at, ended_at, duration) "
                     "VALUES ('z', 'ok', 1, 2, 1)")
    assert backend.journal.run_counts() == {"z": {"ok": 1}}
    assert backend.journal.agent_state("z").runs == 1


def test_closing_settles_the_agent_and_quarantine_writes_its_row(backend):
    from ringd.core.settings import RingSettings
    from ringd.journal.transitions import close_in
    j = backend.journal
    ring = RingSettings(quarantine_after=1, quarantine_cooloff=100)
    rid = start(j)
    with j.transaction() as tx:
        closed = close_in(tx, rid, "a", 0, "stalled", source="driver", now=time.time(), ring=ring,
                          reason="no exit")
    assert closed.settled.entered_quarantine and closed.settled.state.bad_streak == 1
    last = j.last_run()
    assert last.status == "skipped" and "quarantined" in last.reason
    assert j.agent_state("a").quarantined_until == closed.settled.state.quarantined_until
    kinds = [r["kind"] for r in j.con.execute("SELECT kind FROM events ORDER BY id")]
    assert kinds == ["started", "stalled", "quarantined"]


def test_process_skip_request_and_meta(backend):
    j = backend.journal
    rid = start(j)
    with j.transaction() as tx:
        tx.set_process(rid, 4242, 12.5, "/x/1.log")
    row = j.running_row()
    assert (row.pid, row.pid_start, row.log_path) == (4242, 12.5, "/x/1.log")
    from ringd.journal.transitions import request_skip, skip_requested_for
    assert request_skip(j, None, rid, time.time()).run_id == rid and skip_requested_for(j, rid)
    assert request_skip(j, "b", None, time.time()).run_id is None
    assert j.agent_state("b").skip_requested
    j.set_meta("roster_error", "bad line")
    assert j.meta("roster_error") == "bad line"
    j.set_meta("roster_error", None)
    assert j.meta("roster_error") is None


def test_history_is_newest_first_and_by_agent(backend):
    j = backend.journal
    for name in ("a", "b", "a"):
        close(j, start(j, name), "ok", exit_code=0)
    assert [r.agent for r in j.history()] == ["a", "b", "a"]
    assert [r.id for r in j.history("a", limit=1)] == [j.last_run_of("a").id]
    assert set(j.agent_states()) == {"a", "b"}


def test_a_failed_transaction_leaves_nothing_behind(backend):
    j = backend.journal
    with pytest.raises(RuntimeError):
        with j.write() as con:
            con.execute("INSERT INTO meta(key, value) VALUES ('half', 'done')")
            raise RuntimeError("caller changed its mind")
    assert j.meta("half") is None
    j.set_meta("after", "ok")  # the connection is usable again
    assert j.meta("after") == "ok"


def test_an_older_journal_is_upgraded_and_a_newer_one_is_refused_untouched(backend):
    """A journal a newer ring wrote is never marked with our older version (nor
    written at all): the writer's open refuses it in one line; an older one is
    brought up to ours."""
    from ringd.journal.schema_sqlite import SCHEMA_VERSION
    version = "SELECT value FROM meta WHERE key = 'schema_version'"
    backend.raw_exec("UPDATE meta SET value = ? WHERE key = 'schema_version'", ("1",))
    backend.reopen().close()
    assert backend.raw_exec(version) == [(str(SCHEMA_VERSION),)]
    for newer in (str(SCHEMA_VERSION + 1), "4.1", "x"):
        backend.raw_exec("UPDATE meta SET value = ? WHERE key = 'schema_version'", (newer,))
        with pytest.raises(JournalError) as e:
            backend.reopen()
        message = str(e.value)
        assert f"schema version {newer} " in message and "newer ring" in message and "\n" not in message
        assert backend.raw_exec(version) == [(newer,)]


def test_both_schemas_have_the_same_tables_and_columns(tmp_path, pg_cluster):
    """A column added to one backend only would break the other at its first
    use: the schemas must describe the same journal (the lease is PostgreSQL's own)."""
    import psycopg
    from ringd.journal.pg import PgJournal
    sq = Journal.open(tmp_path)
    try:
        tables = [r[0] for r in sq.con.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
        sqlite_cols = {t: [r[1] for r in sq.con.execute(f"PRAGMA table_info({t})")] for t in tables}
    finally:
        sq.close()
    dsn = pg_cluster.fresh_dsn()
    PgJournal.connect(dsn).close()
    with psycopg.connect(dsn) as con:
        rows = con.execute("SELECT table_name, column_name FROM information_schema.columns "
                           "WHERE table_schema = current_schema() ORDER BY table_name, ordinal_position").fetchall()
    pg_cols = {}
    for t, c in rows:
        pg_cols.setdefault(t, []).append(c)
    assert pg_cols.pop("lease")
    assert pg_cols == sqlite_cols


def test_operator_controls_and_retention(backend):
    """pause/next (kept in meta) and prune behave alike on both backends."""
    j = backend.journal

    def pauses():   # the controls as the driver's turn reads them
        with j.transaction() as tx:
            c = tx.controls()
        return c.ring_paused, sorted(c.paused)

    def take_next():   # ... and takes a ``next`` request
        with j.transaction() as tx:
            return tx.take_next(tx.controls())

    assert pauses() == (False, [])
    assert j.set_paused(None, True) and not j.set_paused(None, True)
    assert j.set_paused("b", True)
    assert pauses() == (True, ["b"])
    assert j.set_paused(None, False) and pauses() == (False, ["b"])
    assert j.request_next("a") is None and j.request_next("b") == "a"
    assert take_next() == "b" and take_next() is None
    for i in range(12):
        rid = start(j, "a" if i % 2 else "b", i % 2)
        with j.transaction() as tx:
            tx.close_run(rid, "ok", source="driver", exit_code=0, now=time.time())
    runs = {a: s.runs for a, s in j.agent_states().items()}
    gone = 0
    while True:
        n = j.prune(5, batch=3)
        if not n:
            break
        gone += n
    assert gone == 7
    assert [r[0] for r in backend.raw_exec("SELECT count(*) FROM runs")] == [5]
    assert {a: s.runs for a, s in j.agent_states().items()} == runs


# --- round 2: who asked, and since when an agent has been quiet ------------------------------------

ALICE = {"user": "root", "uid": 0, "sudo_user": "alice", "tty": "/dev/pts/1", "ssh_client": None}


def test_events_keep_agent_actor_and_reason_and_are_read_back_alike(backend):
    """An operator's event keeps who asked and why; a force-failed run's closing
    event too, and a run an operator skipped gets its request's (history's
    ``actor``); the trail is read newest first, by agent."""
    j = backend.journal
    from ringd.journal import transitions
    from ringd.core.settings import RingSettings
    assert j.set_paused("b", True, actor=ALICE, reason="b's API is down")
    rid = start(j, "a")
    transitions.request_skip(j, "a", None, time.time(), actor=ALICE, reason="hung")
    with j.transaction() as tx:
        transitions.close_in(tx, rid, "a", 0, "skipped", source="operator", now=time.time(), ring=RingSettings(),
                             reason="skipped by operator")
    forced = start(j, "a")
    row = j.run(forced)
    transitions.close_row(j, row, "interrupted", source="operator", now=time.time(), ring=RingSettings(),
                          reason="forced by operator: wedged", actor=ALICE, operator_reason="wedged")
    assert j.closing_actors([rid, forced]) == {rid: ALICE, forced: ALICE}
    assert j.run(rid).reason == "skipped by operator: hung"
    trail = j.events_before(None, None, 100)
    assert [e.kind for e in trail] == ["interrupted", "started", "skipped", "skip-requested", "started", "paused"]
    assert [e.id for e in trail] == sorted((e.id for e in trail), reverse=True)
    paused = trail[-1]
    assert (paused.agent, paused.actor, paused.reason, paused.run_id) == ("b", ALICE, "b's API is down", None)
    assert {e.agent for e in j.events_before(None, "a", 100)} == {"a"}
    assert [e.kind for e in j.events_before(None, "b", 100)] == ["paused"]
    assert len(j.events_before(trail[2].id, None, 2)) == 2 and j.events_before(trail[2].id, None, 2)[0].id < trail[2].id


def test_the_last_ok_run_and_the_join_are_kept_by_the_journal(backend):
    """agents.last_ok_at follows every ok run (a trigger: inserted or closed ok),
    never another ending; joined_at is set by the roster the driver runs and
    cleared when an agent leaves it."""
    j = backend.journal
    t0 = time.time()
    with j.transaction() as tx:
        tx.note_roster(["a", "b"], t0)
    rid = start(j, "a")
    close(j, rid, "ok", exit_code=0)
    ok_end = j.run(rid).ended_at
    rid2 = start(j, "a")
    close(j, rid2, "failed", exit_code=1)
    st = j.agent_states()
    assert st["a"].last_ok_at == ok_end and st["a"].joined_at == t0
    assert st["b"].last_ok_at is None and st["b"].joined_at == t0 and st["b"].runs == 0
    backend.raw_exec("INSERT INTO runs(agent, status, started_at, ended_at, duration) VALUES ('b', 'ok', 5, 6, 1)")
    assert j.agent_state("b").last_ok_at == 6
    with j.transaction() as tx:
        tx.note_roster(["a"], t0 + 10)           # b leaves the roster
    assert j.agent_state("b").joined_at is None and j.agent_state("a").joined_at == t0
    with j.transaction() as tx:
        tx.note_roster(["a", "b"], t0 + 20)      # ... and joins again: from now
    assert j.agent_state("b").joined_at == t0 + 20


def _as_version_3(backend):
    """The journal as a ring of schema version 3 left it: no events.agent/actor/
    reason, no agents.last_ok_at/joined_at (and, in PostgreSQL, its counting
    function without the last ok run)."""
    drops = [("events", "agent"), ("events", "actor"), ("events", "reason"),
             ("agents", "last_ok_at"), ("agents", "joined_at")]
    if backend.name == "sqlite":
        backend.raw_exec("DROP TRIGGER runs_closed_ok")
        backend.raw_exec("DROP TRIGGER runs_inserted_ok")
    else:
        backend.raw_exec("""CREATE OR REPLACE FUNCTION ring_count_closed_run() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO run_counts (agent, status, n) VALUES (NEW.agent, NEW.status, 1)
        ON CONFLICT (agent, status) DO UPDATE SET n = run_counts.n + 1;
    INSERT INTO agents (name, runs, last_run_id) VALUES (NEW.agent, 1, NEW.id)
        ON CONFLICT (name) DO UPDATE SET runs = agents.runs + 1, last_run_id = NEW.id;
    RETURN NULL;
END $$""")
    for table, column in drops:
        backend.raw_exec(f"ALTER TABLE {table} DROP COLUMN {column}")
    backend.raw_exec("UPDATE meta SET value = '3' WHERE key = 'schema_version'")


def test_a_version_3_journal_is_upgraded_with_its_last_ok_runs_filled_in(backend):
    """Upgraded in place by the ordinary migration: the new columns added, each
    agent's last ok run filled in from its history (and counted as on the
    roster since), old events read with their agent taken from their run or
    their detail; a reader before the upgrade reads the old shape."""
    j = backend.journal
    rid = start(j, "a")
    close(j, rid, "ok", exit_code=0)
    rid2 = start(j, "b")
    close(j, rid2, "failed", exit_code=1)
    ended = j.run(rid).ended_at
    _as_version_3(backend)
    backend.raw_exec("INSERT INTO events(at, run_id, kind, source, detail) VALUES (?, NULL, 'paused', 'operator', "
                     "'agent=b')", (time.time(),))
    # read as a reader reads it (never migrating) before the next driver upgrades it
    assert [e.agent for e in j.events_before(None, "b", 10)] == ["b", "b", "b"]   # paused (its detail), ...
    assert j.events_before(None, None, 10)[0].actor is None and j.closing_actors([rid, rid2]) == {}
    j2 = backend.reopen()
    try:
        st = j2.agent_states()
        assert st["a"].last_ok_at == ended and st["a"].joined_at == ended
        assert st["b"].last_ok_at is None and st["b"].joined_at is None
        assert [e.agent for e in j2.events_before(None, "b", 10)] == ["b", "b", "b"]   # paused (its detail), ...
        rid3 = start(j2, "b")
        close(j2, rid3, "ok", exit_code=0)
        assert j2.agent_state("b").last_ok_at == j2.run(rid3).ended_at   # the counting kept up to date
    finally:
        j2.close()
