"""``ringd reload``: what ``kill -HUP`` does, with an answer.

The driver and the watcher re-read their config (and the driver its roster)
on SIGHUP. This sends it - to the watcher that owns the driver, which passes
it on, or else to each of them - and waits (bounded) until the driver's
heartbeat carries a newer ``reload`` record: its number (``seq``), what
changed, and the errors that kept an old config or roster. The request and
its answer are events (``ringd events``) naming who asked and why.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Mapping, Optional

from ringd.cli.status import OperatorError, require_state_dir
from ringd.core.errors import EX_CONFIG, EX_FAILURE
from ringd.inputs.config import Config
from ringd.host.heartbeat import WATCHER_FILE, heartbeat_path, live_writer, read_heartbeat, read_own

WAIT = 5.0           # s; the SPEC's bound on the driver's answer
FORWARD_WAIT = 1.5   # s; then the driver is signalled itself (its watcher did not pass the signal on)


@dataclass
class ReloadResult:
    driver_pid: int
    record: Optional[Mapping[str, Any]]     # the driver's new ``reload`` (None: no answer in time)
    waited: float
    watcher_pid: Optional[int] = None       # the watcher signalled too, if any
    watcher_record: Optional[Mapping[str, Any]] = None   # its own ``reload``, if it answered meanwhile
    signalled: List[str] = field(default_factory=list)
    unrecorded: Optional[str] = None        # why the answer's event could not be written, if it could not

    @property
    def errors(self) -> List[Mapping[str, Any]]:
        errs = (self.record or {}).get("errors")
        return [e for e in errs if isinstance(e, Mapping)] if isinstance(errs, list) else []

    @property
    def changed(self) -> List[str]:
        ch = (self.record or {}).get("changed")
        return [c for c in ch if isinstance(c, str)] if isinstance(ch, list) else []

    @property
    def exit_code(self) -> int:
        if self.record is None:
            return EX_FAILURE
        return EX_CONFIG if self.errors else 0


def seq_of(record: Any) -> int:
    """Pure: the number of a ``reload`` record (0 for none)."""
    seq = record.get("seq") if isinstance(record, Mapping) else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else 0


MAX_DETAIL_CHARS = 500   # an event's detail: what changed, or why it was refused, never a whole config


def outcome_event(result: ReloadResult) -> "tuple[str, str]":
    """Pure: the kind and detail of the event that records the driver's answer."""
    if result.record is None:
        kind, detail = "reload-unanswered", f"driver pid {result.driver_pid}: no answer within {result.waited:.1f}s"
    elif result.errors:
        kind = "reload-refused"
        detail = "; ".join(f"{e.get('kind')}: {' '.join(str(e.get('detail')).split())}" for e in result.errors)
    else:
        kind, detail = "reloaded", "; ".join(result.changed) or "nothing changed"
    return kind, detail if len(detail) <= MAX_DETAIL_CHARS else detail[:MAX_DETAIL_CHARS - 3] + "..."


def reload(state_dir: Path, config: Config, wait: float = WAIT, clock: Callable[[], float] = time.monotonic,
           poll: float = 0.02, *, actor: Optional[Mapping[str, Any]] = None,
           reason: Optional[str] = None) -> ReloadResult:
    """SIGHUP the ring's driver and watcher and wait up to ``wait`` for the
    driver to say it reloaded. OperatorError (1) when no driver runs. The
    request is recorded (``actor``, ``reason``) before any signal, as every
    control verb's is, so a caller who cannot write the journal changes
    nothing; the answer is recorded after it."""
    require_state_dir(state_dir)
    hb = read_heartbeat(state_dir)
    writer = live_writer(hb)
    if writer is None:
        unread = heartbeat_path(state_dir)
        if os.path.lexists(unread) and not os.access(unread, os.R_OK):   # (not "no driver": it may well run)
            raise OperatorError(f"{unread}: not readable by this user, so whether a driver runs is unknown: "
                                f"nothing reloaded (run it as the ring's user)", EX_FAILURE)
        raise OperatorError("no driver is running: nothing to reload (the next one reads the config as it starts)",
                            EX_FAILURE)
    from ringd.cli.control import clean_reason, record_event
    why = clean_reason(reason)
    record_event(state_dir, config, "reload-requested", f"driver pid {writer[0]}", actor=actor, reason=why)
    result = _signal_and_wait(state_dir, hb, writer, wait, clock, poll)
    kind, detail = outcome_event(result)
    try:
        record_event(state_dir, config, kind, detail, actor=actor, reason=why)
    except OperatorError as e:   # the reload happened: it is said, not undone
        result.unrecorded = str(e)
    return result


def _signal_and_wait(state_dir: Path, hb: Mapping[str, Any], writer: "tuple[int, Any]", wait: float,
                     clock: Callable[[], float], poll: float) -> ReloadResult:
    """The SIGHUPs and the bounded wait for the driver's (and the watcher's) answer."""
    from ringd.host import proctree
    from ringd.loops.reaper import as_ring_owner
    before = seq_of(hb.get("reload"))
    watcher = read_own(state_dir / WATCHER_FILE, state_dir)
    watching = live_writer(watcher)
    w_before = seq_of((watcher or {}).get("reload"))
    # a watcher that owns this driver passes SIGHUP on: signalled itself too, the driver would reload twice
    owns = watching is not None and watcher.get("mode") == "owner" \
        and (watcher.get("driver") or {}).get("pid") == writer[0]

    def hup(who: str, pid: int, start: Any) -> None:
        if as_ring_owner(state_dir, lambda: proctree.signal_process(pid, start, signal.SIGHUP)):
            result.signalled.append(who)
    result = ReloadResult(driver_pid=writer[0], record=None, waited=0.0,
                          watcher_pid=watching[0] if watching else None)
    t0 = clock()
    if watching is not None:
        hup("watcher", *watching)
    if not owns:
        hup("driver", *writer)
    while True:
        now = clock()
        hb = read_heartbeat(state_dir) or {}
        if hb.get("pid") == writer[0] and seq_of(hb.get("reload")) > before:
            result.record = hb["reload"]
            break
        if hb.get("pid") != writer[0] or live_writer(hb) is None or now - t0 >= wait:
            break   # (the driver stopped, or was replaced, meanwhile)
        if owns and "driver" not in result.signalled and now - t0 >= FORWARD_WAIT:
            hup("driver", *writer)
        time.sleep(poll)
    result.waited = clock() - t0
    while watching is not None and "watcher" in result.signalled:   # its answer, if it comes soon
        w = read_own(state_dir / WATCHER_FILE, state_dir) or {}
        if seq_of(w.get("reload")) > w_before:
            result.watcher_record = w.get("reload")
            break
        if clock() - t0 >= min(wait, result.waited + 1.0):
            break
        time.sleep(poll)
    return result
