"""Quota use in the journal, on both backends (SQLite and a real PostgreSQL):
kept with its run, read back per pool in one statement, counted for the
metrics by the database itself, kept by retention while inside a window, and
added to a journal made before quotas existed."""
import time

from test_journal_backends import backend, start  # noqa: F401 - the two-backend fixture

from ringd.core.quota import Exhausted
from ringd.journal.schema_sqlite import SCHEMA_VERSION


def ended(j, agent="a", uses=(), now=None):
    """A closed run of ``agent`` that reported ``uses`` [(pool, units, at)]."""
    rid = start(j, agent)
    with j.transaction() as tx:
        for pool, units, at in uses:
            tx.put_use(rid, pool, agent, units, at)
        tx.close_run(rid, "ok", source="driver", exit_code=0, now=now or time.time())
    return rid


def test_use_is_kept_with_its_run_and_read_back_per_window(backend):
    j = backend.journal
    t = time.time()
    r1 = ended(j, "a", [("model", 30, t - 100)])
    r2 = ended(j, "b", [("model", 40, t - 5), ("api", 3, t - 5)])
    with j.transaction() as tx:
        tx.put_use(r2, "model", "b", 45, t - 4)          # a later report of the same run wins
        tx.set_exhausted("api", Exhausted(t - 4, t + 60))
    uses, exhausted = j.quota_use({"model": 10.0, "api": 10.0}, t)
    assert uses == {"model": [(t - 4, 45)], "api": [(t - 5, 3)]}
    assert exhausted == {"api": [Exhausted(t - 4, t + 60)]}
    uses, _ = j.quota_use({"model": 1000.0}, t)
    assert uses == {"model": [(t - 100, 75)]}
    assert j.used_by_runs([r1, r2, 999]) == {r1: {"model": 30}, r2: {"model": 45, "api": 3}}
    assert j.quota_spent() == {("model", "a"): 30, ("model", "b"): 45, ("api", "b"): 3}


def test_retention_never_deletes_use_still_inside_a_window(backend):
    """keep_runs 2 of 8 runs: the oldest go, with their events and use, but for
    those whose use was reported inside the window; the spent counters stay."""
    j = backend.journal
    t = time.time()
    ids = [ended(j, "a", [("model", 10, t - 1000 + k)]) for k in range(4)]      # outside a 60 s window
    ids += [ended(j, "a", [("model", 10, t - 30 + k)]) for k in range(2)]       # inside it
    ids += [ended(j, "a") for _ in range(2)]                                     # no use
    spent = j.quota_spent()
    while j.prune(2, batch=3, keep_use_after=t - 60):
        pass
    kept = [r[0] for r in backend.raw_exec("SELECT id FROM runs ORDER BY id")]
    assert kept == ids[4:]
    assert sorted(r[0] for r in backend.raw_exec("SELECT run_id FROM quota_use")) == ids[4:6]
    assert backend.raw_exec("SELECT count(*) FROM events WHERE run_id < ?", (ids[4],)) == [(0,)]
    assert j.quota_spent() == spent == {("model", "a"): 60}
    while j.prune(2, batch=3):   # (no pool any more: nothing held back)
        pass
    assert [r[0] for r in backend.raw_exec("SELECT id FROM runs ORDER BY id")] == ids[6:]


def test_a_journal_from_before_quotas_gets_them(backend):
    """A journal of schema 3 (no quota tables) is brought to this ring's at a
    writer's open, its runs kept."""
    j = backend.journal
    rid = ended(j, "a")
    for obj in ("quota_use", "quota_spent"):
        backend.raw_exec(f"DROP TABLE {obj}")
    backend.raw_exec("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    j2 = backend.reopen()
    try:
        assert backend.raw_exec("SELECT value FROM meta WHERE key = 'schema_version'") == [(str(SCHEMA_VERSION),)]
        with j2.transaction() as tx:
            tx.put_use(rid, "model", "a", 5, time.time())
        assert j2.quota_spent() == {("model", "a"): 5} and j2.knows_quotas()
        assert [r[0] for r in backend.raw_exec("SELECT id FROM runs")] == [rid]
    finally:
        j2.close()


def test_status_reads_a_journal_an_older_driver_still_writes(tmp_path):
    """The ring upgraded, its driver not restarted yet: the journal has no
    quota tables, and ``ringd status`` with a config that has pools says so
    much (nothing used), never an error."""
    from ringd.cli.status import gather_status
    from ringd.inputs.config import parse_config
    from ringd.journal.sqlite import Journal
    j = Journal.open(tmp_path)
    ended(j, "a")
    j.con.execute("DROP TABLE quota_use")
    j.con.execute("DROP TABLE quota_spent")
    j.close()
    (tmp_path / "ring.txt").write_text("a /bin/true\n")
    (tmp_path / "ring.txt").chmod(0o600)
    config = parse_config({"quotas": {"model": {"limit": 10, "window": 60}}, "agents": {"a": {"quota": "model"}}})
    doc = gather_status(tmp_path, config)
    assert doc["quotas"][0]["used"] == 0 and doc["quotas"][0]["left"] == 10
    reader = Journal.open_readonly(tmp_path)
    try:
        assert reader.knows_quotas() is False
    finally:
        reader.close()
