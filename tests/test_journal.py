"""The journal's schema enforces the SPEC's invariants by itself."""
import os
import sqlite3
import stat
import time

import pytest

from ringd.journal import Journal, JournalError, journal_path


@pytest.fixture
def journal(tmp_path):
    j = Journal.open(tmp_path)
    yield j
    j.close()


def raw(tmp_path):
    con = sqlite3.connect(journal_path(tmp_path), isolation_level=None)
    return con


def test_file_is_private_and_wal(tmp_path, journal):
    assert stat.S_IMODE(os.stat(journal_path(tmp_path)).st_mode) == 0o600
    assert raw(tmp_path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


# The schema's refusals (CHECKs, one running row) are tested on both backends
# in tests/test_journal_backends.py.


def start(journal, agent="a"):
    with journal.transaction() as tx:
        return tx.start_run(agent, 0, now=time.time(), run_budget=1, stall_threshold=2,
                            driver_pid=1, driver_start=1.0)


def close(journal, rid, status, source="driver", **kw):
    with journal.transaction() as tx:
        return tx.close_run(rid, status, source=source, now=time.time(), **kw)


def test_guarded_close_never_clobbers(tmp_path, journal):
    rid = start(journal)
    assert close(journal, rid, "interrupted", source="operator", reason="stuck")
    assert not close(journal, rid, "ok", exit_code=0)
    row = journal.run(rid)
    assert row.status == "interrupted" and row.exit_code is None
    with pytest.raises(sqlite3.IntegrityError):
        raw(tmp_path).execute("UPDATE runs SET status = 'ok' WHERE id = ?", (rid,))
    kinds = [(r[0], r[1]) for r in raw(tmp_path).execute("SELECT kind, source FROM events ORDER BY id")]
    assert kinds == [("started", "driver"), ("interrupted", "operator")]


def test_counters_follow_runs(journal):
    for status in ("ok", "ok", "failed"):
        close(journal, start(journal), status)
    with journal.transaction() as tx:
        tx.add_skipped("a", 0, "operator requested skip", "operator", time.time())
    assert journal.run_counts() == {"a": {"ok": 2, "failed": 1, "skipped": 1}}
    assert journal.agent_state("a").runs == 4


def test_a_transaction_commits_all_or_nothing(journal):
    with pytest.raises(RuntimeError):
        with journal.transaction() as tx:
            tx.put_agent(tx.agent("a").with_(consecutive_failures=3))
            raise RuntimeError("the caller changed its mind")
    assert journal.agent_state("a").consecutive_failures == 0
    rid = start(journal)
    with pytest.raises(JournalError) as e:   # a second running row: the schema refuses it
        start(journal, "b")
    assert e.value.transient
    assert journal.running_row().id == rid


def test_corrupt_journal_is_refused_and_left_in_place(tmp_path):
    p = journal_path(tmp_path)
    p.write_bytes(b"this is not a database" * 10)
    with pytest.raises(JournalError) as e:
        Journal.open(tmp_path)
    assert "not a valid SQLite database" in str(e.value)
    assert p.read_bytes().startswith(b"this is not")


def test_truncated_journal_is_refused(tmp_path):
    j = Journal.open(tmp_path)
    start(j)
    j.close()
    p = journal_path(tmp_path)
    for suffix in ("-wal", "-shm"):
        if os.path.exists(f"{p}{suffix}"):
            os.unlink(f"{p}{suffix}")
    data = p.read_bytes()
    p.write_bytes(data[:50])
    with pytest.raises(JournalError):
        Journal.open(tmp_path)
    assert p.stat().st_size == 50
