"""The reaper: close journal rows left ``running`` by a driver that died.

"Reap before you count": the driver calls it at start (holding the lock, which
proves every earlier driver of this state dir is dead - even one that had the
same pid, as pid 1 in a container has every time) and status/history call it
before reading (then a row is an orphan when its driver - pid *and* start
ticks - is gone). A driver that is alive is never reaped, lock or not (a lock
file deleted under it lets a second driver take a fresh lock). A still-alive
agent of an orphaned run is killed first.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable, List, Optional

from ringd.core.levels import WARNING
from ringd.host import cgroup
from ringd.host import proctree
from ringd.inputs.config import Config
from ringd.host.notify import read_notes
from ringd.host.heartbeat import recorded_alive
from ringd.journal.sqlite import Journal, RunRow, journal_path
from ringd.journal.transitions import Closed, close_row


def driver_alive(row: RunRow, state_dir: Path, me: Optional[tuple] = None) -> bool:
    """Is the driver that wrote ``row`` alive (and not ``me``, (pid, start))?"""
    if me is not None and (row.driver_pid, row.driver_start) == me:
        return False
    return recorded_alive(row.driver_pid, row.driver_start, state_dir)


def orphan_cause(row: RunRow, me: Optional[tuple] = None) -> str:
    """Why ``row`` is an orphan, in the words of its reason and of the alert.
    Its driver is dead - unless it is ``me``: a journal restored under this
    driver from a backup taken while it ran that run, long ended."""
    if me is not None and (row.driver_pid, row.driver_start) == me:
        return (f"its driver (pid {row.driver_pid}, still running) no longer runs it: "
                f"the journal was replaced under the driver")
    return f"driver (pid {row.driver_pid}) died while it ran"


def kill_orphan(state_dir: Path, row: RunRow, *, by_driver: bool = False,
                deadline: Optional[float] = None) -> int:
    """Kill what is left of an orphaned run anywhere on the host. Returns count.
    Waits for it until ``deadline`` (monotonic; default cgroup.KILL_WAIT from
    now) in all: its cgroup's emptying and removal and the walk for its key
    share one bound, as processes SIGKILL cannot end (a hung mount) would hold
    each for its whole bound (13 s in all).

    With the privileges of the ring's owner (the state dir's): whoever owns it
    can write every row and record the kill trusts (pids, start ticks, the run
    cgroup's place), so root reading another user's ring (``sudo ringd status``,
    ``force-fail``) must kill no process that user could not kill itself -
    never one of root's named by a forged row. ``by_driver``: the ring's own
    driver, which runs whatever the ring's files say with its own privileges
    anyway, kills with them (a root driver's orphans are root's)."""
    deadline = time.monotonic() + cgroup.KILL_WAIT if deadline is None else deadline
    if by_driver:
        return _kill_orphan(state_dir, row, deadline)
    return as_ring_owner(state_dir, lambda: _kill_orphan(state_dir, row, deadline))


def as_ring_owner(state_dir: Path, fn: Callable[[], int]) -> int:
    """``fn()`` (a count), with the privileges of the ring's owner when we are
    root on a ring another user can write (:func:`_other_owner`): the one rule
    for every signal an operator command sends to a process a ring's files
    name (the orphan's kill, the driver's SIGUSR1 wake-up)."""
    owner = _other_owner(state_dir)
    if owner is not None:
        return proctree.call_as(owner[0], owner[1], fn)
    return fn()


def _other_owner(state_dir: Path) -> Optional[tuple]:
    """(uid, gid) of another user who can write what the kill trusts, when we
    are root: the state dir's owner, or the owner of the journal or the cgroup
    record in a state dir of root's."""
    if os.geteuid() != 0:
        return None   # the kernel already keeps us to our own processes
    journal = journal_path(state_dir)
    for path in (state_dir, journal, Path(f"{journal}-wal"), state_dir / cgroup.RECORD):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid != 0:
            return st.st_uid, st.st_gid
    return None


def _kill_orphan(state_dir: Path, row: RunRow, deadline: float) -> int:
    # (pids of an earlier boot name nobody now; its run cgroups are gone with it)
    if bool(row.pid) and recorded_alive(row.pid, row.pid_start, state_dir):
        # The group now, while its leader (just identified) holds the group id,
        # and never again: the leader is no child of ours, whoever reaps it
        # frees the id for any new session. One killpg is enough: a fork racing
        # it fails, so no member of the group is left to find by its id.
        proctree.signal_group(row.pid, signal.SIGKILL)
        proctree.signal_process(row.pid, row.pid_start, signal.SIGKILL)   # should it have left its group
    # the run's cgroup, escapees included (never its driver, should it be alive and inside)
    killed = cgroup.kill_recorded(state_dir, row.id, driver=(row.driver_pid, row.driver_start), deadline=deadline)
    return killed + proctree.kill_run(str(state_dir), row.id, None, scope="host",
                                      timeout=min(proctree.KILL_RUN_WAIT, cgroup.left(deadline)))


def reap(journal: Journal, state_dir: Path, config: Config, *, me: Optional[tuple] = None,
         line_of: Callable[[str], Optional[str]] = lambda _n: None,
         log: Callable[[str, int], None] = lambda _m, _level: None,
         on_reaped: Optional[Callable[[RunRow, Closed], None]] = None,
         kill_by: Optional[float] = None) -> List[int]:
    """Close the orphaned ``running`` row, if any, as ``interrupted`` (source
    ``reaper``). ``me``: the calling driver's (pid, start), which holds the lock.
    ``line_of``: the agent's roster line, recorded so that an edit of the line
    lifts a quarantine decided here. ``kill_by``: the deadline of the orphan's
    kill (:func:`kill_orphan`). Returns the ids reaped."""
    row = journal.running_row()
    if row is None or driver_alive(row, state_dir, me):
        return []
    killed = kill_orphan(state_dir, row, by_driver=me is not None, deadline=kill_by)
    reason = orphan_cause(row, me)
    if killed:
        reason += f"; killed {killed} leftover process(es)"
    # the run's last phase is on the run (SPEC), also when its driver died: as it last published it
    closed = close_row(journal, row, "interrupted", source="reaper", now=time.time(), ring=config.ring,
                       line=line_of(row.agent), reason=reason, phase=read_notes(state_dir, row.id).get("phase"))
    if closed is None:
        return []
    log(f"reaper: run {row.id} of {row.agent} closed as interrupted ({reason})", WARNING)
    if on_reaped is not None:
        on_reaped(row, closed)
    return [row.id]
