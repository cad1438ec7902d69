"""The watcher's own state: ``<state>/ringwatch.json`` and ``<state>/ringwatch.lock``.

``ringwatch.json`` (written atomically, 0600) carries the SPEC fields ``pid``,
``started_at``, ``last_poll_at``, ``restarts`` (ISO 8601 UTC times of the
restarts still inside the start-limit window) and ``gave_up``, plus
``restart_clock`` (the same restarts in seconds since boot: the window is kept
on a clock nobody steps), ``pid_start``
(to tell a live watcher from a recycled pid), ``gave_up_at``, ``gave_up_reason``,
``stopped`` (true after a clean exit), ``driver`` (pid and start time of the
driver being watched) and ``state_dir``/``state_id`` (``ringd.host.heartbeat.whose``). The restart history survives the watcher's own restarts;
``ringwatch reset`` clears it, and counts its resets in ``reset_gen``.

Every read-modify-write of ``ringwatch.json`` (the watcher's, reset's) holds
:func:`write_lock`, a short flock on the state dir itself, so a reset is never
undone by a watcher that read the file just before it.

The lock is a kernel flock (ringd.host.lock.KernelLock): released when the holder
dies, so it never needs cleaning up. The lock file holds nothing, so the
holder's pid is published in ``ringwatch.json``, not in the lock.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from ringd.core.errors import EX_CONFIG, EX_FAILURE, EX_TEMPFAIL, ConfigError, RingError, exit_for
from ringd.host.heartbeat import GAVE_UP_FILE, WATCHER_FILE, read_own, watcher_alive
from ringd.host.atomicfile import write_json_atomic
from ringd.core.timefmt import iso, parse_iso
from ringd.host.heartbeat import watcher_gave_up as gave_up   # (the one rule: status and metrics read it too)
from ringd.host.safefile import check_state_dir

from ringd.core.watchpolicy import Clock, number

STATE_FILE = WATCHER_FILE
LOCK_FILE = "ringwatch.lock"


def state_path(state_dir: Path) -> Path:
    return state_dir / STATE_FILE


def prepare_state_dir(state_dir: Path) -> None:
    """Create a missing state dir (0700) and its ``logs``; refuse one that group or
    others may write (anyone who can write it controls the driver)."""
    try:
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass   # not a directory: check_state_dir says so, as the driver does
    except OSError as e:
        raise RingError(f"{state_dir}: cannot create state dir: {e.strerror}", exit_for(e)) from None
    try:
        check_state_dir(state_dir)   # the driver's rule, and ringd check's
    except ConfigError as e:
        raise RingError(e.message, e.code) from None
    logs = state_dir / "logs"
    try:
        os.mkdir(logs, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise RingError(f"{logs}: cannot create log dir: {e.strerror}", exit_for(e)) from None
    st = os.lstat(logs)
    if stat.S_ISLNK(st.st_mode):
        raise RingError(f"{logs}: log dir is a symbolic link; refusing to follow it "
                        f"(remove it, ringwatch recreates the directory)", EX_CONFIG)
    if not stat.S_ISDIR(st.st_mode):
        raise RingError(f"{logs}: log dir is not a directory", EX_CONFIG)
    driver_log = logs / "ringd.log"
    if driver_log.is_symlink():
        raise RingError(f"{driver_log}: driver log is a symbolic link; refusing to follow it", EX_CONFIG)


def load(state_dir: Path) -> Dict[str, Any]:
    """The last saved state ({} if none or unreadable - a corrupt file loses only
    the history, never blocks the watcher; {} too if another state dir's watcher
    wrote it: a copy names that ring's live watcher and restarts, not ours)."""
    return read_own(state_path(state_dir), state_dir) or {}


def save(state_dir: Path, data: Dict[str, Any]) -> None:
    write_json_atomic(state_path(state_dir), data)


def mark_gave_up(state_dir: Path) -> None:
    """Record a give-up that ringwatch.json could not take (OSError if even this fails).
    A marker already there records it as well (gave_up: anything at the path),
    so FileExistsError is success. Not safefile.create_new: it removes what is
    there and makes it again - the record gone meanwhile, and lost if it cannot
    be made again. O_EXCL and O_NOFOLLOW: nothing there is ever opened through."""
    try:
        fd = os.open(state_dir / GAVE_UP_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except FileExistsError:
        return
    os.close(fd)


WRITE_LOCK_WAIT = 10.0   # s; a holder only reads and writes one small file


@contextlib.contextmanager
def write_lock(state_dir: Path, wait: float = WRITE_LOCK_WAIT,
               give_up: Optional[Callable[[], bool]] = None) -> Iterator[None]:
    """Hold the lock for one read-modify-write of ringwatch.json (the watcher's
    and ``ringwatch reset``'s): a flock on the state dir itself, not on a file,
    so taking it needs no disk space (a full disk is when a reset matters) and
    leaves nothing behind. Never held for long; a holder that does not let go
    within ``wait`` (a stopped process) raises RingError (75) rather than hang
    the watcher's loop; so does one still held when ``give_up()`` says so (the
    watcher, told to stop: this wait must hear its signals)."""
    fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now >= deadline or (give_up is not None and give_up()):
                    waited = f"{wait:g}s" if now >= deadline else f"{now - deadline + wait:.1f}s"
                    raise RingError(f"{state_path(state_dir)}: still being written by another process "
                                    f"after {waited}", EX_TEMPFAIL) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)   # drops the flock


def reset_fields(gen: Any) -> Dict[str, Any]:
    """The ringwatch.json keys a reset sets: no history, no give-up, and the
    reset's generation (a watcher holding its state in memory compares it)."""
    return dict(restarts=[], restart_clock=None, gave_up=False, gave_up_at=None,
                gave_up_reason=None, reset_gen=gen)


def clock_now() -> Clock:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id: Optional[str] = f.read().strip() or None
        boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, AttributeError):   # not Linux: by the wall clock, as before
        boot_id, boot = None, time.monotonic()
    return Clock(boot_id=boot_id, boot=boot, wall=time.time())


