"""Reading status changes nothing; the command reaps before it reads."""
import hashlib
import time

from ringd.cli.reap import reap_before_reading
from ringd.cli.status import gather_history, gather_status
from ringd.inputs.config import Config
from ringd.journal.sqlite import Journal, journal_path


def _orphan(state):
    """A journal whose running row names a driver that is long gone."""
    j = Journal.open(state)
    try:
        with j.transaction() as tx:
            rid = tx.start_run("a", 0, now=time.time() - 5, run_budget=10, stall_threshold=20,
                               driver_pid=2 ** 22 + 7, driver_start=1.0)
    finally:
        j.close()
    return rid


def _digest(state):
    """The state dir's files but SQLite's own -wal and -shm, which any reader makes."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(state.iterdir())
            if p.is_file() and not p.name.endswith(("-wal", "-shm"))}


def _status_of(state, rid):
    j = Journal.open_readonly(state)
    try:
        return j.run(rid).status
    finally:
        j.close()


def test_gather_status_and_history_leave_a_dead_drivers_run_as_they_found_it(tmp_path):
    rid = _orphan(tmp_path)
    before = _digest(tmp_path)
    doc = gather_status(tmp_path, Config())
    runs = gather_history(tmp_path, Config(), None, 5)
    assert doc["current"] is not None and runs[0]["status"] == "running"
    assert _status_of(tmp_path, rid) == "running"
    assert _digest(tmp_path) == before, "a read wrote to the state dir"


def test_the_command_reaps_before_it_reads(tmp_path):
    rid = _orphan(tmp_path)
    assert reap_before_reading(tmp_path, Config()) is None
    assert _status_of(tmp_path, rid) == "interrupted"
    assert journal_path(tmp_path).exists()
