"""Pure health rules for state files: whose a heartbeat is, its age, the driver's health."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ringd.core.timefmt import epoch


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
