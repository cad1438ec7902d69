"""Pure: can a process identity recorded by another process (pid + start ticks,
with the boot and pid namespace it saw) name a process that this one sees?

A record carries ``boot_id`` (the boot id its writer read), ``boot_view`` (where
that id came from: ``"kernel"``, or ``"mounted"`` when a file was mounted over
the kernel's, as systemd-nspawn gives each container boot an id of its own) and
``pid_ns`` (the inode of its writer's pid namespace). Older records lack some;
what is absent is not compared.

Rules:
- a pid of another pid namespace names another process here, whatever the boot;
- two processes that read their boot id from the same kind of source compare
  it: another id is another boot, whose pids and ticks name nobody now;
- two that read it from different sources (a unit's private procfs under
  ``ProtectProc=`` shows the kernel's, a shell in the container the one mounted
  over it) cannot compare it: there the shared pid namespace decides. Ticks
  count from the kernel's boot, so within one pid namespace a pid and its start
  tick are never handed out twice until a reboot (after which a new namespace
  may get the old one's inode: only this case trusts a record of an earlier
  boot, until the new driver's first heartbeat replaces it).
"""
from __future__ import annotations

from typing import Any, Mapping

BOOT_VIEWS = ("kernel", "mounted")


def recorded_here(rec: Mapping[str, Any], mine: Mapping[str, Any]) -> bool:
    """Was ``rec`` (the keys above, as recorded) recorded in the boot and pid
    namespace that ``mine`` (the same keys, read by this process now) describes?"""
    ns, my_ns = rec.get("pid_ns"), mine.get("pid_ns")
    if ns is not None and my_ns is not None and ns != my_ns:
        return False
    boot, my_boot = rec.get("boot_id"), mine.get("boot_id")
    if boot is None or my_boot is None:
        return True
    view, my_view = rec.get("boot_view"), mine.get("boot_view")
    if view in BOOT_VIEWS and my_view in BOOT_VIEWS and view != my_view:
        return ns is not None and ns == my_ns   # different sources: only the shared namespace can tell
    return boot == my_boot