def restart_times(data: Dict[str, Any], clock: Clock) -> List[float]:
    """Pure: the persisted restart history as seconds since ``clock``'s boot.

    ``restarts`` holds ISO times (SPEC); ``restart_clock`` the same restarts in
    seconds since boot, keyed by those ISO strings, with the boot's id. A restart
    recorded in this boot keeps its boot time: a step of the wall clock since
    (NTP, a VM resumed from a snapshot) moves none into the window - an hour back
    made restarts spread over an hour count as one burst, and the watcher gave
    up - nor out of it. Anything else (an earlier boot, an older ringwatch, a
    hand edit) is placed by its wall time (policy.prune clamps the future)."""
    raw = data.get("restarts")
    rc = data.get("restart_clock")
    known: Dict[str, Any] = {}
    if isinstance(rc, dict) and clock.boot_id is not None and rc.get("boot_id") == clock.boot_id \
            and isinstance(rc.get("since_boot"), dict):
        known = rc["since_boot"]
    out: List[float] = []
    for item in raw if isinstance(raw, list) else []:
        b = number(known.get(item)) if isinstance(item, str) else None
        if b is not None:
            out.append(b)
            continue
        t = number(item) if not isinstance(item, str) else number(parse_iso(item))
        if t is not None:
            out.append(t - (clock.wall - clock.boot))
    return out


def encode_restarts(times: List[float], clock: Clock) -> Dict[str, Any]:
    """Pure: the ringwatch.json keys for a window of restarts (seconds since boot,
    already pruned): ``restarts`` as ISO times on today's wall clock, and
    ``restart_clock`` (see :func:`restart_times`)."""
    isos = [iso(clock.wall - (clock.boot - b)) for b in times]
    return {"restarts": isos,
            "restart_clock": {"boot_id": clock.boot_id, "since_boot": dict(zip(isos, times))}}


