"""journal.db-wal and -shm removed under a running driver: nothing lost, no second log, never malformed."""
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from conftest import REPO, wait_until
from ringd.core.walfate import lock_holders
from ringd.journal.sqlite import SHARED_FIRST, SHARED_SIZE, Journal, JournalError, journal_path

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux locks and /proc/locks")

PY_ENV = dict(os.environ, PYTHONPATH=str(REPO))


def lock_id(path) -> tuple:
    st = os.stat(path)
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def integrity(path) -> str:
    """``PRAGMA integrity_check`` in a process of its own (no lock of ours on the file)."""
    r = subprocess.run([sys.executable, "-c", "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
                        "print(c.execute('PRAGMA integrity_check').fetchone()[0])", str(path)],
                       capture_output=True, text=True, timeout=60)
    return (r.stdout.strip() or r.stderr.strip().splitlines()[-1:][0]) if (r.stdout or r.stderr) else "?"


def test_checkpointing_an_orphaned_log_under_another_log_loses_or_malforms(tmp_path):
    """SQLite's semantics, why a driver whose -wal was removed must never
    checkpoint its log once another process began a log at the path: the other
    log's frames are pages written against journal.db as it was, and they win
    over whatever the checkpoint put there - a table that grew in ours reads
    as a malformed database. (The driver drops its log then: walfate.DROP.)"""
    p = tmp_path / "j.db"
    a = sqlite3.connect(p, isolation_level=None)
    try:
        a.execute("PRAGMA journal_mode=WAL")
        a.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT)")
        a.execute("INSERT INTO t(v) VALUES ('before')")
        a.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        os.unlink(f"{p}-wal")
        os.unlink(f"{p}-shm")
        for _ in range(100):
            a.execute("INSERT INTO t(v) VALUES (?)", ("a" * 200,))
        other = ("import sqlite3, sys; b = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
                 "for _ in range(3): b.execute('INSERT INTO t(v) VALUES (?)', ('b' * 200,))\n")
        subprocess.run([sys.executable, "-c", other, str(p)], check=True, timeout=30)
        busy, log, done = a.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        assert (busy, log == done) == (0, True)
        assert "malformed" in integrity(p)
    finally:
        a.close()   # (its plain close would delete the other log by name: the other's commits lost instead)


HOLDER = """
import sys, time
from pathlib import Path
from ringd.journal.sqlite import Journal
j = Journal.open(Path(sys.argv[1]))
j.con.execute("PRAGMA wal_checkpoint(TRUNCATE)")   # (its schema in journal.db, as a driver's soon is)
for i in range(20):
    with j.transaction() as tx:
        tx.set_meta(f"k{i}", "v")
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "take":
        print(j.take_up_companions(), flush=True)
j.close()
"""


def _start(argv, procs):
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=PY_ENV)
    procs.append(p)
    return p


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)
        for stream in (p.stdin, p.stdout):
            if stream:
                stream.close()


def test_no_reader_or_writer_begins_a_second_log_while_the_first_is_orphaned(tmp_path, procs):
    """With the -wal and -shm of a process's open journal removed, a writer or
    a reader that opened the journal made new ones - a second log, where the
    next writer's commits (an operator's pause) went unseen by the first and a
    checkpoint of one under the other malformed it. Now both wait and are
    refused (try again), also when another program's reader has begun one
    (looked up in the kernel's lock table: the holder of the journal is not on
    the -shm at the path). The holder settles its log only once that reader
    is gone, saves it into journal.db, and then opens go through."""
    holder = _start([sys.executable, "-c", HOLDER, str(tmp_path)], procs)
    assert holder.stdout.readline().strip() == "ready"
    p = journal_path(tmp_path)
    os.unlink(f"{p}-wal")
    os.unlink(f"{p}-shm")
    for opener in (lambda: Journal.open_readonly(tmp_path, busy_timeout=0.3),
                   lambda: Journal.open(tmp_path, busy_timeout=0.3)):
        with pytest.raises(JournalError, match="try again"):
            opener().close()
        assert not os.path.exists(f"{p}-wal") and not os.path.exists(f"{p}-shm"), "a second log was begun"
    reader = _start([sys.executable, "-c", "import sqlite3, sys; c = sqlite3.connect(f'file:{sys.argv[1]}?mode=ro', "
                     "uri=True, isolation_level=None); c.execute('BEGIN'); c.execute('SELECT * FROM meta').fetchall();"
                     " print('reading', flush=True); sys.stdin.read()", str(p)], procs)
    assert reader.stdout.readline().strip() == "reading"
    assert os.path.exists(f"{p}-shm"), "another program's reader begins a log of its own"
    with pytest.raises(JournalError, match="try again"):
        Journal.open(tmp_path, busy_timeout=0.3).close()
    holder.stdin.write("take\n")
    holder.stdin.flush()
    assert holder.stdout.readline().strip() == "waiting", "settled while a process may be on the new log"
    with open("/proc/locks") as f:   # (the wait dropped none of the holder's locks: its connection stays)
        shared = lock_holders(f.read(), lock_id(p), SHARED_FIRST, SHARED_FIRST + SHARED_SIZE - 1)
    assert holder.pid in shared
    reader.stdin.close()
    reader.wait(timeout=10)
    holder.stdin.write("take\n")
    holder.stdin.flush()
    assert holder.stdout.readline().strip() == "saved"
    j = Journal.open(tmp_path, busy_timeout=5)
    try:
        assert all(j.meta(f"k{i}") == "v" for i in range(20))
    finally:
        j.close()
    holder.stdin.close()
    assert holder.wait(timeout=10) == 0
    assert integrity(p) == "ok"


