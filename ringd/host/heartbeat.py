"""The driver's heartbeat and whose a state file is: pid + start ticks
(``pid_start``, see procid) and the state dir it belongs to (``state_dir``: its
real path; ``state_id``: its device and inode; ringwatch.json likewise). A
heartbeat of another state dir (a copy made while its ring ran, a symlink to
another ring's file) names a live process that is not this ring's driver:
:func:`read_own` reads it as no file at all, so no reader adopts, waits for,
yields to, or signals another ring's process.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ringd.core.health import of_state_dir
from ringd.core.timefmt import iso
from ringd.host.atomicfile import read_json, write_json_atomic
from ringd.host import procid
from ringd.host.servicemanager import Notifier

HEARTBEAT_FILE = "ringd.heartbeat"
WATCHER_FILE = "ringwatch.json"   # the watcher's state (ringd.host.watchstate), read by status and metrics
# An empty file that records a give-up ringwatch.json could not (a full disk):
# creating it needs an inode, no data block. A watcher refuses to start while
# it exists, as it does on "gave_up": true; `ringwatch reset` removes it.
GAVE_UP_FILE = "ringwatch.gave-up"


def heartbeat_path(state_dir: Path) -> Path:
    return state_dir / HEARTBEAT_FILE


def read_heartbeat(state_dir: Path) -> Optional[Dict[str, Any]]:
    """This state dir's heartbeat; None if missing, unreadable, or another state
    dir's (:func:`of_state_dir`)."""
    return read_own(heartbeat_path(state_dir), state_dir)


def read_own(path: Path, state_dir: Path) -> Optional[Dict[str, Any]]:
    """A state file that names its writer's process (the heartbeat, ringwatch.json):
    None if missing, unreadable, or written for another state dir - copied from a
    running ring, or a symlink to one - whose process is not this ring's."""
    data = read_json(path)
    if data is None or of_state_dir(data, os.path.realpath(state_dir), state_id(state_dir)):
        return data
    return None


def live_writer(data: Any, even_stopped: bool = False) -> Optional[Tuple[int, int]]:
    """(pid, start ticks) of the live process that wrote ``data`` (the heartbeat,
    ringwatch.json), else None: its pid, start ticks, boot *and* pid namespace
    (procid.same_process), so neither a recycled pid, nor after a reboot a
    process that got the same pid at the same tick, nor another namespace's
    process with that pid. Not after its clean stop, unless ``even_stopped``."""
    if not isinstance(data, dict) or (data.get("stopped") and not even_stopped):
        return None
    pid, start = data.get("pid"), data.get("pid_start")
    return (pid, start) if procid.same_process(pid, start, data) else None


def watcher_alive(data: Optional[Dict[str, Any]]) -> bool:
    """Is the watcher that wrote ``ringwatch.json`` (``data``) still running?"""
    return live_writer(data) is not None


def watcher_gave_up(state_dir: Path, data: Optional[Dict[str, Any]]) -> bool:
    """Did a watcher give up (``data``: ringwatch.json as read, None if none)?
    The one rule for the watcher's refusal, ``ringd status`` and the metrics:
    here, beside WATCHER_FILE, so the driver and the status command need not
    import ringwatch."""
    return bool((data or {}).get("gave_up")) or os.path.lexists(Path(state_dir) / GAVE_UP_FILE)


def journal_boot(state_dir: Path) -> Optional[Dict[str, Any]]:
    """Where its journal's process identities were recorded (a ``running`` row's
    driver and agent): its last driver's boot and pid namespace, as its heartbeat
    says (procid.here's keys) - a single-host ring has one driver at a time, and
    a new one reaps before its first beat. None: not known (no heartbeat, one
    from before ring recorded them), or here: another live process holds the
    driver's lock, so the driver that wrote any ``running`` row is of this boot,
    heartbeat or not (one that could not write its heartbeat yet must not have
    its run taken for an earlier boot's)."""
    hb = read_heartbeat(state_dir) or {}
    if procid.recorded_here(hb):
        return None   # (so /proc/locks is read only after a reboot)
    from ringd.host.lock import LOCK_FILE, holder_pid
    if holder_pid(Path(state_dir) / LOCK_FILE) not in (None, os.getpid()):
        return None
    return {key: hb.get(key) for key in procid.here()}


def recorded_alive(pid: Any, ticks: Any, state_dir: Path) -> bool:
    """Is the process this state dir's journal recorded as (pid, start ticks) - a
    ``running`` row's driver or agent - alive? (procid: boot-relative, so a step
    of the wall clock changes nothing; :func:`journal_boot`: nor a reboot; no
    psutil import, which would cost a status call ~10 ms.)"""
    return procid.same_process(pid, ticks, journal_boot(state_dir))


def ring_uid(state_dir: Path, by_state_dir: bool = True) -> int:
    """The uid the ring runs as: its heartbeat's owner (the driver writes it,
    0600), else (``by_state_dir``) its state dir's, else ours. Whose rules a
    reading command judges the ring's files by (safefile.lenient_modes): root
    reading a ring run by a service user must not call that user's own roster
    a problem."""
    for path in (heartbeat_path(state_dir), Path(state_dir)) if by_state_dir else (heartbeat_path(state_dir),):
        try:
            return os.lstat(path).st_uid
        except OSError:
            continue
    return os.geteuid()


def whose(state_dir: Path) -> Dict[str, Any]:
    """The keys that tie such a file to ``state_dir`` (:func:`of_state_dir`), and
    to this boot and pid namespace (:func:`live_writer`)."""
    return {"state_dir": os.path.realpath(state_dir), "state_id": state_id(state_dir), **procid.here()}


def state_id(state_dir: Path) -> Optional[List[int]]:
    """The state dir's [device, inode] (None if it cannot be read)."""
    try:
        st = os.stat(state_dir)
    except OSError:
        return None
    return [st.st_dev, st.st_ino]


class Heartbeat:
    """The driver's heartbeat writer (also the sd_notify speaker)."""

    def __init__(self, state_dir: Path, notifier: "Notifier"):
        self.path = heartbeat_path(state_dir)
        self.whose = whose(state_dir)   # whose driver this is (read_heartbeat)
        self.notifier = notifier
        self.pid = os.getpid()
        self.pid_start = procid.start_ticks(self.pid)  # boot-relative: immune to clock steps
        self.tz = os.environ.get("TZ")   # the zone its cron schedules are read in (schedule.local_zone)
        self.started_at = time.time()
        self.seq = 0

    def beat(self, *, lap: int, agent: Optional[str], run_id: Optional[int],
             run_pid: Optional[int] = None, run_started_at: Optional[float] = None,
             stopped: bool = False, extra: Optional[Dict[str, Any]] = None) -> None:
        now = time.time()
        self.seq += 1
        data = {
            "pid": self.pid, "pid_start": self.pid_start,
            "started_at": iso(self.started_at), "at": iso(now), "at_epoch": now,
            "lap": lap, "agent": agent, "run_id": run_id, "run_pid": run_pid,
            "run_started_at": iso(run_started_at), "seq": self.seq, "stopped": stopped, "tz": self.tz,
            **self.whose,
        }
        if extra:
            data.update(extra)
        write_json_atomic(self.path, data, durable=stopped)   # rewritten next beat; the last one kept
        if not stopped:
            self.notifier.notify("WATCHDOG=1")
