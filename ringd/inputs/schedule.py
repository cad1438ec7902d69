"""Scheduled agents: when is one due? Pure functions of a schedule, the agent's
last start, the time its schedule was first seen, and a clock value.

A scheduled agent (``agents.<name>.schedule: "CRON"`` or ``every: SECONDS``)
takes no ordinary turn; the driver asks :func:`due` at each hop boundary.

Cron expressions are evaluated by ``cronsim`` in the box's local time zone
(a ``zoneinfo`` zone, so DST is known). The next due time is always the first
match *strictly after the last start* (an instant, not a wall-clock reading):
so a job runs at most once per slot whatever the clock or the zone does, a
slot missed while the ring was down runs once (not once per missed slot), and
a DST change never skips a day. Both DST changes follow Debian's cron: a job
with a fixed minute and hour runs a time skipped by spring-forward right after
the jump and the repeated hour of fall-back once; a wildcard job (its minute or
hour field starts with ``*``) runs on the new time at once, so the repeated
hour runs again (:func:`wildcard`).
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from datetime import datetime, timezone, tzinfo
from typing import Dict, Iterable, List, Optional, Tuple

from ringd.core.timefmt import epoch

_MAX_WALL_SKIPS = 100   # guard: matches looked at (a repeated stretch is jumped over at once)


class ScheduleError(ValueError):
    """A schedule that cannot be used; the message says why (the config adds the key)."""


@dataclass(frozen=True)
class Schedule:
    """One agent's schedule: exactly one of ``cron`` and ``every`` is set."""
    cron: Optional[str] = None
    every: Optional[float] = None

    def describe(self) -> str:
        return f"schedule {self.cron!r}" if self.cron is not None else f"every {self.every:g}s"


def check_cron(expr: object) -> str:
    """Validate a five-field cron expression; returns it normalised (single spaces)."""
    from cronsim import CronSim, CronSimError

    if not isinstance(expr, str):
        raise ScheduleError("must be a cron expression in quotes, e.g. \"0 0 * * *\"")
    fields = expr.split()
    if len(fields) != 5:
        # cronsim also takes a sixth (seconds) field; SPEC says five-field cron
        raise ScheduleError(f"must have five fields (minute hour day month weekday), not {len(fields)}")
    norm = " ".join(fields)
    try:
        next(CronSim(norm, datetime(2000, 1, 1, tzinfo=timezone.utc)))
    except CronSimError as e:
        raise ScheduleError(f"bad cron expression: {str(e).lower()}") from None
    except StopIteration:
        raise ScheduleError("cron expression never matches") from None
    return norm


_OWN_TZ = object()


def local_zone(tz: object = _OWN_TZ) -> tzinfo:
    """The box's local time zone as its C library reads it (cron's "local time"),
    as a zoneinfo zone (so DST rules are known): ``$TZ`` - a zone name, a TZif
    file (``:/path``), a POSIX rule (``CET-1CEST,M3.5.0,M10.5.0/3``), UTC when
    empty or unusable, as libc takes it - else ``/etc/localtime``, else UTC.
    ``tz``: another process's ``$TZ`` instead of ours (None: it had none) - the
    driver's, as its heartbeat says, for ``status``: an operator's shell with
    another ``TZ`` showed cron due times off by the difference.
    Never raises: whatever TZ says, ``ringd run`` runs what ``ringd check`` accepted."""
    if tz is _OWN_TZ:
        tz = os.environ.get("TZ")
    if not isinstance(tz, str):
        tz = None
    if tz is None:
        return _zone_file("/etc/localtime", "localtime") or timezone.utc
    key = tz[1:] if tz.startswith(":") else tz
    if not key:
        return timezone.utc
    if key.startswith("/"):
        return _zone_file(key, key) or timezone.utc
    from zoneinfo import ZoneInfo
    try:
        return ZoneInfo(key)   # (zoneinfo keeps it: one object per key)
    except (ValueError, OSError, KeyError):   # KeyError: ZoneInfoNotFoundError
        pass
    return _posix_rule(key) or timezone.utc


# A zone file read, by path: the file's identity then, and the zone (None: unusable).
# The driver asks for its zone at every turn a scheduled agent is on the roster:
# reading /etc/localtime cost 16 us a turn; a stat tells a file replaced or retargeted
# (timedatectl set-timezone) from the one read, and keeps the zone's object the
# same, so due times computed in it are reused (_cron_due).
_ZONE_FILES: Dict[str, Tuple[Tuple[int, int, int, int], Optional[tzinfo]]] = {}