class WatchLock:
    """The exclusive ``ringwatch.lock``; a second watcher on the state dir is refused."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.path = state_dir / LOCK_FILE
        self._lock = None

    def acquire(self) -> None:
        from ringd.host.lock import KernelLock, LockHeld
        if self.path.is_symlink():
            raise RingError(f"{self.path}: lock file is a symlink; refusing to follow it", EX_CONFIG)
        try:
            self._lock = KernelLock(self.path).acquire()
        except LockHeld:
            raise RingError(self._holder_message(), EX_TEMPFAIL) from None
        except OSError as e:
            raise RingError(f"{self.path}: cannot lock: {e.strerror}", exit_for(e)) from None
        # A lock file deleted under a running watcher leaves its flock on the
        # unlinked inode: we locked a fresh file. The live watcher (pid and start
        # ticks, as ringwatch.json names it) still owns the state dir.
        data = load(self.state_dir)
        if watcher_alive(data) and data.get("pid") != os.getpid():
            self.release()
            raise RingError(self._holder_message(), EX_TEMPFAIL)

    def verify(self) -> str:
        """``ringd.host.lock.KernelLock.verify``: is our lock still on the file at our
        path (``ok``), locked again after it was removed or replaced
        (``retaken``), or does another process hold the new file (``lost``)?"""
        return self._lock.verify() if self._lock is not None else "ok"

    def _holder_message(self) -> str:
        data = load(self.state_dir)
        pid = data.get("pid") if watcher_alive(data) else None
        who = f"pid {pid}" if pid else "another process"
        return (f"another ringwatch ({who}) is already watching {self.state_dir}; "
                f"only one watcher per state dir")

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def reset(state_dir: Path) -> str:
    """``ringwatch reset``: clear the restart history and ``gave_up`` (like
    ``systemctl reset-failed``). Works while a watcher runs: it only drops the
    history and the give-up, under :func:`write_lock` (which a running watcher
    holds from reading its history to writing it back), and bumps ``reset_gen``,
    which a running watcher that keeps its state in memory (a full disk) checks
    before each use of it: so a running watcher's history is cleared too, never
    written back over the reset. Nothing changes unless the cleared state is
    saved (OSError otherwise: a full disk)."""
    with write_lock(state_dir):
        data = load(state_dir)
        was_given_up = gave_up(state_dir, data)
        if not data and not was_given_up and not state_path(state_dir).exists():
            return f"{state_dir}: no watcher state; nothing to reset"
        marker = state_dir / GAVE_UP_FILE
        if os.path.isdir(marker) and not os.path.islink(marker):
            # unlink cannot take it: refused before anything is saved (the cleared
            # history on disk with the give-up still in force was half a reset)
            raise RingError(f"{marker}: cannot reset: a directory, not the give-up marker; "
                            f"remove it and run it again (nothing was reset)", EX_FAILURE)
        had = len(restart_times(data, clock_now()))
        prev = data.get("reset_gen")   # only ever compared for equality: garbage restarts at 1
        data.update(reset_fields(prev + 1 if type(prev) is int and 0 <= prev < 2 ** 53 else 1))
        # Saved even when only the marker recorded the give-up (ringwatch.json
        # missing, or left stale by the full disk): the reset is on record
        # (reset_gen) and stale history goes with the give-up. Saved before the
        # marker goes: a save that fails (a disk still full) leaves the give-up
        # in force - removed first, the next watcher started the driver on a
        # history the reset never cleared.
        save(state_dir, data)
        try:
            os.unlink(marker)
        except FileNotFoundError:
            pass
    parts = [f"cleared {had} restart(s)"]
    if was_given_up:
        parts.append("and the give-up")
    return f"{state_dir}: {' '.join(parts)}; ringwatch may start the driver again"


def status_doc(state_dir: Path, data: Dict[str, Any], *, alive: bool, given_up: bool, driver_alive: bool,
               clock: Clock, start_limit_burst: int, start_limit_interval: float) -> Dict[str, Any]:
    """Pure: ``ringwatch status --json``, from ringwatch.json as read (``data``),
    whether its watcher and the driver it names live, and the start limit."""
    from ringd.core.watchpolicy import prune
    window = prune(restart_times(data, clock), clock.boot, start_limit_interval)
    driver = data.get("driver") if isinstance(data.get("driver"), dict) else {}
    text = (lambda k: data.get(k) if isinstance(data.get(k), str) else None)
    return {
        "state_dir": str(state_dir),
        "pid": data.get("pid") if alive else None,
        "alive": alive,
        "started_at": text("started_at"),
        "last_poll_at": text("last_poll_at"),
        "mode": text("mode"),
        "restarts": len(window),
        "restart_times": [iso(clock.wall - (clock.boot - b)) for b in window],
        "start_limit_burst": start_limit_burst,
        "start_limit_interval": start_limit_interval,
        "gave_up": given_up,
        "gave_up_at": text("gave_up_at"),
        "gave_up_reason": text("gave_up_reason"),
        "driver": {"pid": driver.get("pid"), "alive": driver_alive,
                   "health": driver.get("health") if isinstance(driver.get("health"), str) else None},
    }


def status_exit_code(doc: Dict[str, Any]) -> int:
    """``ringwatch status``: 1 gave up, 0 running, 3 not running (LSB)."""
    from ringd.core.errors import STATUS_OK, STATUS_STOPPED
    if doc["gave_up"]:
        return EX_FAILURE
    return STATUS_OK if doc["alive"] else STATUS_STOPPED
