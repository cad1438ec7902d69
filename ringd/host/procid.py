"""Process identity: a pid together with the process's start time in clock ticks
since boot (field 22 of ``/proc/<pid>/stat``). The one place any part of ring
(heartbeat, status, reaper, proctree, ringwatch) decides "is this still the
process we meant?".

Why ticks and not psutil's ``create_time()``: that is ``/proc/stat``'s ``btime``
(wall clock at boot) plus these ticks, and ``btime`` moves whenever the wall
clock is stepped, so after a step every stored epoch start time names nobody:
a live driver looks dead (its run reaped, its agent killed) and the watcher
replaces a healthy driver. Ticks since boot never move. Nothing here reads the
wall clock or ``btime``.

A zombie is dead: it has exited, only its exit status waits to be collected.

Records others read (the heartbeat, ringwatch.json) also say which boot and pid
namespace their pids are of (:func:`here`); ringd.core.identity decides whether
a record can name a process this process sees. Not the boot id alone: a unit's
private procfs (``ProtectProc=``) and a shell in a container read different ones.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, Mapping, Optional, Tuple

from ringd.core import identity

_LINUX = sys.platform.startswith("linux")


def read_small(path: str) -> bytes:
    """A small kernel file (``/proc``, cgroupfs) in one read, without the io
    stack: these are read several times per hop. Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def read_list(path: str) -> bytes:
    """A kernel list file (``/proc/<pid>/task/<tid>/children``) read to its end:
    the kernel hands such a file out one page of whole entries per read (4 KiB:
    about 800 pids), so :func:`read_small` saw only the first 800 children of a
    driver that 1200 orphans had re-parented to - the rest were neither
    killed with their run in that pass nor reaped. Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def start_ticks(pid: Any) -> Optional[int]:
    """The boot-relative start ticks of live process ``pid``; None if there is no
    such process, it is a zombie, or it cannot be read."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    if not _LINUX:
        return _fallback_ticks(pid)
    found = parent_and_ticks(pid)
    return None if found is None else found[1]


def parent_and_ticks(pid: int) -> Optional[Tuple[int, int]]:
    """(parent pid, start ticks) of live process ``pid``, read together in one
    read (Linux): a process found as a child of P is still the one listed if
    its parent is still P - a recycled pid names some other parent's child.
    None if there is no such process, it is a zombie, or it cannot be read."""
    try:
        data = read_small(f"/proc/{pid}/stat")
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so
    # split after its last ')'. Then index 0 is field 3 (state), 1 field 4
    # (ppid), 19 field 22 (start ticks).
    fields = data[data.rfind(b")") + 2:].split()
    try:
        if fields[0] in (b"Z", b"X", b"x"):
            return None
        return int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def same_process(pid: Any, ticks: Any, rec: Optional[Mapping[str, Any]] = None) -> bool:
    """True when ``pid`` is alive and is the process that started at ``ticks``
    (as returned by :func:`start_ticks`, possibly round-tripped through JSON or a
    REAL column), recorded with ``rec`` (:func:`here`'s keys as its writer read
    them; None or absent keys: not recorded, taken as here). A recycled pid, a
    zombie, a malformed record, one from before a reboot or one of another pid
    namespace never match: ticks count from boot, and a deterministic boot
    hands out the same pid at the same tick again."""
    want = _as_ticks(ticks)
    return want is not None and (rec is None or recorded_here(rec)) and start_ticks(pid) == want


_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_here: Optional[Dict[str, Any]] = None


def boot_id() -> Optional[str]:
    """This boot's random id as this process reads it (a new one at every boot);
    None without one (not Linux)."""
    return here()["boot_id"]


def here() -> Dict[str, Any]:
    """What a process identity recorded by this process is tied to
    (ringd.core.identity): ``boot_id``, ``boot_view`` and ``pid_ns``; None
    where it cannot be read. Read once: none of them changes while a process lives."""
    global _here
    if _here is None:
        _here = {"boot_id": None, "boot_view": None, "pid_ns": None}
        if _LINUX:
            _here.update(boot_id=_read_boot_id(), boot_view=_boot_view(), pid_ns=_pid_ns())
    return dict(_here)


def recorded_here(rec: Mapping[str, Any]) -> bool:
    """Was an identity recorded with ``rec`` (:func:`here`'s keys) recorded in
    this boot and this pid namespace, as far as both sides can tell?"""
    return identity.recorded_here(rec, here())


def _read_boot_id() -> Optional[str]:
    try:
        return read_small(_BOOT_ID).decode("ascii", "replace").strip() or None
    except OSError:
        return None


def _boot_view() -> Optional[str]:
    """``"mounted"`` when a file is mounted over the kernel's boot id (its file
    system is not its folder's: systemd-nspawn's per-container id), else ``"kernel"``."""
    try:
        inside, folder = os.stat(_BOOT_ID), os.stat(os.path.dirname(_BOOT_ID))
    except OSError:
        return None
    return "kernel" if inside.st_dev == folder.st_dev else "mounted"


def _pid_ns() -> Optional[int]:
    """The inode of this process's pid namespace: alike in every view of /proc."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _as_ticks(value: Any) -> Optional[int]:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None  # absent, or an epoch start time written by an older ring


def _fallback_ticks(pid: int) -> Optional[int]:
    """Without /proc (macOS): psutil's start time in centiseconds. It is epoch
    based there, so on such systems a clock step can still confuse identity."""
    import psutil
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return round(p.create_time() * 100)
    except (psutil.Error, OSError):
        return None