def _zone_file(path: str, key: str) -> Optional[tzinfo]:
    """The TZif file at ``path`` as a zone (read again only once the file at
    ``path`` is another or has changed); None when it is missing, not a regular
    file or not TZif."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    known = _ZONE_FILES.get(path)
    if known is not None and known[0] == ident:
        return known[1]
    zone = _read_zone_file(path, key)
    if len(_ZONE_FILES) >= 8:   # ($TZ names a file: one per TZ an operator's status passes)
        _ZONE_FILES.clear()
    _ZONE_FILES[path] = (ident, zone)
    return zone


def _read_zone_file(path: str, key: str) -> Optional[tzinfo]:
    """Read the TZif file at ``path`` as a zone; None when it is missing, not a
    regular file (never a blocking read of a FIFO) or not TZif."""
    from zoneinfo import ZoneInfo
    from ringd.host.safefile import open_regular
    try:
        f = os.fdopen(open_regular(path), "rb")
    except OSError:
        return None
    with f:
        try:
            return ZoneInfo.from_file(f, key=key)
        except (ValueError, OSError):
            return None


@functools.lru_cache(maxsize=8)
def _posix_rule(rule: str) -> Optional[tzinfo]:
    """A POSIX TZ rule as a zone: a TZif file (RFC 8536, version 2) with no
    transitions, whose footer rule then holds for every instant. None when
    zoneinfo cannot read the rule (libc then uses UTC too)."""
    import io
    import struct
    from zoneinfo import ZoneInfo
    if not rule.isascii() or "\n" in rule:
        return None
    # one time type (UTC, "UTC\0"), no transitions: in the 32- and the 64-bit block alike
    block = b"TZif2" + bytes(15) + struct.pack(">6l", 0, 0, 0, 0, 1, 4) + struct.pack(">lBB", 0, 0, 0) + b"UTC\0"
    try:
        return ZoneInfo.from_file(io.BytesIO(block + block + b"\n" + rule.encode() + b"\n"), key=rule)
    except (ValueError, OSError):
        return None


def next_due(schedule: Schedule, last_start: Optional[float], since: float,
             tz: Optional[tzinfo] = None, last_wall: Optional[datetime] = None,
             set_back: Optional[float] = None) -> float:
    """Epoch time at which the agent is next due.

    ``last_start``: epoch time its last run started (None: never ran).
    ``since``: when this schedule was first seen by the ring (persisted, so a
    restart does not move it). ``every`` is due ``every`` s after the last
    start, at once if it never ran. A cron schedule is due at its first match
    after the later of the two (so a new schedule waits for its next matching
    minute instead of catching up on slots from before it existed).

    ``last_wall``: the local wall-clock time (naive) of the last start as read
    in the zone of that moment. A match of a job with a fixed minute and hour
    must also be later on the wall clock than that, so a box moved west (or an
    hour repeated by DST) never runs such a slot again; a wildcard job
    (:func:`wildcard`) runs on the new time at once, as Debian's cron does.
    None: read in ``tz``.

    ``set_back``: when the wall clock was first seen behind the last start
    (stepped back since it; None: it is not). Stepped back further than the
    schedule's spacing there, the clock was set, not corrected: the slots run
    ahead belong to a time that has not come, and the next due is the first
    match after ``set_back`` (cron takes a step of over three hours so, and
    systemd rewinds a timer's trigger time that lies ahead). A smaller step
    (NTP's) keeps the rule above - a slot already run is never run again; the
    wait grows by the step, to about twice the spacing. Unbounded, a clock a
    year ahead for a minute silenced a daily job for a year."""
    if schedule.every is not None:
        return since if last_start is None else last_start + schedule.every
    return _cron_due(schedule.cron, last_start, since, tz if tz is not None else local_zone(), last_wall, set_back)


def wildcard(cron: str) -> bool:
    """Does Debian's cron take ``cron`` for a wildcard job - its minute or hour
    field starts with ``*`` (``*``, ``*/15``)? Such a job runs on the local
    time as it is, the repeated hour of fall-back included; a job with a fixed
    minute and hour never runs a wall-clock time twice."""
    fields = cron.split()
    return len(fields) >= 2 and (fields[0].startswith("*") or fields[1].startswith("*"))


@functools.lru_cache(maxsize=512)
def _cron_due(cron: str, last_start: Optional[float], since: float, zone: tzinfo,
              last_wall: Optional[datetime], set_back: Optional[float]) -> float:
    """:func:`next_due` of a cron schedule. A pure function of its arguments,
    kept for the ones seen last: the driver asks at every turn, and a cron
    agent's due time changes only when it runs (20 us a cron agent a turn)."""
    due = _cron_next(cron, last_start, since, zone, last_wall)
    if set_back is not None and last_start is not None:
        # (no due time a date can show after a start the clock is behind: a clock that was set too)
        spacing = _cron_next(cron, due, due, zone, None) - due if math.isfinite(due) else 0.0
        if last_start - set_back > spacing:
            return _cron_next(cron, set_back, min(since, set_back), zone, None)
    return due


def _cron_next(cron: str, last_start: Optional[float], since: float, zone: tzinfo,
               last_wall: Optional[datetime]) -> float:
    """:func:`next_due` of a cron schedule, the clock aside; infinity when no
    date can show it (a start late in the year 9999: datetime ends there)."""
    try:
        return _cron_match(cron, last_start, since, zone, last_wall)
    except (OverflowError, ValueError):
        return float("inf")


def _cron_match(cron: str, last_start: Optional[float], since: float, zone: tzinfo,
                last_wall: Optional[datetime]) -> float:
    from cronsim import CronSim

    base = since if last_start is None else max(last_start, since)
    start = datetime.fromtimestamp(base, tz=zone)
    if wildcard(cron):
        last_wall = None   # (the instant rule alone: cronsim yields a repeated hour's slots once each)
    if last_wall is not None:
        wall_start = last_wall.replace(tzinfo=zone)
        if wall_start.timestamp() > base:
            start = wall_start
    it = CronSim(cron, start)
    try:
        for _ in range(_MAX_WALL_SKIPS):
            match = next(it)
            if last_wall is None or match.replace(tzinfo=None) > last_wall:
                return match.timestamp()
            # A wall-clock reading repeated (fall-back: an hour, two in some zones):
            # go on from the reading's later occurrence, never match by match - an
            # every-minute job would pass over 60 or 120 of them
            later = last_wall.replace(tzinfo=zone, fold=1)
            if later.timestamp() > match.timestamp():
                it = CronSim(cron, later)
    except StopIteration:  # no match within cronsim's 50-year horizon
        pass
    return float("inf")


@dataclass(frozen=True)
class Entry:
    """What the driver knows of one scheduled agent (from the journal)."""
    name: str
    schedule: Schedule
    last_start: Optional[float]
    since: float
    last_wall: Optional[datetime] = None
    set_back: Optional[float] = None   # the wall clock first seen behind its last start (next_due)

    def next_due(self, tz: tzinfo) -> float:
        return next_due(self.schedule, self.last_start, self.since, tz, self.last_wall, self.set_back)


def due(entries: Iterable[Entry], now: float, tz: Optional[tzinfo] = None) -> List[str]:
    """Names of the scheduled agents due at ``now``, in the order given (roster order)."""
    zone = tz if tz is not None else local_zone()
    return [e.name for e in entries if e.next_due(zone) <= now]


def wall_clock(t: float, tz: Optional[tzinfo] = None) -> datetime:
    """The naive local wall-clock reading of epoch time ``t`` (what to persist as
    ``last_wall`` when a scheduled run starts)."""
    return datetime.fromtimestamp(t, tz=tz if tz is not None else local_zone()).replace(tzinfo=None)


# --- what the journal keeps ------------------------------------------------------
# Per scheduled agent, meta ``schedule:<name>`` holds JSON {"spec", "since",
# "last_start", "last_wall", "set_back"}: when this schedule was first seen (so a restart does
# not move a never-run agent's first due time), and the epoch time and wall-clock
# reading of its last start, and when the wall clock was first seen behind that
# start (kept until it runs again: a due time counted from each turn's clock
# would move with it and never come). The last start is kept here as well as in its run:
# retention (``ring.keep_runs``) deletes the oldest runs whoever ran them, and a
# job whose last run went would be due again at once.
# ``tx`` is a journal transaction (ringd.journal.sqlite.Tx) or anything with its
# meta/set_meta/agent/run/running_row reads.

def _meta_key(name: str) -> str:
    return f"schedule:{name}"


def entry(tx, name: str, schedule: Schedule, now: float, write: bool = True) -> Entry:
    """The scheduled agent ``name`` as the journal knows it. A schedule seen for
    the first time (or changed) starts counting from ``now``, recorded when
    ``write`` (the driver; status only reads)."""
    import json
    try:
        kept = json.loads(tx.meta(_meta_key(name)) or "{}")
    except ValueError:
        kept = {}
    if not isinstance(kept, dict):
        kept = {}
    kept_start = epoch(kept.get("last_start"))
    if kept.get("spec") != schedule.describe() or epoch(kept.get("since")) is None:
        # (the last start is a fact of the agent, whatever its schedule says now)
        kept = {"spec": schedule.describe(), "since": now, "last_start": kept_start, "last_wall": None}
        if write:
            tx.set_meta(_meta_key(name), json.dumps(kept))
    running = tx.running_row()
    if running is not None and running.agent == name:
        run_start = running.started_at
    else:
        last_id = tx.agent(name).last_run_id
        last = tx.run(last_id) if last_id is not None else None
        run_start = last.started_at if last is not None else None
    last_start = max((t for t in (run_start, kept_start) if t is not None), default=None)
    if write and last_start is not None and last_start != kept_start:
        # a start not recorded here yet (a journal from before the key, ``ringd next``)
        kept["last_start"] = last_start
        tx.set_meta(_meta_key(name), json.dumps(kept))
    if schedule.every is not None and last_start is not None and last_start > now + schedule.every:
        # started before the wall clock was stepped back by more than a period: due now, not the
        # step's length later (a smaller step stretches one wait, to twice the period at most;
        # a cron slot is a wall-clock reading instead, never run twice: next_due)
        last_start = now - schedule.every
    if kept["since"] > now:
        # first seen on a wall clock stepped back since: a schedule that never ran has no
        # slot to run twice - due at its next match from now (kept: a since that moved
        # with the clock would never reach its match), not once the clock is back
        kept["since"] = now
        if write:
            tx.set_meta(_meta_key(name), json.dumps(kept))
    set_back = None
    if schedule.cron is not None and last_start is not None and last_start > now:
        set_back = epoch(kept.get("set_back"))
        if set_back is None or set_back > now:   # first seen now (or stepped back again)
            set_back = kept["set_back"] = now
            if write:
                tx.set_meta(_meta_key(name), json.dumps(kept))
    elif "set_back" in kept:   # the clock is past the last start again: that step is over
        del kept["set_back"]
        if write:
            tx.set_meta(_meta_key(name), json.dumps(kept))
    since = float(kept["since"])
    wall = None
    if isinstance(kept.get("last_wall"), str):
        try:
            wall = datetime.fromisoformat(kept["last_wall"])
        except ValueError:
            wall = None
    return Entry(name, schedule, last_start, since, wall, set_back)


def last_turn(journal, config, newest):
    """The run the ring resumes after: ``newest`` (the journal's newest row, or the
    run in flight), unless it is a scheduled agent's - a scheduled run is not a
    turn - then the newest of the ordinary agents' last runs, however many
    scheduled runs came since (the driver at start-up, and ``ringd status``
    estimating the next turn; one read of each agent's last run, whatever the
    journal's size). ``newest`` when no ordinary agent ever ran."""
    if newest is None or config.schedule_for(newest.agent) is None:
        return newest
    ordinary = [r for r in journal.last_runs().values() if config.schedule_for(r.agent) is None]
    return max(ordinary, key=lambda r: r.id, default=newest)


ROUND_KEY = "schedule_round"   # the driver's round (policy.round_after): a JSON list of names


def read_round(tx) -> frozenset:
    """The scheduled agents run since the last ordinary turn, as the driver
    keeps them (anything else there is no round: every job may run)."""
    import json
    try:
        names = json.loads(tx.meta(ROUND_KEY) or "[]")
    except ValueError:
        names = []
    return frozenset(n for n in names if isinstance(n, str)) if isinstance(names, list) else frozenset()


def write_round(tx, names: frozenset) -> None:
    import json
    tx.set_meta(ROUND_KEY, json.dumps(sorted(names)) if names else None)


def record_start(tx, name: str, now: float, tz: Optional[tzinfo] = None) -> None:
    """A scheduled run starts: keep the wall-clock reading of its start."""
    import json
    try:
        kept = json.loads(tx.meta(_meta_key(name)) or "{}")
    except ValueError:
        kept = {}
    if isinstance(kept, dict):
        kept["last_start"], kept["last_wall"] = now, wall_clock(now, tz).isoformat()
        kept.pop("set_back", None)   # a start on this clock: nothing lies ahead of it now
        tx.set_meta(_meta_key(name), json.dumps(kept))



MAX_SLOTS = 500   # due times one agent shows in a picture (an every-minute job over a day is 1440)


def due_between(schedule: Schedule, starts: Iterable[float], since: float, until: float,
                tz: Optional[tzinfo] = None, limit: int = MAX_SLOTS) -> List[float]:
    """The times a scheduled agent was due within ``[since, until]`` (for the
    report's picture): a cron schedule's matching minutes in ``tz``; for
    ``every``, ``every`` seconds after each of its run ``starts``. At most
    ``limit`` of them, the earliest."""
    if schedule.every is not None:
        return sorted(t for t in (s + schedule.every for s in starts) if since <= t <= until)[:limit]
    from cronsim import CronSim
    out: List[float] = []
    try:
        # (a match exactly at ``since`` counts: cronsim yields only later ones)
        for match in CronSim(schedule.cron, datetime.fromtimestamp(since - 1, tz=tz or local_zone())):
            t = match.timestamp()
            if t > until or len(out) >= limit:
                break
            if t >= since:
                out.append(t)
    except (StopIteration, OverflowError, ValueError):
        pass
    return out
