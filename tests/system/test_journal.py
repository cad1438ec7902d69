"""The journal's schema enforces the SPEC's invariants by itself."""
import os
import signal
import sqlite3
import stat
import time

import pytest

from ringd.journal.sqlite import Journal, JournalError, journal_path


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
# in tests/system/test_journal_backends.py.


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


def _set_version(tmp_path, version):
    con = raw(tmp_path)
    try:
        con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (version,))
    finally:
        con.close()


def test_a_journal_held_by_another_writer_is_busy_not_unusable(tmp_path):
    """Another process's write transaction outlasting the busy timeout is a
    busy journal (retry), never reported as a damaged one: at the open that
    must upgrade the journal, and at a write."""
    Journal.open(tmp_path).close()
    _set_version(tmp_path, "1")
    holder = sqlite3.connect(str(journal_path(tmp_path)), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(JournalError) as e:
            Journal.open(tmp_path, busy_timeout=0.2)
        assert e.value.transient and "journal is busy" in str(e.value) and "not usable" not in str(e.value)
    finally:
        holder.execute("ROLLBACK")
    Journal.open(tmp_path, busy_timeout=0.2).close()   # upgraded now
    holder.execute("BEGIN EXCLUSIVE")
    try:
        j = Journal.open(tmp_path, busy_timeout=0.2)   # current: the open itself writes nothing
        try:
            with pytest.raises(JournalError) as e:
                j.set_meta("k", "v")
            assert e.value.transient and "journal is busy" in str(e.value) and "not usable" not in str(e.value)
        finally:
            j.close()
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_a_current_journal_is_only_read_at_open_and_a_dropped_guard_is_made_again(tmp_path):
    """A writer's open takes the write lock only when the journal lacks some of
    the schema (it asks under the lock again: see the next test). A guard
    someone dropped is still made again by the next open."""
    Journal.open(tmp_path).close()
    watcher = raw(tmp_path)
    try:
        seen = watcher.execute("PRAGMA data_version").fetchone()[0]
        Journal.open(tmp_path).close()
        assert watcher.execute("PRAGMA data_version").fetchone()[0] == seen
        watcher.execute("DROP TRIGGER runs_terminal_is_final")   # a guard missing: made again
        Journal.open(tmp_path).close()
        assert watcher.execute("SELECT count(*) FROM sqlite_master WHERE name = 'runs_terminal_is_final'"
                               ).fetchone()[0] == 1
    finally:
        watcher.close()


def test_the_version_is_decided_again_under_the_write_lock(tmp_path):
    """The open looks at the version, then upgrades under the write lock. A
    newer ring that upgraded the journal between the two must find its mark
    kept: the upgrade is decided again under the lock, and refused."""
    import threading
    from ringd.journal.schema_sqlite import SCHEMA_VERSION
    Journal.open(tmp_path).close()
    _set_version(tmp_path, str(SCHEMA_VERSION - 1))   # older: an open upgrades it
    asking, outcome = threading.Event(), []

    def open_():   # the journal's connection belongs to the thread that opens it
        try:
            j = Journal.open(tmp_path)
            j.close()
            outcome.append("opened")
        except JournalError as e:
            outcome.append(str(e))
    newer = raw(tmp_path)
    newer.execute("BEGIN IMMEDIATE")
    newer.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    real_connect = sqlite3.connect

    def traced_connect(*args, **kwargs):   # to see the open ask for the write lock
        con = real_connect(*args, **kwargs)
        con.set_trace_callback(lambda sql: "BEGIN IMMEDIATE" in sql and asking.set())
        return con
    t = threading.Thread(target=open_)
    sqlite3.connect = traced_connect
    try:
        t.start()
        assert asking.wait(10), "the open never asked for the write lock"
        newer.execute("COMMIT")   # the newer ring's upgrade lands while the open waits for the lock
        t.join(15)
        assert not t.is_alive()
        assert len(outcome) == 1 and "newer ring" in outcome[0], outcome
        assert newer.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] \
            == str(SCHEMA_VERSION + 1)
    finally:
        sqlite3.connect = real_connect
        if newer.in_transaction:
            newer.execute("ROLLBACK")
        newer.close()
        t.join(15)


