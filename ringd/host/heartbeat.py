"""State files others read: atomic JSON writes, the driver's heartbeat, staleness
and sd_notify. The heartbeat publishes the driver's identity as pid + start
ticks (``pid_start``, see procid), and the state dir it is the driver of
(``state_dir``: its real path; ``state_id``: its device and inode; ringwatch.json
likewise). A heartbeat of another state dir (a state dir copied while its ring
ran, a symlink to another ring's heartbeat) names a live process that is not
this ring's driver: :func:`read_own` reads it as no file at all, so no reader
adopts, waits for, yields to, or signals another ring's process.

``write_json_atomic`` is the one way any daemon here publishes a file: temp file
(O_NOFOLLOW, 0600), fsync, rename. ``heartbeat_health`` is pure given a clock.

Files rewritten at every beat (the heartbeat, metrics) skip the fsync
(``durable=False``): they stay atomic for readers, and what a power cut can
cost is the last beat, which readers already take as a dead driver (a missing
or unreadable heartbeat is stale). The fsync was half the CPU time of a write,
and the beat is most of an idle driver's CPU time (benchmarks/bench_lap.py).
"""
from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from ringd.core.timefmt import epoch, iso
from ringd.host import procid
from ringd.host import safefile

HEARTBEAT_FILE = "ringd.heartbeat"
WATCHER_FILE = "ringwatch.json"   # the watcher's state (ringd.loops.watchstate), read by status and metrics
# An empty file that records a give-up ringwatch.json could not (a full disk):
# creating it needs an inode, no data block. A watcher refuses to start while
# it exists, as it does on "gave_up": true; `ringwatch reset` removes it.
GAVE_UP_FILE = "ringwatch.gave-up"


def write_json_atomic(path: Path, data: Dict[str, Any], durable: bool = True) -> None:
    """Write JSON so a reader sees the old file or the new one, never half of one."""
    write_text_atomic(path, json.dumps(data, sort_keys=True) + "\n", durable)


def write_text_atomic(path: Path, text: str, durable: bool = True) -> None:
    """Temp file (created afresh, 0600), fsync (``durable``), rename over ``path``."""
    if str(path) not in _swept:
        _sweep_temps(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    blob = text.encode()
    fd = safefile.create_new(tmp, 0o600)
    try:
        try:
            # a short write (a full disk, a file size limit) is not an error by
            # itself: write the rest, so the one that fails raises, and the old
            # file stays
            view = memoryview(blob)
            while view:
                n = os.write(fd, view)
                if n <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
                view = view[n:]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        try:   # a full or read-only state dir: leave no half-written temp file behind
            os.unlink(tmp)
        except OSError:
            pass
        raise


_swept: Set[str] = set()   # the files whose dead writers' temp files this process has removed


def _sweep_temps(path: Path) -> None:
    """Remove the temp files of ``path`` that writers killed mid-write (SIGKILL
    in a stalled fsync, the OOM killer, a power cut) left: ``.NAME.<pid>.tmp``
    of a pid no process has now. Each such death left one for good, none ever
    renamed nor removed. Once per file per process (its first write); a live
    writer's (another process, whatever its user) is left alone."""
    _swept.add(str(path))
    prefix = f".{path.name}."
    try:
        with os.scandir(path.parent) as entries:
            names = [e.name for e in entries if e.name.startswith(prefix) and e.name.endswith(".tmp")]
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):-len(".tmp")]
        if not (pid.isascii() and pid.isdigit() and 0 < int(pid) < 1 << 31) or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue   # alive (or another user's: PermissionError)
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            os.unlink(path.with_name(name))
        except OSError:
            pass


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    """The JSON object in ``path``, or None if missing, unreadable, corrupt or not
    a regular file (a FIFO there is never waited on: safefile.open_regular)."""
    try:
        with os.fdopen(safefile.open_regular(path), "rb") as f:
            blob = f.read(64 * 1024)
        data = json.loads(blob)
    except (OSError, ValueError, RecursionError):   # RecursionError: '[' nested thousands deep
        return None
    return data if isinstance(data, dict) else None


