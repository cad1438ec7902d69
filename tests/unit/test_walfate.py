"""The rules for a journal whose -wal or -shm was removed under an open connection (ringd.core.walfate)."""
import pytest

from ringd.core.walfate import DROP, SAVE, WAIT, lock_holders, orphaned_log, strangers


@pytest.mark.parametrize("pending, new_log_commits, new_files, final, expected", [
    # another log at the path holds commits: ours checkpointed under its frames would malform it
    (True, True, True, False, DROP),
    (False, True, True, True, DROP),
    (None, True, True, False, DROP),
    # alone, with no log but ours holding a commit: saved
    (True, False, False, False, SAVE),
    (True, False, True, False, SAVE),    # (files a reader left at the path: nobody on them now)
    # others on the journal, no file at the path but ours: they are on our log
    (False, False, False, False, SAVE),
    # others on the journal and files at the path: one may be on a log with nothing committed yet
    (False, False, True, False, WAIT),
    (False, False, True, True, DROP),
    # the pending byte not held (a connection starting right now)
    (None, False, False, False, WAIT),
    (None, False, False, True, DROP),
])
def test_orphaned_log(pending, new_log_commits, new_files, final, expected):
    assert orphaned_log(pending=pending, new_log_commits=new_log_commits, new_files=new_files,
                        final=final) == expected


TABLE = """\
1: POSIX  ADVISORY  READ 100 fe:00:500 128 128
2: POSIX  ADVISORY  READ 100 fe:00:400 1073741826 1073742335
3: POSIX  ADVISORY  READ 200 fe:00:400 1073741826 1073742335
4: -> POSIX  ADVISORY  WRITE 300 fe:00:400 1073741826 1073742335
5: OFDLCK ADVISORY  WRITE -1 fe:00:400 1073741824 1073741824
6: FLOCK  ADVISORY  WRITE 200 fe:00:401 0 EOF
7: POSIX  ADVISORY  WRITE 400 fe:00:400 0 EOF
8: POSIX  ADVISORY  READ 201 fe:00:501 128 128
"""


def test_lock_holders_reads_granted_locks_over_the_range():
    shared = (1073741826, 1073741826 + 509)
    # 300 waits (->), the OFD lock has no pid, 400's whole-file lock overlaps
    assert lock_holders(TABLE, (0xfe, 0, 400), *shared) == {100, 200, 400}
    assert lock_holders(TABLE, (0xfe, 0, 500), 128, 128) == {100}
    assert lock_holders(TABLE, (0xfe, 0, 400), 1073741824, 1073741824) == {400}
    assert lock_holders(TABLE, (0xfe, 0, 999), 0, 10) == set()
    assert lock_holders("garbage\n1: POSIX\n", (0xfe, 0, 400), 0, 10) == set()


def test_a_pid_of_another_namespace_cannot_be_told():
    assert lock_holders("1: POSIX  ADVISORY  READ 0 fe:00:400 1073741826 1073742335\n",
                        (0xfe, 0, 400), 1073741826, 1073742335) is None


def test_the_same_inode_on_another_device_is_another_file():
    """Two tmpfs number their files alike: a lock on inode 400 of device 00:2f
    is not one on inode 400 of fe:00 (the major and minor are hexadecimal)."""
    table = "1: POSIX  ADVISORY  READ 100 00:2f:400 1073741826 1073742335\n"
    assert lock_holders(table, (0xfe, 0, 400), 1073741826, 1073742335) == set()
    assert lock_holders(table, (0, 0x2f, 400), 1073741826, 1073742335) == {100}


def test_strangers_are_on_the_journal_but_not_on_its_shm():
    assert strangers({100, 200}, {100}, [300]) == {200}
    assert strangers({100, 300}, {100}, [300]) == set()
    assert strangers(set(), {100}, []) is None
    assert strangers({100}, None, []) is None