def _marks(path):
    return path.read_text().split() if path.exists() else []


@pytest.mark.parametrize("beat", [0.3, 30.0], ids=["taken-up-at-a-beat", "taken-up-at-the-pause-s-wake"])
def test_a_long_run_with_its_wal_removed_loses_nothing(ring, beat):
    """rm journal.db-wal journal.db-shm while a long agent runs, then `ringd
    pause`: the driver wrote on to its unlinked log until the run ended, the
    pause began a second log, and the driver's close dropped its own writes
    since the last checkpoint (417 of 1,427 agent starts lost in a soak). Now
    the pause waits while the driver's log is orphaned and wakes it; the
    driver (at that wake, or at its next beat) saves its log into journal.db
    and takes the journal up again, mid-run. The pause holds, the run's end is
    recorded, more runs and a second removal later every agent start has its
    row, the journal is sound and the driver runs on."""
    marks = ring.base / "marks"
    gate = ring.base / "long-done"
    ring.agent("long", f"echo $RING_RUN_ID >> {marks}\n"
                       f"while [ ! -e {gate} ]; do sleep 0.05; done\n")
    for name in ("q1", "q2"):
        ring.agent(name, f"echo $RING_RUN_ID >> {marks}\nsleep 0.02\n")
    ring.write_config(ring={"heartbeat_interval": beat, "run_budget": 60, "stall_threshold": 90})
    ring.roster(*(f"{n} {ring.agents_dir}/{n}.sh" for n in ("q1", "q2", "long")))
    drv = ring.start_driver()
    def long_runs():   # (read before the files go: a plain reader there would begin a log of its own)
        return ring.rows("SELECT id FROM runs WHERE status = 'running' AND agent = 'long'")
    wait_until(lambda: len(_marks(marks)) >= 3 and long_runs(), timeout=30,
               message="a few runs, then the long one running")
    for suffix in ("-wal", "-shm"):
        os.unlink(f"{ring.journal_path}{suffix}")
    t0 = time.monotonic()
    paused = ring.cli("pause")
    took = time.monotonic() - t0
    assert paused.returncode == 0, paused.stderr
    assert took < 8.0, f"the pause waited {took:.1f} s"
    at_pause = len(_marks(marks))
    gate.touch()
    wait_until(lambda: not ring.rows("SELECT id FROM runs WHERE status = 'running'"), timeout=20,
               message="the long run's end recorded")
    end = time.monotonic() + 1.5   # (nothing may start while paused: looked at for a while)
    while time.monotonic() < end:
        assert len(_marks(marks)) == at_pause, "a run started after the pause answered"
        time.sleep(0.05)
    gate.unlink()
    assert ring.cli("resume").returncode == 0
    wait_until(lambda: len(_marks(marks)) >= at_pause + 3 and long_runs(), timeout=30,
               message="the ring turning again, into the long run")
    for suffix in ("-wal", "-shm"):   # (again, with no operator: the next beat or write takes it up)
        os.unlink(f"{ring.journal_path}{suffix}")
    gate.touch()
    wait_until(lambda: len(_marks(marks)) >= at_pause + 10, timeout=60, message="more runs after a second removal")
    gate.unlink()

    def missing():
        ids = {str(r["id"]) for r in ring.rows("SELECT id FROM runs")}
        return [m for m in _marks(marks) if m not in ids]
    try:
        wait_until(lambda: not missing(), timeout=20 if beat < 1 else 45, message="every agent start's row")
    finally:
        assert not missing(), f"{len(missing())} of {len(_marks(marks))} agent starts lost: {missing()[:10]}"
    log = drv.err_path.read_text()
    assert "nothing lost" in log and "are lost" not in log, log
    assert drv.poll() is None, "the driver stopped"
    assert integrity(ring.journal_path) == "ok"
    events = ring.rows("SELECT kind FROM events WHERE source = 'operator'")
    assert [e["kind"] for e in events][:2] == ["paused", "unpaused"]