# --- the heartbeat -----------------------------------------------------------

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
    ringwatch.json), else None: its pid, start ticks *and* boot, so neither a
    recycled pid nor, after a reboot, a process that got the same pid at the same
    tick. Not after its clean stop, unless ``even_stopped``."""
    if not isinstance(data, dict) or (data.get("stopped") and not even_stopped):
        return None
    pid, start = data.get("pid"), data.get("pid_start")
    return (pid, start) if procid.same_process(pid, start, data.get("boot_id")) else None


def watcher_alive(data: Optional[Dict[str, Any]]) -> bool:
    """Is the watcher that wrote ``ringwatch.json`` (``data``) still running?"""
    return live_writer(data) is not None


def watcher_gave_up(state_dir: Path, data: Optional[Dict[str, Any]]) -> bool:
    """Did a watcher give up (``data``: ringwatch.json as read, None if none)?
    The one rule for the watcher's refusal, ``ringd status`` and the metrics:
    here, beside WATCHER_FILE, so the driver and the status command need not
    import ringwatch."""
    return bool((data or {}).get("gave_up")) or os.path.lexists(Path(state_dir) / GAVE_UP_FILE)


def journal_boot(state_dir: Path) -> Optional[str]:
    """The boot its journal's process identities were recorded in (a ``running``
    row's driver and agent): its last driver's, as its heartbeat says - a single-host
    ring has one driver at a time, and a new one reaps before its first beat.
    None: not known (no heartbeat, one from before ring recorded boots), or this
    boot's: another live process holds the driver's lock, so the driver that
    wrote any ``running`` row is of this boot, heartbeat or not (one that could
    not write its heartbeat yet must not have its run taken for an earlier boot's)."""
    boot = (read_heartbeat(state_dir) or {}).get("boot_id")
    if not isinstance(boot, str) or procid.this_boot(boot):
        return None   # (so /proc/locks is read only after a reboot)
    from ringd.host.lock import LOCK_FILE, holder_pid
    return None if holder_pid(Path(state_dir) / LOCK_FILE) not in (None, os.getpid()) else boot


def recorded_alive(pid: Any, ticks: Any, state_dir: Path) -> bool:
    """Is the process this state dir's journal recorded as (pid, start ticks) - a
    ``running`` row's driver or agent - alive? (procid: boot-relative, so a step
    of the wall clock changes nothing; :func:`journal_boot`: nor a reboot; no
    psutil import, which would cost a status call ~10 ms.)"""
    return procid.same_process(pid, ticks, journal_boot(state_dir))


def whose(state_dir: Path) -> Dict[str, Any]:
    """The keys that tie such a file to ``state_dir`` (:func:`of_state_dir`), and
    to this boot (:func:`live_writer`)."""
    return {"state_dir": os.path.realpath(state_dir), "state_id": state_id(state_dir),
            "boot_id": procid.boot_id()}


def state_id(state_dir: Path) -> Optional[List[int]]:
    """The state dir's [device, inode] (None if it cannot be read)."""
    try:
        st = os.stat(state_dir)
    except OSError:
        return None
    return [st.st_dev, st.st_ino]


def of_state_dir(hb: Dict[str, Any], real_path: str, ident: Optional[List[int]]) -> bool:
    """Pure: was ``hb`` written by a driver of the state dir at ``real_path`` with
    [device, inode] ``ident``? Either one matching is enough: a state dir renamed
    while its ring was down keeps its inode, one whose device number changed at
    a reboot keeps its path; a copy or another ring's file has neither. A
    heartbeat without them (an older ring's) is taken as this dir's."""
    path, sid = hb.get("state_dir"), hb.get("state_id")
    if path is None and sid is None:
        return True
    return path == real_path or (ident is not None and sid == ident)


def heartbeat_age(hb: Optional[Dict[str, Any]], now: float) -> Optional[float]:
    """Seconds since the heartbeat's ``at`` (negative if it is from the future)."""
    if not hb:
        return None
    at = epoch(hb.get("at_epoch"))
    if at is None:
        at = epoch(hb.get("at"))
    return None if at is None else now - at


def heartbeat_health(hb: Optional[Dict[str, Any]], alive: bool, now: float,
                     heartbeat_interval: float, locked: bool = False) -> str:
    """Pure: ``ok`` | ``stale`` | ``dead`` | ``stopped`` from a heartbeat, whether its
    process is alive, whether a live process holds the driver's lock, and a clock.

    - no readable heartbeat while a driver holds the lock: ``stale`` (it cannot
      write its heartbeat: something not a file took its place)
    - no heartbeat, or a clean stop recorded in it: ``stopped``
    - process gone without a clean stop: ``dead``
    - heartbeat older than 2 x interval (or unreadable time): ``stale``
    - heartbeat more than 2 x interval in the *future*: ``stale`` too - the wall
      clock was set back since the driver last beat (a live driver's next beat
      would carry the new time), so the stamp proves nothing
    """
    if not hb and locked:
        return "stale"
    if not hb or hb.get("stopped"):
        return "stopped"
    if not alive:
        return "dead"
    age = heartbeat_age(hb, now)
    if age is None or abs(age) > 2 * heartbeat_interval:
        return "stale"
    return "ok"


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


def watchdog_interval() -> Optional[float]:
    """Half of systemd's WatchdogSec when it watches *this* process, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    owner = os.environ.get("WATCHDOG_PID")
    if not usec or (owner and owner != str(os.getpid())):
        return None
    try:
        return max(0.05, int(usec) / 2e6)
    except ValueError:
        return None


class Notifier:
    """sd_notify when NOTIFY_SOCKET is set; silent otherwise."""

    def __init__(self) -> None:
        self._n = None
        if os.environ.get("NOTIFY_SOCKET"):
            import sdnotify
            self._n = sdnotify.SystemdNotifier()

    def notify(self, message: str) -> None:
        if self._n is not None:
            self._n.notify(message)
