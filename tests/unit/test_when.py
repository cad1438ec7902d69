"""parse_when: the times --since/--until take, as pure function of text, a clock and a zone."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from ringd.inputs.when import WhenError, parse_when

BERLIN = ZoneInfo("Europe/Berlin")
NOW = datetime(2026, 12, 6, 19, 30, 15, tzinfo=BERLIN).timestamp()   # a Sunday evening, CET (+01:00)


def local(*args, tz=BERLIN) -> float:
    return datetime(*args, tzinfo=tz).timestamp()


@pytest.mark.parametrize("text, back", [
    ("2h", 7200), ("1d 6h", 108000), ("90", 90), ("15min", 900), ("1h 30min", 5400), ("500ms", 0.5),
    ("-2h", 7200), ("2h ago", 7200), ("  2h  ", 7200), ("0", 0), ("1w", 604800),
])
def test_a_duration_is_back_from_now(text, back):
    assert parse_when(text, NOW, BERLIN) == pytest.approx(NOW - back)


@pytest.mark.parametrize("text, expected", [
    ("now", NOW),
    ("today", local(2026, 12, 6)), ("TODAY", local(2026, 12, 6)),
    ("yesterday", local(2026, 12, 5)), ("tomorrow", local(2026, 12, 7)),
    ("2026-12-06", local(2026, 12, 6)),
    ("2026-12-06T18:00", local(2026, 12, 6, 18)),
    ("2026-12-06 18:00", local(2026, 12, 6, 18)),
    ("2026-12-06  18:00", local(2026, 12, 6, 18)),
    ("2026-12-06t18:00:05", local(2026, 12, 6, 18, 0, 5)),
    ("2026-12-06 18:00:05.25", local(2026, 12, 6, 18, 0, 5) + 0.25),
    ("18:00", local(2026, 12, 6, 18)),
    ("07:05:09", local(2026, 12, 6, 7, 5, 9)),
])
def test_named_days_dates_and_times_are_local(text, expected):
    assert parse_when(text, NOW, BERLIN) == pytest.approx(expected)


@pytest.mark.parametrize("text, expected", [
    ("2026-12-06T18:00Z", datetime(2026, 12, 6, 18, tzinfo=timezone.utc).timestamp()),
    ("2026-12-06 18:00 UTC", datetime(2026, 12, 6, 18, tzinfo=timezone.utc).timestamp()),
    ("2026-12-06T18:00+05:30", datetime(2026, 12, 6, 12, 30, tzinfo=timezone.utc).timestamp()),
    ("2026-12-06T18:00-0500", datetime(2026, 12, 6, 23, tzinfo=timezone.utc).timestamp()),
    ("2026-12-06 18:00 -05", datetime(2026, 12, 6, 23, tzinfo=timezone.utc).timestamp()),
])
def test_a_given_zone_wins_over_the_local_one(text, expected):
    assert parse_when(text, NOW, BERLIN) == expected


def test_local_follows_the_zone_and_its_dst():
    summer = datetime(2026, 7, 1, 12, tzinfo=BERLIN).timestamp()
    assert parse_when("2026-07-01 12:00", NOW, BERLIN) == summer
    assert parse_when("2026-07-01 12:00", NOW, timezone.utc) == summer + 7200   # CEST is +02:00
    # "today" in Tokyo is already Monday at 03:30 on the same instant
    assert parse_when("today", NOW, ZoneInfo("Asia/Tokyo")) == local(2026, 12, 7, tz=ZoneInfo("Asia/Tokyo"))
    # the day DST begins is 23 hours long: yesterday is still its midnight
    spring = datetime(2026, 3, 29, 12, tzinfo=BERLIN).timestamp()
    assert spring - parse_when("today", spring, BERLIN) == timedelta(hours=11).total_seconds()


@pytest.mark.parametrize("text, says", [
    ("", "empty time"), ("   ", "empty time"),
    ("soon", "not a time: 'soon'; use a duration"),
    ("1h x", "not a time: '1h x'"),
    ("5 parsecs", "not a time"),
    ("2026-13-01", "month must be in 1..12"),
    ("2026-12-32", "day is out of range"),
    ("2026-12-06 25:00", "hour must be in 0..23"),
    ("2026-12-06 18:00 +24:00", "at most +23:59"),
    ("2026-12-06 18", "looks like a date or time"),
    ("2026-12", "looks like a date or time"),
    ("1:5", "looks like a date or time"),
    ("x" * 5000, "too long for a time"),
    ("\x1b[2J\x07", r"'\x1b[2J\x07'"),
    ("9999-12-31 23:59 -23:59", "out of range"),
    ("10000y", "out of range"),
])
def test_bad_input_is_one_clear_line(text, says):
    with pytest.raises(WhenError) as e:
        parse_when(text, NOW, BERLIN)
    message = str(e.value)
    assert says in message, message
    assert "\n" not in message and len(message) < 200 and "\x1b" not in message


def test_not_text_is_refused():
    with pytest.raises(WhenError):
        parse_when(None, NOW, BERLIN)   # type: ignore[arg-type]
    assert issubclass(WhenError, ValueError)
