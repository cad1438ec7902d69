"""Times as the state files and JSON show them: ISO 8601 UTC, read back leniently."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Optional


def iso(ts: Optional[float]) -> Optional[str]:
    """Epoch seconds -> ISO 8601 UTC ('2026-12-01T06:14:20.123456+00:00')."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()


def parse_iso(text: Any) -> Optional[float]:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


# The epoch seconds iso() can show (years 1 to 9999, UTC).
_FIRST, _AFTER_LAST = -62135596800.0, 253402300800.0


def epoch(value: Any) -> Optional[float]:
    """A time read from a state file (epoch seconds, or ISO 8601) as epoch
    seconds; None for anything else. A number no date can show is None too
    (JSON's 1e999 is inf, NaN, 1e308): iso() raised on it, and one such stamp
    in a heartbeat made ``ringd status`` an internal error (exit 1, "dead")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if _FIRST <= value < _AFTER_LAST else None   # (an int float() cannot take too)
    t = parse_iso(value)
    return t if t is not None and _FIRST <= t < _AFTER_LAST else None