def test_a_journal_replaced_under_its_connection_leaves_it_no_write_ahead_log(tmp_path):
    """A backup restored over journal.db while a writer has it open: SQLite
    leaves the old journal's -wal and -shm at the path when a moved database
    is closed, and the restored file took them up as its own - the old
    journal's newer pages read over the backup's. The close removes them."""
    j = Journal.open(tmp_path)
    close(j, start(j), "ok")
    p = journal_path(tmp_path)
    backup = tmp_path / "backup.db"
    dst = sqlite3.connect(backup)
    j.con.backup(dst)
    dst.close()
    for _ in range(3):   # newer pages, in the log only
        close(j, start(j), "failed")
    os.replace(backup, p)
    j.close()
    assert not os.path.exists(f"{p}-wal") and not os.path.exists(f"{p}-shm")
    restored = Journal.open(tmp_path, verify=True)
    try:
        assert [r.status for r in restored.history()] == ["ok"], "the backup, as it was taken"
    finally:
        restored.close()


@pytest.mark.parametrize("suffix", ["-wal", "-shm"])
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_wal_or_shm_that_is_no_regular_file_is_refused_naming_it(tmp_path, kind, suffix):
    """A FIFO, a directory or a symlink at journal.db-wal/-shm failed every open
    or write as "disk I/O error" / "unable to open database file": a transient
    outage (the driver exits 69 and is started again, forever) for what no
    wait mends. Refused (not transient), naming the file, left in place."""
    j = Journal.open(tmp_path)
    close(j, start(j), "ok")
    j.close()
    name = f"{journal_path(tmp_path)}{suffix}"
    if os.path.lexists(name):
        os.unlink(name)
    {"fifo": os.mkfifo, "directory": os.mkdir,
     "symlink": lambda p: os.symlink(tmp_path / "elsewhere", p)}[kind](name)
    for opener in (lambda: Journal.open(tmp_path, verify=True), lambda: Journal.open_readonly(tmp_path)):
        with pytest.raises(JournalError) as e:
            opener().close()
        assert not e.value.transient and name in str(e.value), str(e.value)
    assert os.path.lexists(name) and not (tmp_path / "elsewhere").exists()


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


# --- the write-ahead log, made long at start-up (Journal.preallocate_wal) -------------

CRASH_AFTER_COMMITS = r"""
import os, sys, time
from pathlib import Path
from ringd.journal.sqlite import Journal
j = Journal.open(Path(sys.argv[1]))
j.preallocate_wal()
for i in range(int(sys.argv[2])):
    with j.transaction() as tx:
        rid = tx.start_run(f"a{i}", i, now=time.time(), run_budget=1, stall_threshold=2, driver_pid=1, driver_start=1.0)
        tx.close_run(rid, "ok", source="driver", now=time.time(), exit_code=0)
print(os.path.getsize(sys.argv[1] + "/journal.db-wal"), flush=True)
os._exit(0)   # no close: the log stays, its frames followed by the zeros
"""


def _wal_target(journal):
    con = journal.con
    page, pages = con.execute("PRAGMA page_size").fetchone()[0], con.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
    return 32 + (pages + 16) * (24 + page)


def test_the_log_is_made_as_long_as_it_grows_and_sqlite_reads_past_the_zeros(tmp_path):
    """Zeros are never a valid frame: a driver killed after its commits leaves a log
    of frames then zeros, and the next open recovers exactly the committed rows."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", CRASH_AFTER_COMMITS, str(tmp_path), "40"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    j = Journal.open(tmp_path, verify=True)   # recovery, then quick_check
    try:
        assert int(out.stdout) >= _wal_target(j), "made long at once"
        assert [r.status for r in j.history(limit=100)] == ["ok"] * 40
        con = raw(tmp_path)
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        con.close()
        j.preallocate_wal()   # long enough already: nothing written
        rid = start(j)
        close(j, rid, "ok")
        assert j.run(rid).status == "ok"
    finally:
        j.close()
    assert not os.path.exists(f"{journal_path(tmp_path)}-wal"), "SQLite still removes its log at the last close"


FULL_DISK = r"""
import os, resource, sys
from pathlib import Path
from ringd.journal.sqlite import Journal
j = Journal.open(Path(sys.argv[1]))
wal = sys.argv[1] + "/journal.db-wal"
before = os.path.getsize(wal)
resource.setrlimit(resource.RLIMIT_FSIZE, (before + 100_000, resource.RLIM_INFINITY))   # EFBIG past it
j.preallocate_wal()
print(before, os.path.getsize(wal), flush=True)
"""


def test_a_log_that_cannot_be_made_long_is_left_as_it_was(tmp_path):
    """A file-size limit (as good as a full disk here): the zeros written so far are cut off again."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    assert after == before
    j = Journal.open(tmp_path, verify=True)
    try:
        close(j, start(j), "ok")
    finally:
        j.close()


