"""Points in time as an operator types them (``--since``/``--until``): a pure parser.

``parse_when(text, now, tz)`` returns epoch seconds for

- a duration back from ``now``: a systemd time span (``2h``, ``1d 6h``, ``90``,
  ``15min``; :mod:`ringd.inputs.timespan`), optionally written ``-2h`` or ``2h ago``;
- ``now``, ``today``, ``yesterday``, ``tomorrow`` (midnight, local);
- a time of day, today: ``18:00``, ``18:00:30``;
- an ISO date or date-time: ``2026-12-06``, ``2026-12-06T18:00``,
  ``2026-12-06 18:00:05.5``, local in ``tz`` unless a zone follows it
  (``Z``, ``UTC``, ``+01:00``, ``+0100``, ``-05``).

No clock is read and no file opened: ``now`` and ``tz`` (a ``tzinfo``, e.g.
:func:`ringd.inputs.schedule.local_zone`) are the caller's. Bad input raises
:class:`WhenError` (a ``ValueError``) whose message is one short line.
"""
from __future__ import annotations

import re
from datetime import datetime, time, timedelta, timezone, tzinfo
from typing import Optional

from ringd.inputs.timespan import parse_timespan

MAX_CHARS = 64
HINT = "use a duration back from now (2h, 1d 6h), today, yesterday, 18:00, or 2026-12-06, 2026-12-06 18:00"

_DATE = re.compile(r"(\d{4})-(\d{2})-(\d{2})")
_CLOCK = r"(\d{2}):(\d{2})(?::(\d{2})(?:[.,](\d{1,9}))?)?"
_DATETIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})(?:[T ]|\s+)" + _CLOCK + r"\s*(Z|UTC|[+-]\d{2}(?::?\d{2})?)?",
                       re.IGNORECASE)
_TIME_OF_DAY = re.compile(_CLOCK)
FIRST, AFTER_LAST = -62135596800.0, 253402300800.0   # the epoch seconds a UTC date can show
_DAYS = {"today": 0, "yesterday": -1, "tomorrow": 1}


class WhenError(ValueError):
    """A time that cannot be read; the message says what was given and what works."""


def parse_when(text: str, now: float, tz: tzinfo) -> float:
    """Epoch seconds of ``text`` (see the module's docstring); raises :class:`WhenError`."""
    if not isinstance(text, str):
        raise WhenError(f"not a time: {text!r}; {HINT}")
    shown = _excerpt(text)
    if len(text) > MAX_CHARS:
        raise WhenError(f"too long for a time: {shown}; {HINT}")
    s = " ".join(text.split())
    if not s:
        raise WhenError(f"empty time; {HINT}")
    try:
        at = _named(s.lower(), now, tz)
        if at is None:
            at = _absolute(s, now, tz)
    except (OverflowError, OSError) as e:   # a date no clock can show (year 1 west of UTC, 9999 east)
        raise WhenError(f"out of range: {shown} ({e})") from None
    except ValueError as e:
        raise WhenError(f"not a time: {shown} ({e})") from None
    if at is None:
        try:
            at = now - _back(s)
        except ValueError:
            raise WhenError(f"not a time: {shown}; {HINT}") from None
    if not FIRST <= at < AFTER_LAST:
        raise WhenError(f"out of range: {shown} (years 1 to 9999, UTC)")
    return at


def _excerpt(text: str, limit: int = 40) -> str:
    """``text`` quoted for an error line: short, its control characters escaped."""
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


def _named(s: str, now: float, tz: tzinfo) -> Optional[float]:
    if s == "now":
        return now
    if s in _DAYS:
        day = datetime.fromtimestamp(now, tz).date() + timedelta(days=_DAYS[s])
        return _local(datetime.combine(day, time(0)), tz)
    return None


def _absolute(s: str, now: float, tz: tzinfo) -> Optional[float]:
    """An ISO date, date-time or time of day; None when ``s`` is none of these."""
    m = _DATETIME.fullmatch(s)
    if m:
        y, mo, d, hh, mm, ss, frac, zone = m.groups()
        wall = datetime(int(y), int(mo), int(d), *_clock(hh, mm, ss, frac))
        if zone is None:
            return _local(wall, tz)
        return wall.replace(tzinfo=_zone(zone)).timestamp()
    m = _DATE.fullmatch(s)
    if m:
        return _local(datetime(*(int(g) for g in m.groups())), tz)
    m = _TIME_OF_DAY.fullmatch(s)
    if m:
        day = datetime.fromtimestamp(now, tz).date()
        return _local(datetime.combine(day, time(*_clock(*m.groups()))), tz)
    if re.match(r"\d{4}-\d", s) or re.match(r"\d{1,2}:\d", s):
        raise ValueError("looks like a date or time, but is not one (YYYY-MM-DD, HH:MM[:SS])")
    return None


def _clock(hh: str, mm: str, ss: Optional[str], frac: Optional[str]) -> "tuple[int, int, int, int]":
    micro = int((frac or "0").ljust(6, "0")[:6])
    return int(hh), int(mm), int(ss or 0), micro


def _zone(text: str) -> tzinfo:
    t = text.upper()
    if t in ("Z", "UTC"):
        return timezone.utc
    sign = -1 if t[0] == "-" else 1
    digits = t[1:].replace(":", "")
    hours, minutes = int(digits[:2]), int(digits[2:] or 0)
    if hours > 23 or minutes > 59:
        raise ValueError("a zone offset is at most +23:59")
    return timezone(sign * timedelta(hours=hours, minutes=minutes))


def _local(wall: datetime, tz: tzinfo) -> float:
    """The wall-clock reading ``wall`` in ``tz`` (a reading DST skips or repeats:
    as zoneinfo takes it, fold 0)."""
    return wall.replace(tzinfo=tz).timestamp()


def _back(s: str) -> float:
    """Seconds of a duration back from now: ``2h``, ``-2h``, ``2h ago``."""
    span = s[1:] if s.startswith("-") else s
    if span.lower().endswith(" ago"):
        span = span[:-4]
    return parse_timespan(span)

