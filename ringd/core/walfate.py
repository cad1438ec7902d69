"""Pure rules for a SQLite journal whose -wal or -shm was removed under an open connection."""
from __future__ import annotations

from typing import Iterable, Optional, Set, Tuple

SAVE, DROP, WAIT = "save", "drop", "wait"


def orphaned_log(*, pending: Optional[bool], new_log_commits: bool, new_files: bool, final: bool) -> str:
    """What a connection does with its log once its -wal or -shm was removed at
    the path (the log is "orphaned": no process that opens the journal now reads it).

    ``pending``: SQLite's pending byte is held by us (no connection can start
    meanwhile) with no other process on the journal (True), held with others
    on it (False), or not held (None). ``new_log_commits``: a -wal at the path
    that is not ours holds frames. ``new_files``: a -wal or -shm at the path is
    not ours. ``final``: the connection closes for good (no later try).

    SAVE: checkpoint the orphaned log into journal.db, then connect again.
    DROP: never checkpoint it - its pages would land under the frames of the
    other log, which were written against the database as it was (a malformed
    journal); the other log is kept and ours since its last checkpoint is lost.
    WAIT: a process may be on a log begun at the path with nothing committed
    yet; try again later (the orphaned log is never checkpointed meanwhile)."""
    if new_log_commits:
        return DROP
    if pending is True or (pending is False and not new_files):
        return SAVE   # (others there are on our log: a log begun at the path would have left its files)
    return DROP if final else WAIT


def lock_holders(proc_locks: str, file_id: Tuple[int, int, int], first: int, last: int) -> Optional[Set[int]]:
    """The pids that hold a granted lock overlapping bytes ``first``..``last`` of
    the file ``file_id`` (device major, minor, inode), read from the text of
    /proc/locks; None when one of them cannot be told (a pid of another pid
    namespace shows as 0). The device counts: two filesystems (two tmpfs) give
    their files the same small inode numbers."""
    out: Set[int] = set()
    for line in proc_locks.splitlines():
        f = line.split()
        if len(f) < 8 or f[1] == "->":   # (a waiter, not a holder)
            continue
        try:
            major, minor, ino = f[5].split(":")
            pid, held, start = int(f[4]), (int(major, 16), int(minor, 16), int(ino)), int(f[6])
            end = -1 if f[7] == "EOF" else int(f[7])
        except ValueError:
            continue
        if held == file_id and start <= last and (end < 0 or end >= first):
            if pid == 0:
                return None
            if pid > 0:   # (an open file description lock has no pid: -1)
                out.add(pid)
    return out


def strangers(journal_holders: Optional[Set[int]], shm_holders: Optional[Set[int]],
              me: Iterable[int]) -> Optional[Set[int]]:
    """The processes that have the journal open but not the -shm at its path
    (they write a log no one opening the journal now would read); None when
    the lock table cannot tell (no holder of the journal is named in it)."""
    if not journal_holders or shm_holders is None:
        return None
    return journal_holders - shm_holders - set(me)