def test_a_log_another_program_began_first_is_kept_never_checkpointed_over(ring):
    """The one way a second log still begins: another program (a sqlite3
    shell) writes to the journal before the driver noticed its -wal and -shm
    went. The driver wrote on to its unlinked log until its next beat; past
    SQLite's automatic checkpoint (1000 pages) it checkpointed that log into
    journal.db under the other one: "database disk image is malformed", the
    driver exited 78. Now its next write notices: its log is dropped, never
    checkpointed (its writes since the last checkpoint are lost, said so),
    the other program's commit is kept, and the ring turns on, sound."""
    marks = ring.base / "marks"
    ring.agent("a", f"echo $RING_RUN_ID >> {marks}\n")
    ring.write_config(ring={"heartbeat_interval": 30})
    ring.roster(f"a {ring.agents_dir}/a.sh")
    drv = ring.start_driver()
    wait_until(lambda: len(_marks(marks)) >= 20, timeout=30, message="the ring turning")
    con = sqlite3.connect(ring.journal_path, isolation_level=None, timeout=10)
    try:   # (the schema into journal.db, where a program that finds no log reads)
        con.execute("PRAGMA wal_checkpoint(PASSIVE)")
    finally:
        con.close()
    drv.send_signal(signal.SIGSTOP)
    try:
        for suffix in ("-wal", "-shm"):
            os.unlink(f"{ring.journal_path}{suffix}")
        con = sqlite3.connect(ring.journal_path, isolation_level=None, timeout=10)
        try:
            con.execute("INSERT INTO meta(key, value) VALUES ('foreign', 'kept')")
        finally:
            con.close()
    finally:
        drv.send_signal(signal.SIGCONT)
    at = len(_marks(marks))
    # (about 13 pages a run: well past the 1000-page automatic checkpoint)
    wait_until(lambda: len(_marks(marks)) >= at + 200 or drv.poll() is not None, timeout=90,
               message="200 more runs")
    assert drv.poll() is None, drv.err_path.read_text()[-2000:]
    assert integrity(ring.journal_path) == "ok"
    assert ring.rows("SELECT value FROM meta WHERE key = 'foreign'")[0]["value"] == "kept"
    assert "are lost" in drv.err_path.read_text()


def test_a_journal_on_another_filesystem_with_the_same_inode_is_not_held(tmp_path):
    """Two tmpfs number their files alike: a driver holding the journal of one
    made an opener of the other's (its -wal and -shm not made yet: a state dir
    full at start-up) refuse "another process has the journal open", never
    the disk-full line. Only a lock on this very file (device and inode) counts."""
    from conftest import mounted_tmpfs
    with mounted_tmpfs(tmp_path / "a", "4m") as a, mounted_tmpfs(tmp_path / "b", "4m") as b:
        Journal.open(a).close()
        Journal.open(b).close()
        pa, pb = journal_path(a), journal_path(b)
        if os.stat(pa).st_ino != os.stat(pb).st_ino:
            pytest.skip("the two tmpfs numbered the journals apart")
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(a)], env=PY_ENV, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "ready"
            for suffix in ("-wal", "-shm"):   # (b's as a fresh state dir's: none yet)
                assert not os.path.lexists(f"{pb}{suffix}")
            Journal.open(b, busy_timeout=0.3).close()
        finally:
            holder.kill()
            holder.wait(timeout=10)
