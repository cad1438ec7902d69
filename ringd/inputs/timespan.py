"""systemd time spans (systemd.time(7)) for config durations: ``90``, ``"90s"``,
``"15min"``, ``"1h 30min"``, ``"2d"``, ``"1.5h"``, ``"500ms"``.

Pure parsing, no I/O. The keys already carry systemd's names (``restart_sec``,
``start_limit_interval``), so their values read the way a unit file's do. A
bare number in a string is seconds, as in systemd. ``infinity`` is refused:
every ring duration must be finite.
"""
from __future__ import annotations

import re

# systemd.time(7), "PARSING TIME SPANS" (units are case-sensitive: M is a month, m a minute).
UNITS = {
    "usec": 1e-6, "us": 1e-6, "\u00b5s": 1e-6,
    "msec": 1e-3, "ms": 1e-3,
    "seconds": 1.0, "second": 1.0, "sec": 1.0, "s": 1.0, "": 1.0,
    "minutes": 60.0, "minute": 60.0, "min": 60.0, "m": 60.0,
    "hours": 3600.0, "hour": 3600.0, "hr": 3600.0, "h": 3600.0,
    "days": 86400.0, "day": 86400.0, "d": 86400.0,
    "weeks": 604800.0, "week": 604800.0, "w": 604800.0,
    "months": 2629800.0, "month": 2629800.0, "M": 2629800.0,   # 30.44 days
    "years": 31557600.0, "year": 31557600.0, "y": 31557600.0,  # 365.25 days
}
_PART = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z\u00b5]*)")
MAX_CHARS = 64


def parse_timespan(text: str) -> float:
    """Seconds in a systemd time span. Raises ValueError with a short reason."""
    if len(text) > MAX_CHARS:
        raise ValueError("too long for a time span")
    s = text.strip()
    if not s:
        raise ValueError("empty time span")
    total = 0.0
    pos = 0
    while pos < len(s):
        m = _PART.match(s, pos)
        if not m:
            raise ValueError("not a time span (use e.g. 90, 90s, 15min, 1h 30min, 2d)")
        unit = m.group(2)
        if unit not in UNITS:
            raise ValueError(f"unknown time unit {unit!r} (use us, ms, s, min, h, d, w, M, y)")
        if not unit and m.end() < len(s) and not s[m.end() - 1].isspace():
            # "1.5.5" read as 1.5 + .5: a typo of "1.55" became 2 s. systemd refuses it too
            raise ValueError("not a time span (use e.g. 90, 90s, 15min, 1h 30min, 2d)")
        total += float(m.group(1)) * UNITS[unit]
        pos = m.end()
        while pos < len(s) and s[pos].isspace():
            pos += 1
    return total