def test_a_running_driver_has_made_its_log_long(ring):
    import signal as sig
    from conftest import wait_until
    ring.agent("a", "exec sleep 60")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    drv = ring.start_driver()
    try:
        wait_until(lambda: [r for r in ring.runs() if r["status"] == "running"], 20, message="a run started")
        assert os.path.getsize(f"{ring.journal_path}-wal") >= 32 + (1000 + 16) * (24 + 4096)
    finally:
        drv.send_signal(sig.SIGTERM)
        drv.communicate(timeout=30)


def test_a_journal_that_was_there_before_ring_wrote_it_is_made_private(tmp_path):
    """SPEC: the journal is 0600 whatever the umask. An empty journal.db someone
    made 0644 (``: > journal.db`` to start afresh) kept that mode once a writer
    filled it, and SQLite gives its -wal and -shm the journal's mode."""
    path = journal_path(tmp_path)
    path.touch()
    os.chmod(path, 0o644)
    j = Journal.open(tmp_path)
    try:
        with j.transaction() as tx:
            tx.set_meta("x", "1")
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.glob("journal.db*")}
    finally:
        j.close()
    assert modes and set(modes.values()) == {0o600}, modes


# --- the driver's journal under other writers and deleted files -------------------------

def test_an_end_held_back_when_a_stop_comes_while_another_writer_holds_the_lock_is_recorded(ring):
    """An agent exits 0; its end waits to be committed with the next start, and
    that start waits for the write lock a ``sqlite3`` shell holds (BEGIN
    EXCLUSIVE) when a SIGTERM comes. The run was left ``running`` and reaped
    as ``interrupted``. The stopping driver keeps trying for a bounded time:
    the lock let go within it, the row is ``ok``, and the driver exits 0."""
    import psutil
    from conftest import line_written, wait_until
    go, pidfile = ring.base / "go", ring.base / "a.pid"
    ring.agent("a", f"echo $$ > {pidfile}\nwhile [ ! -e {go} ]; do sleep 0.02; done\nexit 0")
    ring.agent("b", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    drv = ring.start_driver()
    pid = int(line_written(pidfile))
    holder = sqlite3.connect(str(ring.journal_path), timeout=10, isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        go.touch()
        wait_until(lambda: not psutil.pid_exists(pid), timeout=10, message="agent a to exit")
        drv.send_signal(signal.SIGTERM)
        err = drv.err_path
        wait_until(lambda: drv.poll() is not None or "before the driver stops" in err.read_text(), timeout=10,
                   message="the driver to wait for the lock to record the end")
        waited = drv.poll() is None
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert drv.wait(timeout=20) == 0
    assert waited, err.read_text()
    assert [(r["agent"], r["status"], r["exit_code"]) for r in ring.runs()] == [("a", "ok", 0)], err.read_text()
    assert "end recorded" in err.read_text()


def _other_process_pauses(state, busy=1.0):
    """Another process (an operator's ``ringd pause``) opens the journal as a
    writer (waiting ``busy`` s at most) and commits; its exit code and stderr."""
    import subprocess
    import sys
    from conftest import REPO
    code = ("import sys; from pathlib import Path; from ringd.journal.sqlite import Journal\n"
            "try:\n    j = Journal.open(Path(sys.argv[1]), busy_timeout=float(sys.argv[2]))\n"
            "except Exception as e:\n    sys.exit(str(e))\n"
            "with j.transaction() as tx:\n    tx.set_meta('paused', 'paused')\nj.close()\n")
    r = subprocess.run([sys.executable, "-c", code, str(state), str(busy)], capture_output=True, text=True,
                       timeout=30, env=dict(os.environ, PYTHONPATH=str(REPO)))
    return r.returncode, r.stderr


@pytest.mark.parametrize("gone", [("-wal", "-shm"), ("-wal",), ("-shm",)], ids="+".join)
@pytest.mark.parametrize("meanwhile", ["nobody", "an-operator-pauses"])
def test_a_connection_whose_wal_was_removed_closes_keeping_what_it_can(tmp_path, gone, meanwhile):
    """``rm journal.db-wal journal.db-shm`` under an open writer: it writes a log
    no other process reads. Its plain close checkpointed that log into
    journal.db and deleted the new one another process had begun by name: an
    operator's pause, committed there, was lost. Another writer (or reader)
    now waits, then is refused (try again), while a process has the journal
    open on a log no longer at the path - with one file gone or both - so no
    second log begins; the writer's close then saves its log into journal.db
    (SQLite's pending byte held), and the pause goes through. Nothing lost,
    the journal sound."""
    j = Journal.open(tmp_path)
    close(j, start(j), "ok")
    j.con.execute("PRAGMA wal_checkpoint(TRUNCATE)")   # (as a running driver's journal: its schema in journal.db)
    for _ in range(3):
        close(j, start(j), "failed")   # (in the log only: no checkpoint since)
    p = journal_path(tmp_path)
    for suffix in gone:
        os.unlink(f"{p}{suffix}")
    assert j.replaced() == f"{p}{gone[0]}"
    if meanwhile == "an-operator-pauses":
        code, err = _other_process_pauses(tmp_path)
        assert code != 0 and "try again" in err, (code, err)
        assert [s for s in gone if os.path.exists(f"{p}{s}")] == [], "the refused writer began a second log"
    fate = j.close()
    if meanwhile == "an-operator-pauses":
        assert _other_process_pauses(tmp_path) == (0, "")   # (the journal is whole again)
    again = Journal.open(tmp_path, verify=True)
    try:
        assert again.con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        statuses = [r.status for r in again.history()][::-1]
        if meanwhile == "an-operator-pauses":
            assert again.meta("paused") == "paused", "the operator's pause was lost"
        assert fate == "saved" and statuses == ["ok", "failed", "failed", "failed"]
    finally:
        again.close()


def test_a_driver_whose_wal_was_removed_hears_a_pause_made_since(ring):
    """journal.db-wal and -shm deleted under a running driver: it kept writing
    to its unlinked log, and `ringd pause` answered "ring paused" while 9 runs
    started in the next 2 s. The driver notices (it compares the files'
    identities at each beat, as it does the lock file's, and when an
    operator's request wakes it), takes up the journal now at the path, and
    reads the pause."""
    from conftest import wait_until
    ring.agent("a", "sleep 0.05")
    ring.agent("b", "sleep 0.05")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")
    drv = ring.start_driver()
    wait_until(lambda: len(ring.runs()) >= 6, timeout=20, message="the ring turning")
    for suffix in ("-wal", "-shm"):
        os.unlink(f"{ring.journal_path}{suffix}")
    paused = ring.cli("pause")
    assert paused.returncode == 0, paused.stderr
    err = drv.err_path
    log = wait_until(lambda: "ring paused by the operator" in err.read_text() and err.read_text(), timeout=10,
                     message="the driver to hear the pause")
    assert "removed or replaced under the driver" in log, log
    at = ring.heartbeat()["at_epoch"]
    wait_until(lambda: (ring.heartbeat() or {}).get("at_epoch", 0) > at + 1.0, timeout=10,
               message="the paused driver beating on for a second")
    after = err.read_text().split("ring paused by the operator", 1)[1]
    assert " started (pid " not in after, after
    assert drv.poll() is None
    con = sqlite3.connect(f"file:{ring.journal_path}?mode=ro", uri=True, timeout=10)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        con.close()
    status = ring.cli("status", "--json")
    assert status.returncode == 0 and "paused" in status.stdout, status.stdout + status.stderr
